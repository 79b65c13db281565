"""Conversation data sets by name: what `data.train`, `prepare` and `regenerate --input` read
for `ultrachat`, `sharegpt`, `nemotron-v2-chat`, ... (`sources.resolve_sources` expands them).

Each name is a hub dataset (read from the Hugging Face cache: `hf download --repo-type dataset
ID --include FILES` fetches it), the files of one split in their published layout, and the rows
those files hold. Every preset's rows are OpenAI `messages` (role/content) or ShareGPT
`conversations` (from/value), which `formats.normalize_record` (training) and
`formats.chat_messages` (evaluation prompts, regeneration) map to messages; the preset names which.
"""

from __future__ import annotations

import dataclasses

from dflash_jax.models.formats.hub import HF_DATASETS


@dataclasses.dataclass(frozen=True)
class Preset:
    repo_id: str
    files: str  # a glob inside the repository: one split's files
    data_format: str  # the field holding each row's conversation: `messages` or `conversations`
    rows: int  # the split's rows as its publisher counts them (ShareGPT's and PerfectBlend's: about)

    @property
    def source(self) -> str:
        """The `hf://datasets/...` source this preset reads."""
        return f"{HF_DATASETS}{self.repo_id}/{self.files}"


_NEMOTRON_V2 = {"chat": 627_720, "code": 175_000, "math": 239_467, "stem": 355_000}

PRESETS = {
    # UltraChat 200k's SFT split (z-lab's Llama-3.1 drafter is named after it).
    "ultrachat": Preset("HuggingFaceH4/ultrachat_200k", "data/train_sft-*.parquet", "messages", 207_865),
    # ShareGPT as FastChat cleaned it: one JSON array of {id, conversations: [{from, value}]}.
    "sharegpt": Preset(
        "anon8231489123/ShareGPT_Vicuna_unfiltered",
        "ShareGPT_V3_unfiltered_cleaned_split.json",
        "conversations",
        94_145,
    ),
    # Open-PerfectBlend: {conversations: [{from, value}], source}.
    "perfectblend": Preset("mlabonne/open-perfectblend", "data/train-*.parquet", "conversations", 1_420_909),
    # NVIDIA's post-training set v2, its English splits: {uuid, ..., messages: [{role, content}]}.
    **{
        f"nemotron-v2-{split}": Preset(
            "nvidia/Nemotron-Post-Training-Dataset-v2", f"data/{split}-*.parquet", "messages", rows
        )
        for split, rows in _NEMOTRON_V2.items()
    },
}


def describe_presets() -> str:
    """`ultrachat (HuggingFaceH4/ultrachat_200k, data/train_sft-*.parquet: 207,865 rows of messages), ...`"""
    return ", ".join(
        f"{name} ({p.repo_id}, {p.files}: {p.rows:,} rows of {p.data_format})" for name, p in PRESETS.items()
    )
