"""The target's packed causal attention as a Pallas (Triton) kernel, forward only.

One program per (query tile, row, query head). Its key/value head is `head // G` (grouped-query
attention read in place, never repeated). It walks the key tiles from the tile holding the
document start of its first query up to the diagonal, with an online softmax in base 2 (the
FlashAttention-2 forward); a query sees the keys of its own document up to itself. Rows of
several documents therefore cost about the sum of their documents' squares, not the row's.
With a sliding window W the walk starts at the tile holding the window start of the first query
(never earlier than its document start): a query tile visits about (block_q + W) / block_k key
tiles, however long the row. Attention sinks start the online softmax: the running max at the
sink's logit and the running denominator at exp(0) = 1, as if one key of value zero came first.
The tiles are 64 x 64, smaller where a program's would not fit the GPU's shared memory (Gemma 4's
heads of 512: `tiles_for`). The target is frozen, so no backward pass is defined.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from dflash_jax.models import kernels
from dflash_jax.models.kernels import LOG2_E, MASKED, Tiles, cost, interpret_mode

BLOCK_Q = 64  # queries a program at most
BLOCK_K = 64  # keys a step at most


def document_starts(segment_ids: jax.Array) -> jax.Array:
    """[B, S] -> [B, S] int32: the index where each token's run of equal segment ids begins."""
    s = segment_ids.shape[1]
    index = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), segment_ids.shape)
    new_run = jnp.concatenate(
        [jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1
    )
    return jax.lax.cummax(jnp.where(new_run, index, 0), axis=1)


def tiles_for(head_dim: int, itemsize: int) -> Tiles | None:
    """The first of `kernels.candidates` whose walk (segment ids read with the keys) fits the GPU's
    shared memory; None if none does."""
    walk = functools.partial(kernels.walk_shared_memory, head_dim=head_dim, itemsize=itemsize, key_bytes=4)
    return kernels.first_fitting(kernels.candidates(BLOCK_Q, BLOCK_K), walk)


def _kernel(
    q_ref, k_ref, v_ref, seg_q_ref, seg_k_ref, start_ref, *refs, scale, block_q, block_k, sliding_window, has_sinks
):
    sink_ref, o_ref = refs if has_sinks else (None, *refs)
    tile = pl.program_id(0)
    q = q_ref[...]  # [block_q, H]
    seg_q = seg_q_ref[...]
    q_pos = tile * block_q + jnp.arange(block_q)
    first_key = jnp.min(start_ref[...])  # document start of the tile's first query
    if sliding_window:
        first_key = jnp.maximum(first_key, tile * block_q - sliding_window + 1)

    def body(j, carry):
        acc, m, total = carry
        keys = pl.ds(j * block_k, block_k)
        k = k_ref[keys, :]
        s = plgpu.dot(q, k.T) * (scale * LOG2_E)  # fp32 [block_q, block_k]
        k_pos = j * block_k + jnp.arange(block_k)
        visible = (seg_q[:, None] == seg_k_ref[keys][None, :]) & (q_pos[:, None] >= k_pos[None, :])
        if sliding_window:
            visible &= q_pos[:, None] - k_pos[None, :] < sliding_window
        s = jnp.where(visible, s, MASKED)
        m_new = jnp.maximum(m, s.max(axis=-1))
        correction = jnp.exp2(m - m_new)
        p = jnp.exp2(s - m_new[:, None])
        v = v_ref[keys, :]
        acc = acc * correction[:, None] + plgpu.dot(p.astype(v.dtype), v)
        return acc, m_new, total * correction + p.sum(axis=-1)

    head_dim = q.shape[-1]
    init = (
        jnp.zeros((block_q, head_dim), jnp.float32),
        sink_ref[...] * LOG2_E if has_sinks else jnp.full((block_q,), -jnp.inf, jnp.float32),
        jnp.ones((block_q,), jnp.float32) if has_sinks else jnp.zeros((block_q,), jnp.float32),
    )
    last = lax.div((tile + 1) * block_q + block_k - 1, block_k)
    acc, _, total = lax.fori_loop(lax.div(first_key, block_k), last, body, init)
    o_ref[...] = (acc / total[:, None]).astype(o_ref.dtype)


def packed_causal_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array,
    *,
    sliding_window: int = 0,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """q [B, S, K*G, H], k/v [B, S, K, H], segment_ids [B, S] -> [B, S, K*G, H].

    Same result as `attention.attend` under the causal same-document mask (and the sliding
    window, with the sinks [K*G], where given) at every non-padding position. S is padded to a
    multiple of the tile sizes inside. The tiles must fit the GPU (`tiles_for` is not None: the
    caller checks).
    """
    b, s, heads, head_dim = q.shape
    group = heads // k.shape[2]
    tiles = tiles_for(head_dim, q.dtype.itemsize)
    block_q, block_k = tiles.rows, tiles.keys
    pad = (-s) % max(block_q, block_k)
    if pad:
        q, k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q, k, v))
        segment_ids = jnp.pad(segment_ids, ((0, 0), (0, pad)))
    padded = s + pad
    starts = document_starts(segment_ids)
    kernel = functools.partial(
        _kernel,
        scale=head_dim**-0.5,
        block_q=block_q,
        block_k=block_k,
        sliding_window=sliding_window,
        has_sinks=sinks is not None,
    )
    in_specs = [
        pl.BlockSpec((None, block_q, None, head_dim), lambda i, r, h: (r, i, h, 0)),
        pl.BlockSpec((None, padded, None, head_dim), lambda i, r, h: (r, 0, h // group, 0)),
        pl.BlockSpec((None, padded, None, head_dim), lambda i, r, h: (r, 0, h // group, 0)),
        pl.BlockSpec((None, block_q), lambda i, r, h: (r, i)),
        pl.BlockSpec((None, padded), lambda i, r, h: (r, 0)),
        pl.BlockSpec((None, block_q), lambda i, r, h: (r, i)),
    ]
    inputs = [q, k, v, segment_ids, segment_ids, starts]
    if sinks is not None:
        # One row of block_q copies per head: Triton loads power-of-two blocks, not scalars.
        inputs.append(jnp.broadcast_to(sinks.astype(jnp.float32)[:, None], (heads, block_q)))
        in_specs.append(pl.BlockSpec((None, block_q), lambda i, r, h: (h, 0)))
    call = pl.pallas_call(
        kernel,
        grid=(padded // block_q, b, heads),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, block_q, None, head_dim), lambda i, r, h: (r, i, h, 0)),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=tiles.stages),
        interpret=interpret_mode(),
        name="packed_causal_attention",
    )
    walk = cost.causal_walk_flops(padded // block_q, block_q, block_k, head_dim, sliding_window)
    with cost.stating_flops(b * heads * walk):
        out = call(*inputs)
    return out[:, :s]
