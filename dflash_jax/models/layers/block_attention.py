"""DFlash block attention (docs/design.md §2, §3.2): the drafter's queries come from a block of
L tokens and see their own block (non-causal) plus the context before the block's anchor.

Layers may narrow that (SpecForge's DFlash mask; z-lab's drafters decode alike): with a window W,
the query at block offset o sees only the context keys at anchor + o - (W - 1) and later (the
window ends at the anchor and moves with the draft position; the query's own slot counts), and
with `causal` only its own block's keys at offsets up to o (and, when W < L, from o - (W - 1)).

Training runs many blocks per packed row (`block_attention`: the XLA reference, a chunk of
blocks at a time, or the fused Pallas kernel, as `attention.py` describes); decoding runs one
block per row against a cache of context keys (`block_attention_cached`). Shape letters
(docs/design.md §9): B rows, N blocks per row, L block length, S context positions, M cache
slots, K kv heads, G query heads per kv head, H head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.models.kernels import MASKED, target_backend
from dflash_jax.models.layers import attention
from dflash_jax.models.layers.chunking import map_block_chunks


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


def context_spans(ctx_mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The fused kernels' form of the mask: [B, N, S] (one contiguous run per block, what
    `block_context_mask` gives for contiguous documents) ->
    (start, end) [B, N] int32; a block that sees no context gets (0, 0)."""
    count = ctx_mask.sum(-1, dtype=jnp.int32)
    start = jnp.where(count > 0, jnp.argmax(ctx_mask, axis=-1).astype(jnp.int32), 0)
    return start, start + count


def own_block_mask(block_len: int, window: int, causal: bool) -> np.ndarray | None:
    """[L, L] which keys of its own block (by offset, last axis) a query offset sees; None: all."""
    if not causal and not 0 < window < block_len:
        return None
    query, key = np.arange(block_len)[:, None], np.arange(block_len)[None, :]
    visible = key <= query if causal else np.ones((block_len, block_len), bool)
    return visible & (key > query - window) if window else visible


@jax.named_scope("attention")  # the plan's time per part of the step (training/planning/hlo.py `region`)
def block_attention(
    q: jax.Array,
    k_ctx: jax.Array,
    v_ctx: jax.Array,
    k_blk: jax.Array,
    v_blk: jax.Array,
    ctx_mask: jax.Array,
    *,
    blocks_per_chunk: int,
    implementation: str,
    window: int = 0,
    causal: bool = False,
    positions: jax.Array | None = None,
    ctx_positions: jax.Array | None = None,
) -> jax.Array:
    """DFlash training attention (docs/design.md §2): every query of block n sees its own block's
    L keys and the context keys `ctx_mask[:, n]` allows, narrowed by `window` and `causal` (the
    module docstring).

    q [B, N, L, K*G, H]; k_blk, v_blk [B, N, L, K, H]; k_ctx, v_ctx [B, S, K, H]; ctx_mask
    [B, N, S] -> [B, N, L, K*G, H]. A window W > 0 needs the in-document positions of the block
    tokens [B, N, L] and of the context [B, S]: a query sees a context key only if their positions
    differ by less than W (inside a document positions differ as row indices do, so this is
    key >= anchor + o - (W - 1)).
    The XLA path runs `blocks_per_chunk` blocks at a time, each chunk rematerialized in the
    backward pass, so no [N·L, S] score tensor for all blocks ever lives. `implementation`: 'xla'
    or 'fused' (resolved). The fused path reads each block's mask as one span [start, end) (what
    `block_context_mask` gives for contiguous documents) and visits only those keys; it has no
    window or causal pattern, so such layers run the XLA path, as do heads whose tiles fit no GPU
    kernel (each says why: `attention.kernel_runs`).
    """
    if implementation == "fused" and attention.kernel_runs("drafter", _why_no_block_kernel(q, k_ctx, window, causal)):
        from dflash_jax.models.kernels import block, tpu_block

        fused = tpu_block if target_backend() == "tpu" else block
        start, end = context_spans(ctx_mask)
        return attention.per_shard(
            fused.block_attention_in_spans,
            (q, k_ctx, v_ctx, k_blk, v_blk, start, end),
            (
                attention.HEADS_SPEC,
                attention.KV_SPEC,
                attention.KV_SPEC,
                attention.KV_SPEC,
                attention.KV_SPEC,
                attention.ROWS_SPEC,
                attention.ROWS_SPEC,
            ),
            attention.HEADS_SPEC,
        )
    if window and (positions is None or ctx_positions is None):
        raise ValueError("a sliding window needs the block and context positions")
    return _block_attention_xla(
        q, k_ctx, v_ctx, k_blk, v_blk, ctx_mask, blocks_per_chunk, window, causal, positions, ctx_positions
    )


def _why_no_block_kernel(q: jax.Array, k_ctx: jax.Array, window: int, causal: bool) -> str:
    """Why the block kernels cannot run these layers ('' when they can)."""
    from dflash_jax.models.kernels import block

    if window or causal:
        return "layers with a window or a causal block (the kernels have neither)"
    if attention.why_no_kernel(q):
        return attention.why_no_kernel(q)
    if target_backend() == "tpu" or block.tiles_for(q, k_ctx.shape[2]):
        return ""
    return attention.no_tile_fits(q.shape[-1])


