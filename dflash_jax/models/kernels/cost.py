"""What an attention kernel's walk costs, stated for the plan's roofline (training/planning/hlo.py).

XLA cannot see inside a kernel, so each call states its work. Our walks depend on the data
(where documents and spans begin and end): they state the common case, rows of one document
each (rows packed with several documents visit fewer tiles). Splash's walk is fixed by its
static mask, so its figure is exact.

How it is stated depends on the call: our Pallas TPU calls carry a `pl.CostEstimate` in their
backend_config; a Triton call (XLA:GPU) keeps no cost, and splash takes none, so those run inside
`stating_flops(N)`, a `kernel_flops=N` named scope, which the compiled call keeps.
"""

from __future__ import annotations

import jax

KERNEL_FLOPS = "kernel_flops"  # the named scope's key (training/planning/hlo.py reads it)


def stating_flops(flops: int):
    """A named scope stating the FLOPs of the kernel called inside it."""
    return jax.named_scope(f"{KERNEL_FLOPS}={int(flops)}")


def expected_visits(chunks: int, tiles: int) -> int:
    """The (chunk of blocks, context tile) pairs a block-attention walk visits on a row that is
    one document with its anchors spread evenly: sorted chunk c reaches the first (c + 1)/C of it."""
    return sum(-(-(c + 1) * tiles // chunks) for c in range(chunks))


def block_walk_flops(q_shape: tuple, tile: int, tiles: int, own_keys: int, *, context_matmuls: int, own_matmuls: int):
    """Matmul FLOPs of a block-attention call on q [B, K, C, R, H] (C chunks of R query rows):
    `context_matmuls` [R, tile] x H products per visited (chunk, context tile) pair and
    `own_matmuls` [R, own_keys] x H products per chunk (its own blocks' keys)."""
    b, kv, chunks, rows, h = q_shape
    visits = b * kv * expected_visits(chunks, tiles)
    return 2 * rows * h * (visits * tile * context_matmuls + b * kv * chunks * own_keys * own_matmuls)


def causal_visits(tiles: int, block_q: int, block_k: int, sliding_window: int = 0) -> int:
    """The (query tile, key tile) pairs a causal walk over a one-document row of `tiles` query
    tiles visits: from the tile of its first query's window start (the row start without a
    window) up to the diagonal."""
    total = 0
    for i in range(tiles):
        first = max(0, i * block_q - sliding_window + 1) // block_k if sliding_window else 0
        total += -(-(i + 1) * block_q // block_k) - first
    return total


def causal_walk_flops(tiles: int, block_q: int, block_k: int, head_dim: int, sliding_window: int = 0) -> int:
    """Matmul FLOPs of one row and head of a causal walk (`causal_visits`): per visited tile pair,
    the scores and the values, each a [block_q, block_k] x head_dim product."""
    return causal_visits(tiles, block_q, block_k, sliding_window) * 2 * (2 * block_q * block_k * head_dim)
