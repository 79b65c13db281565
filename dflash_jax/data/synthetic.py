"""Synthetic packed batches for benchmarks and tests (no tokenizer, no files).

Rows are filled with documents of random length; the first part of each document is the
"prompt" (loss_mask 0), the rest the "response" (loss_mask 1), and the tail of a row may be
padding. With `counting=True` every document counts upwards from a random start, a sequence a
drafter can learn in a few dozen steps.
"""

from __future__ import annotations

import numpy as np

from dflash_jax.data.packing import FIELDS


def packed_batch(
    rng: np.random.Generator,
    rows: int,
    seq_len: int,
    vocab_size: int,
    *,
    doc_len: tuple[int, int] = (8, 48),
    counting: bool = False,
) -> dict[str, np.ndarray]:
    batch = {k: np.zeros((rows, seq_len), np.int32) for k in FIELDS}
    for r in range(rows):
        start, segment = 0, 1
        while start < seq_len - doc_len[0]:
            n = min(int(rng.integers(*doc_len)), seq_len - start)
            doc = slice(start, start + n)
            if counting:
                batch["tokens"][r, doc] = (rng.integers(vocab_size) + np.arange(n)) % vocab_size
            else:
                batch["tokens"][r, doc] = rng.integers(0, vocab_size, n)
            batch["segment_ids"][r, doc] = segment
            batch["positions"][r, doc] = np.arange(n)
            batch["loss_mask"][r, start + n // 3 : start + n] = 1
            start, segment = start + n, segment + 1
    return batch