def _block_attention_xla(
    q, k_ctx, v_ctx, k_blk, v_blk, ctx_mask, blocks_per_chunk, window, causal, positions, ctx_positions
):
    b, _, block_len, heads, h = q.shape
    kv = k_ctx.shape[2]
    g = heads // kv
    kc, vc = k_ctx.transpose(0, 2, 1, 3), v_ctx.transpose(0, 2, 1, 3)  # [B, K, S, H]
    own_mask = own_block_mask(block_len, window, causal)

    def chunk(qc, kb, vb, mc, *position_chunk):  # the same arrays, N cut to a chunk of c blocks
        c = qc.shape[1]
        qh = qc.reshape(b, c, block_len, kv, g, h).transpose(0, 3, 1, 4, 2, 5)  # [B, K, c, G, L, H]
        kbh, vbh = kb.transpose(0, 3, 1, 2, 4), vb.transpose(0, 3, 1, 2, 4)  # [B, K, c, L, H]
        s_ctx = attention.scaled_scores(qh.reshape(b, kv, c * g * block_len, h), kc, "BKMH,BKSH->BKMS")
        s_ctx = s_ctx.reshape(b, kv, c, g, block_len, -1)
        visible = mc[:, :, None, :]  # [B, c, 1, S], or per query [B, c, L, S] under a window
        if window:
            visible = visible & (position_chunk[0][..., None] - ctx_positions[:, None, None, :] < window)
        s_ctx = jnp.where(visible[:, None, :, None], s_ctx, MASKED).reshape(b, kv, c, g * block_len, -1)
        s_blk = attention.scaled_scores(
            qh.reshape(b, kv, c, g * block_len, h), kbh, "BKCQH,BKCPH->BKCQP"
        )  # P: own keys
        if own_mask is not None:  # rows are (G, L): the mask repeats for every head of the group
            s_blk = jnp.where(np.tile(own_mask, (g, 1)), s_blk, MASKED)
        (w_ctx, w_blk), denominator = attention.unnormalized_softmax(s_ctx, s_blk)
        out = attention.weighted_values(w_ctx.reshape(b, kv, c * g * block_len, -1), vc, "BKMS,BKSH->BKMH")
        out = out.reshape(b, kv, c, g * block_len, h) + attention.weighted_values(w_blk, vbh, "BKCQP,BKCPH->BKCQH")
        out = (out / denominator).astype(qc.dtype)
        return out.reshape(b, kv, c, g, block_len, h).transpose(0, 2, 4, 1, 3, 5).reshape(qc.shape)

    chunked = (q, k_blk, v_blk, ctx_mask) + ((positions,) if window else ())
    return map_block_chunks(chunk, chunked, blocks_per_chunk)


def block_attention_cached(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    cache_lengths: jax.Array,
    k_blk: jax.Array,
    v_blk: jax.Array,
    *,
    window: int = 0,
    causal: bool = False,
) -> jax.Array:
    """One block per row against its cached context, the cache attended in place.

    q [B, L, K*G, H]; k_blk, v_blk [B, L, K, H]; k_cache, v_cache [B, M, K, H] of which the
    first cache_lengths[b] slots are context -> [B, L, K*G, H]. Slot m holds position m and the
    anchor sits at position cache_lengths[b] (`decoding/speculative.py`), so under a window W the
    query at offset o sees the slots from cache_lengths + o - (W - 1) on; `window` and `causal`
    as in `block_attention`. Scores against the cache and against the block share one softmax;
    the cache is never concatenated with the block.
    """
    qg = attention.grouped(q, k_cache.shape[-2])
    block_len = q.shape[1]
    slots = jnp.arange(k_cache.shape[1])[None, None, :]
    visible = slots < cache_lengths[:, None, None]  # [B, 1, M], or per query [B, L, M] under a window
    if window:
        visible = visible & (slots > cache_lengths[:, None, None] + jnp.arange(block_len)[None, :, None] - window)
    s_ctx = jnp.where(visible[:, None, None], attention.scaled_scores(qg, k_cache, "BLKGH,BMKH->BKGLM"), MASKED)
    s_blk = attention.scaled_scores(qg, k_blk, "BLKGH,BPKH->BKGLP")
    own_mask = own_block_mask(block_len, window, causal)
    if own_mask is not None:
        s_blk = jnp.where(own_mask, s_blk, MASKED)
    (w_ctx, w_blk), denominator = attention.unnormalized_softmax(s_ctx, s_blk)  # [B, K, G, L, ·]
    out = attention.weighted_values(w_ctx, v_cache, "BKGLM,BMKH->BLKGH") + attention.weighted_values(
        w_blk, v_blk, "BKGLP,BPKH->BLKGH"
    )
    return (out / denominator.transpose(0, 3, 1, 2, 4)).astype(q.dtype).reshape(q.shape)
