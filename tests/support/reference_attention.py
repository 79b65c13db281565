"""Dense references for the training attentions (tests only: memory is quadratic in the number of
tokens or blocks)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from dflash_jax.models.layers.attention import attend


def block_attention_dense(q, k_ctx, v_ctx, k_blk, v_blk, ctx_mask):
    """One dense mask over [context ‖ every block's keys]: a query sees its own block and the
    context its block's mask allows. Shapes as `block_attention.block_attention`."""
    b, n, bk, heads, d = q.shape
    kvh = k_ctx.shape[-2]
    own_block = jnp.repeat(jnp.repeat(jnp.eye(n, dtype=bool), bk, 0), bk, 1)  # [N·L, N·L]
    ctx = jnp.repeat(ctx_mask, bk, axis=1)  # [B, N·L, S]
    mask = jnp.concatenate([ctx, jnp.broadcast_to(own_block, (b, n * bk, n * bk))], axis=-1)
    keys = jnp.concatenate([k_ctx, k_blk.reshape(b, n * bk, kvh, d)], axis=1)
    values = jnp.concatenate([v_ctx, v_blk.reshape(b, n * bk, kvh, d)], axis=1)
    return attend(q.reshape(b, n * bk, heads, d), keys, values, mask).reshape(q.shape)


def packed_causal_mask(segment_ids, sliding_window=0):
    """segment_ids [B, S] (0 = padding) -> [B, S, S] causal mask that never crosses documents;
    with a sliding window W > 0 query i sees only keys j > i - W."""
    s = segment_ids.shape[-1]
    causal = jnp.tril(jnp.ones((s, s), bool))
    if sliding_window:
        causal &= ~jnp.tril(jnp.ones((s, s), bool), -sliding_window)
    same_doc = segment_ids[:, :, None] == segment_ids[:, None, :]
    return causal[None] & same_doc & (segment_ids[:, :, None] != 0)


def sink_attention(q, k, v, mask, sinks=None):
    """float64 numpy attention written from gpt-oss' definition: per query head, a softmax over
    [visible scores ‖ sink logit] whose sink column is dropped. q [B, T, K*G, H], k/v [B, S, K, H],
    mask [B, T, S], sinks [K*G] or None (plain softmax) -> [B, T, K*G, H]. Rows that see no key
    and have no sink come out NaN."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, t, heads, h = q.shape
    kv = k.shape[2]
    qg = q.reshape(b, t, kv, heads // kv, h)
    scores = np.einsum("BTKGH,BSKH->BKGTS", qg, k) / np.sqrt(h)
    scores = np.where(np.asarray(mask)[:, None, None], scores, -np.inf)
    if sinks is not None:
        sink = np.asarray(sinks, np.float64).reshape(kv, heads // kv)[None, :, :, None, None]
        scores = np.concatenate([scores, np.broadcast_to(sink, (*scores.shape[:-1], 1))], axis=-1)
    with np.errstate(invalid="ignore"):
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
    if sinks is not None:
        probs = probs[..., :-1]
    return np.einsum("BKGTS,BSKH->BTKGH", probs, v).reshape(q.shape)
