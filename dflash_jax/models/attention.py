"""Attention patterns: packed causal (target), KV-cached (decoding), and DFlash block attention.

All functions take q [B, T, heads, d] and k/v [B, S, kv_heads, d] (GQA: heads is a multiple of
kv_heads). Scores and softmax run in fp32; masked scores get a large finite negative value so
that a fully masked row yields a finite (uniform) average instead of NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

MASKED = -1e30


def _grouped(q: jax.Array, num_kv_heads: int) -> jax.Array:
    """[..., T, heads, d] -> [..., T, kv_heads, groups, d]."""
    *lead, t, heads, d = q.shape
    return q.reshape(*lead, t, num_kv_heads, heads // num_kv_heads, d)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Masked softmax attention. mask [B, T, S] (True = visible) -> out [B, T, heads, d]."""
    qg = _grouped(q, k.shape[-2])
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32)
    scores = scores * (q.shape[-1] ** -0.5)
    scores = jnp.where(mask[:, None, None], scores, MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
    return out.reshape(q.shape)


def packed_causal_mask(segment_ids: jax.Array) -> jax.Array:
    """[B, S] segment ids (0 = padding) -> [B, S, S] causal mask that never crosses documents."""
    s = segment_ids.shape[-1]
    causal = jnp.tril(jnp.ones((s, s), bool))
    same_doc = segment_ids[:, :, None] == segment_ids[:, None, :]
    return causal[None] & same_doc & (segment_ids[:, :, None] != 0)


def cached_causal_mask(lengths: jax.Array, num_new: int, cache_size: int) -> jax.Array:
    """Mask for `num_new` tokens appended at `lengths` [B] to a cache of `cache_size` slots.

    New token t sees every cached slot before it and the new tokens up to itself; slots past the
    current length hold stale entries from rolled-back drafts and are never visible.
    """
    query_slot = lengths[:, None] + jnp.arange(num_new)[None, :]
    return jnp.arange(cache_size)[None, None, :] <= query_slot[:, :, None]


def block_context_mask(
    segment_ids: jax.Array, anchor_index: jax.Array, anchor_valid: jax.Array | None = None
) -> jax.Array:
    """DESIGN §2: block j sees context positions strictly before its anchor, in the anchor's doc.

    segment_ids [B, S], anchor_index [B, N] (row index of each anchor) -> [B, N, S].
    """
    s = segment_ids.shape[-1]
    anchor_segment = jnp.take_along_axis(segment_ids, anchor_index, axis=1)
    before = jnp.arange(s)[None, None, :] < anchor_index[:, :, None]
    same_doc = segment_ids[:, None, :] == anchor_segment[:, :, None]
    mask = before & same_doc & (anchor_segment[:, :, None] != 0)
    if anchor_valid is not None:
        mask = mask & anchor_valid[:, :, None]
    return mask


def block_attention(
    q: jax.Array,
    k_ctx: jax.Array,
    v_ctx: jax.Array,
    k_blk: jax.Array,
    v_blk: jax.Array,
    ctx_mask: jax.Array,
    *,
    blocks_per_chunk: int,
) -> jax.Array:
    """DFlash training attention, chunked over blocks so memory grows linearly with blocks.

    q, k_blk, v_blk: [B, N, Bk, heads|kv_heads, d] (each block's queries and own keys/values);
    k_ctx, v_ctx: [B, S, kv_heads, d]; ctx_mask [B, N, S]. Every query sees its whole own block
    plus the context keys its mask allows. Each chunk is rematerialized in the backward pass, so
    no [blocks·Bk × S] score tensor for all blocks ever lives in memory.
    """
    b, n, bk, heads, d = q.shape
    c = min(blocks_per_chunk, n)
    pad = (-n) % c

    def split(x):  # [B, N, ...] -> [chunks, B, c, ...]
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape(b, (n + pad) // c, c, *x.shape[2:]), 1, 0)

    @jax.checkpoint
    def chunk(args):
        qc, kc, vc, mc = args
        qg = _grouped(qc, k_ctx.shape[-2])  # [B, c, Bk, kvh, g, d]
        s_ctx = jnp.einsum("bcqkgd,bskd->bckgqs", qg, k_ctx, preferred_element_type=jnp.float32)
        s_blk = jnp.einsum("bcqkgd,bcpkd->bckgqp", qg, kc, preferred_element_type=jnp.float32)
        s_ctx = jnp.where(mc[:, :, None, None, None, :], s_ctx, MASKED)
        scores = jnp.concatenate([s_ctx, s_blk], axis=-1) * (d**-0.5)
        probs = jax.nn.softmax(scores, axis=-1).astype(v_ctx.dtype)
        p_ctx, p_blk = probs[..., : k_ctx.shape[1]], probs[..., k_ctx.shape[1]:]
        out = jnp.einsum("bckgqs,bskd->bcqkgd", p_ctx, v_ctx) + jnp.einsum(
            "bckgqp,bcpkd->bcqkgd", p_blk, vc
        )
        return out.reshape(qc.shape)

    out = jax.lax.map(chunk, (split(q), split(k_blk), split(v_blk), split(ctx_mask)))
    out = jnp.moveaxis(out, 0, 1).reshape(b, n + pad, bk, heads, d)
    return out[:, :n]


def block_attention_dense(q, k_ctx, v_ctx, k_blk, v_blk, ctx_mask):
    """Reference for `block_attention`: one dense mask over [context ‖ all blocks' keys]."""
    b, n, bk, heads, d = q.shape
    kvh = k_ctx.shape[-2]
    own_block = jnp.repeat(jnp.repeat(jnp.eye(n, dtype=bool), bk, 0), bk, 1)  # [N·Bk, N·Bk]
    ctx = jnp.repeat(ctx_mask, bk, axis=1)  # [B, N·Bk, S]
    mask = jnp.concatenate([ctx, jnp.broadcast_to(own_block, (b, n * bk, n * bk))], axis=-1)
    keys = jnp.concatenate([k_ctx, k_blk.reshape(b, n * bk, kvh, d)], axis=1)
    values = jnp.concatenate([v_ctx, v_blk.reshape(b, n * bk, kvh, d)], axis=1)
    out = attend(q.reshape(b, n * bk, heads, d), keys, values, mask)
    return out.reshape(q.shape)
