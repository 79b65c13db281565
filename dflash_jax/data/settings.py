"""The data settings of a run: where the conversations are and how they become batches.

`DataConfig` is the `config.data` section after `training.run_config.resolve` has checked it; its
defaults are the section's defaults, and each sentinel value is documented here, once.
"""

from __future__ import annotations

import dataclasses

from dflash_jax.data.formats import FORMATS
from dflash_jax.field_checks import at_least, one_of

ON_BAD_SAMPLE = ("skip", "error")
OVERLENGTH = ("truncate", "drop")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    # JSONL / Parquet file, directory (searched recursively) or glob; comma-separate several.
    train: str = ""
    # 'auto' picks per record by field: `messages` (OpenAI role/content), `conversations`
    # (ShareGPT from/value) or `text` (plain document, every token trained on).
    format: str = "auto"
    # Tokenized cache location; '' = ~/.cache/dflash_jax/tokenized/<target>-<hash of train+target>.
    # Rebuilt automatically when a source, the tokenizer/template or an option below changes.
    cache_dir: str = ""
    # Qwen3 `enable_thinking` passed to the chat template (the DFlash recipe trains without).
    enable_thinking: bool = False
    # A row that cannot be used: 'skip' (counted by reason in the manifest) or 'error' (stop).
    on_bad_sample: str = "skip"
    # Samples longer than seq_len: 'truncate' or 'drop' (both counted in the manifest).
    overlength: str = "truncate"
    # Processes that tokenize while building the cache; 0 = one per CPU core (fewer for small data).
    tokenize_processes: int = 0
    # Packed row length and rows per global batch (across all processes).
    seq_len: int = 3072
    global_batch_rows: int = 16
    # Seed of the per-epoch global permutation.
    seed: int = 0
    # Prompts held out of training to measure τ on (data/heldout.py: chosen by a hash of their
    # text; every conversation opening with one is left out); 0 = train on every conversation.
    heldout_rows: int = 0
    # Open rows the best-fit packer chooses among; more = fuller rows, still random composition.
    pack_window: int = 64
    # Most documents in one row; 0 = as many as fit. 1 = one conversation per row, padded, as
    # per-conversation trainers batch (fewer tokens per step; for comparisons).
    docs_per_row: int = 0
    # Grain read threads and batches prefetched per process (0 threads = load on the caller).
    read_threads: int = 1
    prefetch_batches: int = 2

    def problems(self) -> list[str]:
        """What is wrong with these settings, one message per field (empty when all is well)."""
        return one_of("data", self, format=FORMATS, on_bad_sample=ON_BAD_SAMPLE, overlength=OVERLENGTH) + at_least(
            "data",
            self,
            seq_len=2,
            global_batch_rows=1,
            pack_window=1,
            docs_per_row=0,
            tokenize_processes=0,
            seed=0,
            heldout_rows=0,
            read_threads=0,
            prefetch_batches=0,
        )
