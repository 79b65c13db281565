"""SpecForge's DFlash training mask (specforge/modeling/draft/dflash_mask.py), written out query by
query for packed rows, and dense attention under it (tests only: memory is quadratic)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from dflash_jax.models.layers.attention import attend


def dflash_training_mask(segment_ids, anchors, block_len, *, window=0, causal=False) -> np.ndarray:
    """segment_ids [B, S] (0 = padding), anchors [B, N] (row index of each block's anchor) ->
    [B, N·L, S + N·L] over [context ‖ every block's keys].

    The query at offset o of the block anchored at a sees context key k iff k < a in a's
    document and, under a window W, k >= a + o - (W - 1); it sees key offset p of its own block
    iff (causal) p <= o and (window) p >= o - (W - 1); it sees no other block.
    """
    segment_ids, anchors = np.asarray(segment_ids), np.asarray(anchors)
    b, s = segment_ids.shape
    n = anchors.shape[1]
    mask = np.zeros((b, n * block_len, s + n * block_len), bool)
    for row in range(b):
        for block, a in enumerate(anchors[row]):
            document = segment_ids[row, a]
            for o in range(block_len):
                query = block * block_len + o
                for k in range(s):
                    in_window = not window or k >= a + o - (window - 1)
                    mask[row, query, k] = document != 0 and segment_ids[row, k] == document and k < a and in_window
                for p in range(block_len):
                    in_window = not window or p >= o - (window - 1)
                    mask[row, query, s + block * block_len + p] = (not causal or p <= o) and in_window
    return mask


def block_attention_under(q, k_ctx, v_ctx, k_blk, v_blk, mask):
    """Dense attention of every block's queries over [context ‖ every block's keys] under `mask`
    [B, N·L, S + N·L]; shapes as `block_attention.block_attention`."""
    b, n, block_len, heads, h = q.shape
    kv = k_ctx.shape[-2]
    keys = jnp.concatenate([k_ctx, k_blk.reshape(b, n * block_len, kv, h)], axis=1)
    values = jnp.concatenate([v_ctx, v_blk.reshape(b, n * block_len, kv, h)], axis=1)
    return attend(q.reshape(b, n * block_len, heads, h), keys, values, jnp.asarray(mask)).reshape(q.shape)
