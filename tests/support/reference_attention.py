"""Dense references for the training attentions (tests only: memory is quadratic in the number of
tokens or blocks)."""

from __future__ import annotations

import jax.numpy as jnp

from dflash_jax.models.attention import attend


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


def packed_causal_mask(segment_ids):
    """segment_ids [B, S] (0 = padding) -> [B, S, S] causal mask that never crosses documents."""
    s = segment_ids.shape[-1]
    causal = jnp.tril(jnp.ones((s, s), bool))
    same_doc = segment_ids[:, :, None] == segment_ids[:, None, :]
    return causal[None] & same_doc & (segment_ids[:, :, None] != 0)
