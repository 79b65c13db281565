"""The `config.data` section: where the conversations are and how they become batches."""

from __future__ import annotations

import ml_collections


def default_data_config() -> ml_collections.ConfigDict:
    data = ml_collections.ConfigDict()
    # JSONL / Parquet file, directory (searched recursively) or glob; comma-separate several.
    data.train = ""
    # 'auto' picks per record by field: `messages` (OpenAI role/content), `conversations`
    # (ShareGPT from/value) or `text` (plain document, every token trained on).
    data.format = "auto"
    # Tokenized cache location; '' = ~/.cache/dflash_jax/tokenized/<target>-<hash of train+target>.
    # Rebuilt automatically when a source, the tokenizer/template or an option below changes.
    data.cache_dir = ""
    # Qwen3 `enable_thinking` passed to the chat template (the DFlash recipe trains without).
    data.enable_thinking = False
    # A row that cannot be used: 'skip' (counted by reason in the manifest) or 'error' (stop).
    data.on_bad_sample = "skip"
    # Samples longer than seq_len: 'truncate' or 'drop' (both counted in the manifest).
    data.overlength = "truncate"
    # Processes that tokenize while building the cache; 0 = one per CPU core (fewer for small data).
    data.tokenize_processes = 0
    # Packed row length and rows per global batch (across all processes).
    data.seq_len = 3072
    data.global_batch_rows = 16
    # Seed of the per-epoch global permutation.
    data.seed = 0
    # Open rows the best-fit packer chooses among; more = fuller rows, still random composition.
    data.pack_window = 64
    # Grain read threads and batches prefetched per process (0 threads = load on the caller).
    data.read_threads = 1
    data.prefetch_batches = 2
    return data
