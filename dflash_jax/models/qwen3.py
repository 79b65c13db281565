"""The frozen target LM: a dense Qwen3 / Llama-3 decoder in Flax NNX.

Two entry points:
  * `__call__` runs packed rows (tokens, segment_ids, positions) with causal attention that
    never crosses documents, returns the requested layers' hidden states and can stop after the
    last of them (DFlash training only needs the context features, not the logits).
  * `decode` appends tokens to a `KVCache` (prefill and multi-token verification alike); the
    caller rolls back rejected tokens by lowering `cache.lengths`.
Module names mirror the Hugging Face checkpoint names, so `hf.py` maps them mechanically.
"""

from __future__ import annotations

from typing import Callable, Sequence

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from dflash_jax.models import attention
from dflash_jax.models.config import DrafterConfig, TransformerConfig
from dflash_jax.models.layers import AttentionProjections, RMSNorm, SwiGLU

AttendFn = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


class DecoderLayer(nnx.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)). The attention pattern is given."""

    def __init__(
        self, *, hidden_size, intermediate_size, num_heads, num_kv_heads, head_dim, rope, qk_norm,
        eps, param_dtype, compute_dtype, rngs, init_std=None,
    ):
        norm_kw = dict(eps=eps, param_dtype=param_dtype, compute_dtype=compute_dtype)
        self.input_layernorm = RMSNorm(hidden_size, **norm_kw)
        self.self_attn = AttentionProjections(
            hidden_size=hidden_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
            head_dim=head_dim, rope=rope, qk_norm=qk_norm, eps=eps, param_dtype=param_dtype,
            compute_dtype=compute_dtype, rngs=rngs, init_std=init_std,
        )
        self.post_attention_layernorm = RMSNorm(hidden_size, **norm_kw)
        self.mlp = SwiGLU(
            hidden_size, intermediate_size, param_dtype=param_dtype, compute_dtype=compute_dtype,
            rngs=rngs, init_std=init_std,
        )

    def __call__(self, x: jax.Array, positions: jax.Array, attend_fn: AttendFn) -> jax.Array:
        h = self.input_layernorm(x)
        q = self.self_attn.queries(h, positions)
        k, v = self.self_attn.keys_values(h, positions)
        x = x + self.self_attn.output(attend_fn(q, k, v))
        return x + self.mlp(self.post_attention_layernorm(x))


@flax.struct.dataclass
class KVCache:
    """Per-layer keys/values [L, B, max_len, kv_heads, d]; `lengths` [B] counts valid slots."""

    k: jax.Array
    v: jax.Array
    lengths: jax.Array

    @classmethod
    def create(cls, cfg: TransformerConfig | DrafterConfig, batch: int, max_len: int, dtype) -> "KVCache":
        shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch,), jnp.int32))


def write_at(buffer: jax.Array, new: jax.Array, start: jax.Array, *, layer: int | None = None) -> jax.Array:
    """buffer [B, M, ...] (or [L, B, M, ...] with `layer`) gets new [B, T, ...] at offsets start [B].

    One scatter into the whole buffer, so a donated cache is updated in place (slicing out a
    layer and stacking the layers back would copy the entire cache every step). Slots past the
    end are dropped.
    """
    rows = jnp.arange(new.shape[0])[:, None]
    slots = start[:, None] + jnp.arange(new.shape[1])[None, :]
    index = (rows, slots) if layer is None else (layer, rows, slots)
    return buffer.at[index].set(new.astype(buffer.dtype), mode="drop")


class Transformer(nnx.Module):
    def __init__(self, cfg: TransformerConfig, *, param_dtype=jnp.float32,
                 compute_dtype=jnp.float32, rngs: nnx.Rngs):
        self.cfg = cfg
        self.compute_dtype = compute_dtype
        self.embed_tokens = nnx.Embed(
            cfg.vocab_size, cfg.hidden_size, dtype=compute_dtype, param_dtype=param_dtype, rngs=rngs
        )
        self.layers = nnx.List([
            DecoderLayer(
                hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                rope=cfg.rope, qk_norm=cfg.qk_norm, eps=cfg.rms_norm_eps,
                param_dtype=param_dtype, compute_dtype=compute_dtype, rngs=rngs,
            )
            for _ in range(cfg.num_layers)
        ])
        self.norm = RMSNorm(
            cfg.hidden_size, eps=cfg.rms_norm_eps, param_dtype=param_dtype, compute_dtype=compute_dtype
        )
        self.lm_head = None if cfg.tie_word_embeddings else nnx.Linear(
            cfg.hidden_size, cfg.vocab_size, use_bias=False, dtype=compute_dtype,
            param_dtype=param_dtype, rngs=rngs,
        )

    def embed(self, tokens: jax.Array) -> jax.Array:
        return self.embed_tokens(tokens).astype(self.compute_dtype)

    def unembed(self, h: jax.Array) -> jax.Array:
        """Normalized hidden states -> logits with the target's LM head (tied or not)."""
        if self.lm_head is None:
            return self.embed_tokens.attend(h.astype(self.compute_dtype))
        return self.lm_head(h)

    def __call__(
        self,
        tokens: jax.Array,
        segment_ids: jax.Array,
        positions: jax.Array,
        *,
        hidden_layers: Sequence[int] = (),
        return_logits: bool = True,
    ) -> tuple[jax.Array | None, tuple[jax.Array, ...]]:
        """Packed forward. Returns (logits or None, outputs of `hidden_layers` in that order).

        With return_logits=False the forward stops after max(hidden_layers).
        """
        mask = attention.packed_causal_mask(segment_ids)
        last = self.cfg.num_layers - 1 if return_logits else max(hidden_layers)
        x = self.embed(tokens)
        outputs = {}
        for i in range(last + 1):
            x = self.layers[i](x, positions, lambda q, k, v: attention.attend(q, k, v, mask))
            outputs[i] = x
        logits = self.unembed(self.norm(x)) if return_logits else None
        return logits, tuple(outputs[i] for i in hidden_layers)

    def features(self, tokens, segment_ids, positions, layer_ids: Sequence[int]) -> jax.Array:
        """DFlash context features: concat of the chosen layers' outputs, [B, S, k·H]."""
        _, hidden = self(tokens, segment_ids, positions, hidden_layers=layer_ids, return_logits=False)
        return jnp.concatenate(hidden, axis=-1)

    def decode(
        self, tokens: jax.Array, cache: KVCache, *, feature_layers: Sequence[int] = ()
    ) -> tuple[jax.Array, jax.Array | None, KVCache]:
        """Append tokens [B, T] after `cache.lengths`; returns (logits, features, new cache).

        Positions continue from each row's cache length. Features (concat of `feature_layers`
        outputs, [B, T, k·H]) are what the drafter's context cache needs for these tokens.
        """
        num_new = tokens.shape[1]
        positions = cache.lengths[:, None] + jnp.arange(num_new)[None, :]
        mask = attention.cached_causal_mask(cache.lengths, num_new, cache.k.shape[2])
        x = self.embed(tokens)
        k_cache, v_cache, outputs = cache.k, cache.v, {}
        for i, layer in enumerate(self.layers):
            def attend_cached(q, k, v, i=i):
                nonlocal k_cache, v_cache
                k_cache = write_at(k_cache, k, cache.lengths, layer=i)
                v_cache = write_at(v_cache, v, cache.lengths, layer=i)
                return attention.attend(q, k_cache[i].astype(q.dtype), v_cache[i].astype(q.dtype), mask)
            x = layer(x, positions, attend_cached)
            outputs[i] = x
        logits = self.unembed(self.norm(x))
        features = (
            jnp.concatenate([outputs[i] for i in feature_layers], axis=-1) if feature_layers else None
        )
        new_cache = KVCache(k_cache, v_cache, cache.lengths + num_new)
        return logits, features, new_cache
