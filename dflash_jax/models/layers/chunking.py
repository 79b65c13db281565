"""Mapping a function over chunks of blocks, one chunk at a time.

DFlash training runs hundreds of blocks per row. Attention over all of them at once would hold an
[N·L, S] score tensor, and the LM head an [N·L, vocab] logits tensor; both are instead computed
a chunk of blocks at a time (`lax.map`), so memory grows with the chunk size, not with the
number of blocks. Attention chunks are recomputed in the backward pass (`jax.checkpoint`); the
LM head needs no recomputation, its chunks return their own gradient (`objective.py`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

# Blocks of a row the drafter's attention takes at a time, unless told (train.attention_chunk_blocks).
BLOCKS_PER_CHUNK = 32


def map_block_chunks(fn: Callable, xs: tuple[jax.Array, ...], blocks_per_chunk: int, *, remat: bool = True):
    """fn(*chunks) applied to `blocks_per_chunk` blocks at a time; results concatenated. With
    `remat`, a chunk's intermediates are recomputed in the backward pass instead of stored.

    Every array of `xs` has the blocks on axis 1 ([B, N, ...]); `fn` maps arrays of shape
    [B, c, ...] to an array (or tuple of arrays) of shape [B, c, ...]. The last chunk is padded
    with zeros and the padding dropped from the result, so `fn` must keep blocks independent.
    """
    split, merge = _chunking(xs, blocks_per_chunk)
    body = lambda args: fn(*args)  # noqa: E731
    out = jax.lax.map(jax.checkpoint(body) if remat else body, jax.tree.map(split, xs))
    return jax.tree.map(merge, out)


def scan_block_chunks(fn: Callable, carry, xs, blocks_per_chunk: int):
    """`fn(carry, chunk) -> (carry, outputs)` over chunks of `blocks_per_chunk` blocks of the
    pytree `xs` ([B, N, ...] leaves), one chunk at a time; returns (final carry, outputs
    concatenated [B, N, ...]). The last chunk is padded with zeros, as in `map_block_chunks`:
    `fn` must add nothing to the carry for an all-zero block."""
    split, merge = _chunking(jax.tree.leaves(xs), blocks_per_chunk)
    carry, out = jax.lax.scan(fn, carry, jax.tree.map(split, xs))
    return carry, jax.tree.map(merge, out)


def _chunking(xs, blocks_per_chunk: int):
    """(split [B, N, ...] -> [N/c, B, c, ...] zero-padded, merge back) for arrays shaped like xs."""
    b, n = xs[0].shape[:2]
    c = min(blocks_per_chunk, n)
    pad = (-n) % c

    def split(x):
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape(b, (n + pad) // c, c, *x.shape[2:]), 1, 0)

    def merge(y):
        return jnp.moveaxis(y, 0, 1).reshape(b, n + pad, *y.shape[3:])[:, :n]

    return split, merge
