"""The DFlash drafter (DESIGN §2), in Flax NNX.

The drafter owns `fc`, `hidden_norm`, its decoder layers and the final `norm`; it has no
embedding and no LM head: callers embed block tokens and unembed its output with the frozen
target (`Transformer.embed` / `Transformer.unembed`).

Every layer attends from the block's tokens to [context keys ‖ own block keys], where context
keys/values are the layer's own k/v projections of `ctx = hidden_norm(fc(target features))`.
Training runs many blocks per packed row (`__call__`); decoding runs one block against a
cache of context keys/values (`extend_context` + `decode`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dflash_jax.models import attention
from dflash_jax.models.config import DrafterConfig
from dflash_jax.models.layers import RMSNorm, linear
from dflash_jax.models.qwen3 import DecoderLayer, KVCache, write_at

INIT_STD = 0.02  # DESIGN §2 recipe: drafter init normal(0.02)


# The drafter caches the k/v projections of the context: same layout as the target's KV cache.
ContextCache = KVCache


class DFlashDrafter(nnx.Module):
    def __init__(self, cfg: DrafterConfig, *, param_dtype=jnp.float32,
                 compute_dtype=jnp.float32, rngs: nnx.Rngs):
        self.cfg = cfg
        self.compute_dtype = compute_dtype
        kw = dict(param_dtype=param_dtype, compute_dtype=compute_dtype)
        self.fc = linear(
            cfg.num_context_features * cfg.hidden_size, cfg.hidden_size, rngs=rngs,
            init_std=INIT_STD, **kw,
        )
        self.hidden_norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, **kw)
        self.layers = nnx.List([
            DecoderLayer(
                hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                rope=cfg.rope, qk_norm=True, eps=cfg.rms_norm_eps, rngs=rngs,
                init_std=INIT_STD, **kw,
            )
            for _ in range(cfg.num_layers)
        ])
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, **kw)

    def context(self, features: jax.Array) -> jax.Array:
        """Target features [..., k·H] -> ctx [..., H], computed once and shared by all layers."""
        return self.hidden_norm(self.fc(features.astype(self.compute_dtype)))

    def __call__(
        self,
        block_embeds: jax.Array,
        block_positions: jax.Array,
        ctx: jax.Array,
        ctx_positions: jax.Array,
        ctx_mask: jax.Array,
        *,
        blocks_per_chunk: int | None = 32,
        remat: bool = False,
    ) -> jax.Array:
        """Training forward over many blocks of one packed row batch.

        block_embeds [B, N, Bk, H], block_positions [B, N, Bk], ctx [B, S, H],
        ctx_positions [B, S], ctx_mask [B, N, S] (see `attention.block_context_mask`).
        Returns the final-normed hidden states [B, N, Bk, H]. blocks_per_chunk=None uses the
        dense reference attention (tests only: memory quadratic in blocks). remat=True
        recomputes each layer in the backward pass, so only one layer's activations are stored.
        """

        def run_layer(layer, x):
            k_ctx, v_ctx = layer.self_attn.keys_values(ctx, ctx_positions)

            def attend_blocks(q, k, v):
                if blocks_per_chunk is None:
                    return attention.block_attention_dense(q, k_ctx, v_ctx, k, v, ctx_mask)
                return attention.block_attention(
                    q, k_ctx, v_ctx, k, v, ctx_mask, blocks_per_chunk=blocks_per_chunk
                )

            return layer(x, block_positions, attend_blocks)

        if remat:
            run_layer = nnx.remat(run_layer)
        x = block_embeds.astype(self.compute_dtype)
        for layer in self.layers:
            x = run_layer(layer, x)
        return self.norm(x)

    def extend_context(
        self, cache: ContextCache, features: jax.Array, positions: jax.Array, num_valid: jax.Array
    ) -> ContextCache:
        """Write the context k/v of features [B, T, k·H] at `cache.lengths`; keep `num_valid` [B].

        All T slots are written (static shapes); only the first num_valid count as context, the
        rest are overwritten later and never visible.
        """
        ctx = self.context(features)
        k_cache, v_cache = cache.k, cache.v
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.keys_values(ctx, positions)
            k_cache = write_at(k_cache, k, cache.lengths, layer=i)
            v_cache = write_at(v_cache, v, cache.lengths, layer=i)
        return ContextCache(k_cache, v_cache, cache.lengths + num_valid)

    def decode(self, block_embeds: jax.Array, block_positions: jax.Array, cache: ContextCache) -> jax.Array:
        """One block [B, Bk, H] against the cached context -> final-normed hidden [B, Bk, H]."""
        b, bk = block_embeds.shape[:2]
        ctx_visible = jnp.arange(cache.k.shape[2])[None, :] < cache.lengths[:, None]  # [B, C]
        mask = jnp.concatenate(
            [jnp.broadcast_to(ctx_visible[:, None, :], (b, bk, cache.k.shape[2])),
             jnp.ones((b, bk, bk), bool)],
            axis=-1,
        )
        x = block_embeds.astype(self.compute_dtype)
        for i, layer in enumerate(self.layers):
            def attend_cached(q, k, v, i=i):
                keys = jnp.concatenate([cache.k[i].astype(k.dtype), k], axis=1)
                values = jnp.concatenate([cache.v[i].astype(v.dtype), v], axis=1)
                return attention.attend(q, keys, values, mask)
            x = layer(x, block_positions, attend_cached)
        return self.norm(x)
