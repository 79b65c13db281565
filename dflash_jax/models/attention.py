"""Attention patterns: packed causal (target), cached (decoding), DFlash block attention.

Shapes are named as in jax-ml/bonsai: B batch rows, T queries, S keys, N blocks per row,
L block length, K kv heads, G query heads per kv head (GQA), H head dim, M cache slots.
Queries arrive as [..., K*G, H] and are viewed as [..., K, G, H]. Scores and softmax run in
fp32; masked scores get a large finite negative value, so a fully masked row yields a finite
(uniform) average instead of NaN (docs/design.md §3.2).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dflash_jax.models.chunking import map_block_chunks

MASKED = -1e30


def _grouped(q: jax.Array, num_kv_heads: int) -> jax.Array:
    """[..., T, K*G, H] -> [..., T, K, G, H]."""
    *lead, t, heads, h = q.shape
    return q.reshape(*lead, t, num_kv_heads, heads // num_kv_heads, h)


def _scores(qg: jax.Array, k: jax.Array, spec: str) -> jax.Array:
    """fp32 scores scaled by head_dim**-0.5."""
    return jnp.einsum(spec, qg, k, preferred_element_type=jnp.float32) * (qg.shape[-1] ** -0.5)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """q [B, T, K*G, H], k/v [B, S, K, H], mask [B, T, S] (True = visible) -> [B, T, K*G, H]."""
    qg = _grouped(q, k.shape[-2])
    scores = jnp.where(mask[:, None, None], _scores(qg, k, "BTKGH,BSKH->BKGTS"), MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("BKGTS,BSKH->BTKGH", probs, v).reshape(q.shape)


def _joint_softmax(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """softmax over the concatenation of a [..., S] and b [..., L], returned as its two parts,
    without materializing the concatenation."""
    m = jnp.maximum(a.max(-1, keepdims=True), b.max(-1, keepdims=True))
    ea, eb = jnp.exp(a - m), jnp.exp(b - m)
    denominator = ea.sum(-1, keepdims=True) + eb.sum(-1, keepdims=True)
    return ea / denominator, eb / denominator


def packed_causal_mask(segment_ids: jax.Array) -> jax.Array:
    """segment_ids [B, S] (0 = padding) -> [B, S, S] causal mask that never crosses documents."""
    s = segment_ids.shape[-1]
    causal = jnp.tril(jnp.ones((s, s), bool))
    same_doc = segment_ids[:, :, None] == segment_ids[:, None, :]
    return causal[None] & same_doc & (segment_ids[:, :, None] != 0)


def cached_causal_mask(lengths: jax.Array, num_new: int, cache_size: int) -> jax.Array:
    """[B, T, M] mask for `num_new` tokens appended at `lengths` [B] to a cache of M slots.

    New token t sees every cached slot before it and the new tokens up to itself; slots past the
    current length hold stale entries from rolled-back drafts and are never visible.
    """
    query_slot = lengths[:, None] + jnp.arange(num_new)[None, :]
    return jnp.arange(cache_size)[None, None, :] <= query_slot[:, :, None]


def block_context_mask(
    segment_ids: jax.Array, anchor_index: jax.Array, anchor_valid: jax.Array | None = None
) -> jax.Array:
    """docs/design.md §3.2: block n sees the context strictly before its anchor, in its document.

    segment_ids [B, S], anchor_index [B, N] (row index of each anchor) -> [B, N, S].
    `<` and not `<=`: the anchor's own features would leak the token the block must predict.
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
    """DFlash training attention (docs/design.md §2): every query of block n sees its own block's
    L keys and the context keys `ctx_mask[:, n]` allows.

    q [B, N, L, K*G, H]; k_blk, v_blk [B, N, L, K, H]; k_ctx, v_ctx [B, S, K, H]; ctx_mask
    [B, N, S] -> [B, N, L, K*G, H]. Runs `blocks_per_chunk` blocks at a time, each chunk
    rematerialized in the backward pass, so no [N·L, S] score tensor for all blocks ever lives.
    """

    def chunk(qc, kc, vc, mc):  # the same arrays, N cut to a chunk of blocks
        qg = _grouped(qc, k_ctx.shape[-2])
        s_ctx = _scores(qg, k_ctx, "BNLKGH,BSKH->BNKGLS")
        s_ctx = jnp.where(mc[:, :, None, None, None, :], s_ctx, MASKED)
        s_blk = _scores(qg, kc, "BNLKGH,BNPKH->BNKGLP")  # P: the block's own key slots
        probs = jax.nn.softmax(jnp.concatenate([s_ctx, s_blk], axis=-1), axis=-1).astype(v_ctx.dtype)
        p_ctx, p_blk = probs[..., : k_ctx.shape[1]], probs[..., k_ctx.shape[1] :]
        out = jnp.einsum("BNKGLS,BSKH->BNLKGH", p_ctx, v_ctx)
        out += jnp.einsum("BNKGLP,BNPKH->BNLKGH", p_blk, vc)
        return out.reshape(qc.shape)

    return map_block_chunks(chunk, (q, k_blk, v_blk, ctx_mask), blocks_per_chunk)


def block_attention_cached(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    cache_lengths: jax.Array,
    k_blk: jax.Array,
    v_blk: jax.Array,
) -> jax.Array:
    """One block per row against its cached context, the cache attended in place.

    q [B, L, K*G, H]; k_blk, v_blk [B, L, K, H]; k_cache, v_cache [B, M, K, H] of which the
    first cache_lengths[b] slots are context -> [B, L, K*G, H]. Scores against the cache and
    against the block share one softmax; the cache is never concatenated with the block.
    """
    qg = _grouped(q, k_cache.shape[-2])
    visible = jnp.arange(k_cache.shape[1])[None, :] < cache_lengths[:, None]  # [B, M]
    s_ctx = jnp.where(visible[:, None, None, None, :], _scores(qg, k_cache, "BLKGH,BMKH->BKGLM"), MASKED)
    s_blk = _scores(qg, k_blk, "BLKGH,BPKH->BKGLP")
    p_ctx, p_blk = _joint_softmax(s_ctx, s_blk)
    out = jnp.einsum("BKGLM,BMKH->BLKGH", p_ctx.astype(v_cache.dtype), v_cache)
    out += jnp.einsum("BKGLP,BPKH->BLKGH", p_blk.astype(v_blk.dtype), v_blk)
    return out.reshape(q.shape)
