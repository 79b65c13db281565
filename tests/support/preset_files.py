"""Small files in the published layout of each data set `dflash_jax.data.presets` names (the
columns and file names their dataset cards list), with files of other splits beside them, for a
fake hub cache (`support.hub_cache`)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from support.hub_cache import add_to_hub_cache


def parquet_bytes(rows: list[dict]) -> bytes:
    out = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), out)
    return out.getvalue()


def openai(question: str, answer: str, system: str | None = None) -> list[dict]:
    return [{"role": "system", "content": system}] * (system is not None) + [
        {"role": "user", "content": question},
        {"role": "assistant", "content": answer},
    ]


def sharegpt(question: str, answer: str) -> list[dict]:
    return [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]


# preset name -> (repo id, {path in the repository: contents}, the questions its split holds)
def published_files() -> dict[str, tuple[str, dict[str, bytes], list[str]]]:
    ultrachat = [
        {"prompt": q, "prompt_id": f"id{i}", "messages": openai(q, f"answer {i}")}
        for i, q in enumerate(["uc one", "uc two", "uc three"])
    ]
    nemotron = {
        split: [
            {
                "uuid": f"{split}{i}",
                "license": "CC BY 4.0",
                "generator": "model",
                "version": "v2",
                "category": split,
                "reasoning": "off",
                "messages": openai(f"{split} question {i}", f"{split} answer {i}", system=""),
            }
            for i in range(2)
        ]
        for split in ("chat", "math")
    }
    return {
        "ultrachat": (
            "HuggingFaceH4/ultrachat_200k",
            {
                "README.md": b"---\n---\n",
                "data/train_sft-00000-of-00002-aaaa.parquet": parquet_bytes(ultrachat[:2]),
                "data/train_sft-00001-of-00002-bbbb.parquet": parquet_bytes(ultrachat[2:]),
                "data/test_sft-00000-of-00001-cccc.parquet": parquet_bytes([ultrachat[0] | {"prompt": "held out"}]),
            },
            ["uc one", "uc two", "uc three"],
        ),
        "sharegpt": (
            "anon8231489123/ShareGPT_Vicuna_unfiltered",
            {
                "ShareGPT_V3_unfiltered_cleaned_split.json": json.dumps(
                    [{"id": f"sg{i}", "conversations": sharegpt(f"sg {i}", f"reply {i}")} for i in range(3)]
                ).encode(),
                "ShareGPT_V3_unfiltered_cleaned_split_no_imsorry.json": b"[]",
                "HTML_cleaned_raw_dataset/sg_90k_part1.json": b"[]",
            },
            ["sg 0", "sg 1", "sg 2"],
        ),
        "perfectblend": (
            "mlabonne/open-perfectblend",
            {
                "data/train-00000-of-00001.parquet": parquet_bytes(
                    [{"conversations": sharegpt(f"pb {i}", f"blend {i}"), "source": "src"} for i in range(2)]
                )
            },
            ["pb 0", "pb 1"],
        ),
        "nemotron-v2-chat": (
            "nvidia/Nemotron-Post-Training-Dataset-v2",
            {f"data/{split}-00000-of-00001.parquet": parquet_bytes(rows) for split, rows in nemotron.items()},
            ["chat question 0", "chat question 1"],
        ),
    }


def add_published_datasets(cache: Path) -> dict[str, list[str]]:
    """Writes every published layout into the hub cache at `cache`; returns each preset's questions."""
    questions = {}
    for name, (repo_id, files, asked) in published_files().items():
        add_to_hub_cache(cache, repo_id, files, repo_type="dataset")
        questions[name] = asked
    return questions
