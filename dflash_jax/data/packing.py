"""The packing plan of an epoch: which documents go into which row of which batch.

A plan is a pure function of (sample lengths, seq_len, rows per batch, seed, epoch, window, and
the cap on documents per row):
all samples are permuted globally (no length sorting, so batch composition changes every epoch)
and placed in permutation order, each into the open row it fits best among a bounded window.
The window keeps rows filled to ≥98% on chat-like lengths while every row still holds documents
from a short stretch of the permutation. Every sample lands in exactly one row, and the number
of batches is known before the first one is loaded.
"""

from __future__ import annotations

import bisect
import dataclasses

import numpy as np

# The int32 [rows, seq_len] arrays of a packed batch (docs/design.md §6.5).
FIELDS = ("tokens", "segment_ids", "positions", "loss_mask")


@dataclasses.dataclass(frozen=True)
class EpochPlan:
    epoch: int
    rows_per_batch: int
    # Documents in row order; row r holds doc_ids[row_starts[r]:row_starts[r + 1]].
    doc_ids: np.ndarray
    row_starts: np.ndarray

    @property
    def num_rows(self) -> int:
        return len(self.row_starts) - 1

    @property
    def num_batches(self) -> int:
        return self.num_rows // self.rows_per_batch

    def row(self, r: int) -> np.ndarray:
        return self.doc_ids[self.row_starts[r] : self.row_starts[r + 1]]


def plan_epoch(
    lengths: np.ndarray,
    seq_len: int,
    rows_per_batch: int,
    seed: int,
    epoch: int,
    window: int = 64,
    docs_per_row: int = 0,
) -> EpochPlan:
    """Packs every sample once into rows of `seq_len`, grouped `rows_per_batch` to a batch; a row
    holds at most `docs_per_row` documents (0 = as many as fit)."""
    if len(lengths) and lengths.max() > seq_len:
        raise ValueError(
            f"a sample of {lengths.max()} tokens exceeds seq_len {seq_len}; rebuild the cache for this seq_len"
        )
    order = np.random.default_rng([seed, epoch]).permutation(len(lengths))
    rows = _best_fit(order, lengths, seq_len, window, docs_per_row or len(lengths))
    _split_to_full_batches(rows, rows_per_batch)
    row_starts = np.concatenate([[0], np.cumsum([len(r) for r in rows])]).astype(np.int64)
    doc_ids = np.fromiter((d for r in rows for d in r), np.int64, count=len(lengths))
    return EpochPlan(epoch, rows_per_batch, doc_ids, row_starts)


def _best_fit(order: np.ndarray, lengths: np.ndarray, seq_len: int, window: int, docs_per_row: int) -> list[list[int]]:
    smallest = int(lengths.min()) if len(lengths) else 1
    rows: list[list[int]] = []
    # Open rows sorted by free space (ascending), with their row numbers alongside.
    free: list[int] = []
    open_rows: list[int] = []
    for doc, n in zip(order.tolist(), lengths[order].tolist()):
        i = bisect.bisect_left(free, n)
        if i < len(free):
            space = free.pop(i) - n
            row = open_rows.pop(i)
            rows[row].append(doc)
        else:
            if len(free) == window:  # retire the fullest open row to make room
                del free[0], open_rows[0]
            row = len(rows)
            rows.append([doc])
            space = seq_len - n
        if space >= smallest and len(rows[row]) < docs_per_row:
            j = bisect.bisect_left(free, space)
            free.insert(j, space)
            open_rows.insert(j, row)
    return rows


def _split_to_full_batches(rows: list[list[int]], rows_per_batch: int) -> None:
    """Completes the last batch by moving one document each out of the rows holding the most,
    so no sample is dropped or repeated and rows stay non-empty while documents allow."""
    missing = -len(rows) % rows_per_batch
    donors = sorted(range(len(rows)), key=lambda r: -len(rows[r]))[:missing]
    moved = [[rows[r].pop()] for r in donors if len(rows[r]) > 1]
    rows.extend(moved + [[] for _ in range(missing - len(moved))])
