"""Packing benchmark: the origin article's padded batches vs this pipeline's packed rows.

    python bench/packing.py                  # 100K samples, seq_len 3072, 16 rows per batch

On chat-like lengths (lognormal, median ~600 tokens, clipped to seq_len) it prints, per
approach, the fill (real tokens / token slots paid for) and the batches of a few epochs, then
the cost of planning an epoch and the loader's throughput on one core (read_threads=0).

(a) origin: every epoch a global shuffle, then greedy batches under a token budget
    (batch size x longest sample <= budget) and a maximum batch size, padded to the longest.
(b) dflash_jax: every epoch a global shuffle, then best-fit packing into rows of seq_len.
Both spend the same token budget per batch: rows x seq_len.
"""

from __future__ import annotations

# First, so that the package's start-up (dflash_jax/startup.py) runs before jax loads.
import dflash_jax  # noqa: F401

# isort: split
import argparse
import itertools
import tempfile
import time

import numpy as np

from dflash_jax.data.cache import CacheWriter, TokenizedCache
from dflash_jax.data.packing import plan_epoch
from dflash_jax.data.pipeline import DataPipeline
from dflash_jax.data.settings import DataConfig


def chat_lengths(n: int, seq_len: int, seed: int = 0) -> np.ndarray:
    lengths = np.random.default_rng(seed).lognormal(np.log(600), 0.9, n).round()
    return np.clip(lengths, 8, seq_len).astype(np.int64)


def origin_batches(lengths: np.ndarray, token_budget: int, max_batch_size: int, seed: int, epoch: int) -> list[int]:
    """Padded cost (batch size x longest) of each batch of the origin article's fixed builder."""
    costs, size, longest = [], 0, 0
    for n in lengths[np.random.default_rng([seed, epoch]).permutation(len(lengths))].tolist():
        grown = max(longest, n)
        if size and ((size + 1) * grown > token_budget or size == max_batch_size):
            costs.append(size * longest)
            size, grown = 0, n
        size, longest = size + 1, grown
    costs.append(size * longest)
    return costs


def synthetic_cache(directory: str, lengths: np.ndarray) -> TokenizedCache:
    rng = np.random.default_rng(0)
    writer = CacheWriter(directory)
    for chunk in np.array_split(lengths, max(1, len(lengths) // 10_000)):
        total = int(chunk.sum())
        writer.add(rng.integers(0, 150_000, total), rng.integers(0, 2, total), chunk)
    writer.finish({"inputs": {}})
    return TokenizedCache(directory)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=100_000)
    parser.add_argument("--seq-len", type=int, default=3072)
    parser.add_argument("--rows", type=int, default=16, help="rows per global batch")
    parser.add_argument("--max-batch-size", type=int, default=64, help="origin builder's cap on samples per batch")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--window", type=int, default=64, help="open rows the best-fit packer considers")
    parser.add_argument("--loader-batches", type=int, default=300)
    args = parser.parse_args()

    lengths = chat_lengths(args.samples, args.seq_len)
    budget = args.rows * args.seq_len
    print(
        f"{args.samples} samples, lognormal lengths clipped to [8, {args.seq_len}]: mean {lengths.mean():.0f}, "
        f"median {np.median(lengths):.0f}, p99 {np.percentile(lengths, 99):.0f}; "
        f"token budget per batch {budget} ({args.rows} x {args.seq_len})"
    )

    origin = [origin_batches(lengths, budget, args.max_batch_size, 0, e) for e in range(args.epochs)]
    origin_fill = lengths.sum() / np.mean([sum(costs) for costs in origin])
    started = time.perf_counter()
    plans = [plan_epoch(lengths, args.seq_len, args.rows, 0, e, args.window) for e in range(args.epochs)]
    plan_seconds = (time.perf_counter() - started) / args.epochs
    packed_fill = lengths.sum() / np.mean([p.num_rows * args.seq_len for p in plans])

    print(f"{'':44} {'fill':>7}   batches per epoch")
    print(f"{'(a) origin: shuffle + padded token budget':44} {origin_fill:7.1%}   {[len(c) for c in origin]}")
    print(f"{'(b) dflash_jax: shuffle + best-fit packing':44} {packed_fill:7.1%}   {[p.num_batches for p in plans]}")
    print(f"planning one epoch: {plan_seconds:.2f} s")

    with tempfile.TemporaryDirectory() as directory:
        settings = DataConfig(seq_len=args.seq_len, global_batch_rows=args.rows, read_threads=0)
        data = DataPipeline(synthetic_cache(directory, lengths), settings)
        it = data.iterator(process_index=0, process_count=1)
        next(it)  # plan the epoch outside the timing
        started = time.perf_counter()
        real = sum(int((b["segment_ids"] > 0).sum()) for b in itertools.islice(it, args.loader_batches))
        seconds = time.perf_counter() - started
    print(
        f"loader, one core: {args.loader_batches / seconds:.0f} batches/s = {real / seconds / 1e6:.1f} M real tokens/s "
        f"({args.loader_batches * budget / seconds / 1e6:.1f} M token slots/s)"
    )


if __name__ == "__main__":
    main()
