"""The frozen target LM: a dense Qwen3 / Llama-3 decoder in Flax NNX.

Two entry points:
  * `__call__` runs packed rows (tokens, segment_ids, positions) with causal attention that
    never crosses documents, returns the requested layers' hidden states and can stop after the
    last of them (DFlash training only needs the context features, not the logits).
  * `decode` appends tokens to a `KVCache` (prefill and multi-token verification alike); the
    caller rolls back rejected tokens by lowering `cache.lengths`.
Module names mirror the Hugging Face checkpoint names, so `hf.py` maps them mechanically.
Shapes: B batch rows, S (or T new) tokens, D model dim, V vocab; see `attention.py` for heads.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from dflash_jax.models import attention
from dflash_jax.models.cache import KVCache, LayerCache
from dflash_jax.models.config import TransformerConfig
from dflash_jax.models.layers import AttentionProjections, RMSNorm, Rotary, SwiGLU, rotary


class TransformerBlock(nnx.Module):
    """The weights of a pre-norm decoder block: x + attn(norm(x)), then x + mlp(norm(x)).

    Subclasses decide which keys and values the block's queries attend to.
    """

    def __init__(
        self,
        *,
        hidden_size,
        intermediate_size,
        num_heads,
        num_kv_heads,
        head_dim,
        qk_norm,
        eps,
        param_dtype,
        compute_dtype,
        rngs,
        init_std=None,
    ):
        norm_kw = dict(eps=eps, param_dtype=param_dtype, compute_dtype=compute_dtype)
        self.input_layernorm = RMSNorm(hidden_size, **norm_kw)
        self.self_attn = AttentionProjections(
            hidden_size=hidden_size,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            qk_norm=qk_norm,
            eps=eps,
            param_dtype=param_dtype,
            compute_dtype=compute_dtype,
            rngs=rngs,
            init_std=init_std,
        )
        self.post_attention_layernorm = RMSNorm(hidden_size, **norm_kw)
        self.mlp = SwiGLU(
            hidden_size,
            intermediate_size,
            param_dtype=param_dtype,
            compute_dtype=compute_dtype,
            rngs=rngs,
            init_std=init_std,
        )

    def mlp_residual(self, x: jax.Array) -> jax.Array:
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderLayer(TransformerBlock):
    """A target layer: causal self-attention over packed rows, or over a KV cache."""

    def __call__(self, x: jax.Array, tables: Rotary, segment_ids: jax.Array) -> jax.Array:
        """x [B, S, D], tables of positions [B, S], segment_ids [B, S] -> [B, S, D]."""
        h = self.input_layernorm(x)
        q = self.self_attn.queries(h, tables)
        k, v = self.self_attn.keys_values(h, tables)
        x = x + self.self_attn.output(attention.packed_causal_attention(q, k, v, segment_ids))
        return self.mlp_residual(x)

    def decode(
        self, x: jax.Array, tables: Rotary, cache: LayerCache, start: jax.Array, mask: jax.Array
    ) -> tuple[jax.Array, LayerCache]:
        """x [B, T, D] appended at slots start [B]; mask [B, T, M] -> ([B, T, D], updated cache)."""
        h = self.input_layernorm(x)
        q = self.self_attn.queries(h, tables)
        k, v = self.self_attn.keys_values(h, tables)
        cache = cache.write(k, v, start)
        attn = attention.attend(q, cache.k.astype(q.dtype), cache.v.astype(q.dtype), mask)
        return self.mlp_residual(x + self.self_attn.output(attn)), cache


class Transformer(nnx.Module):
    def __init__(self, cfg: TransformerConfig, *, param_dtype=jnp.float32, compute_dtype=jnp.float32, rngs: nnx.Rngs):
        self.cfg = cfg
        self.compute_dtype = compute_dtype
        self.embed_tokens = nnx.Embed(
            cfg.vocab_size, cfg.hidden_size, dtype=compute_dtype, param_dtype=param_dtype, rngs=rngs
        )
        self.layers = nnx.List(
            [
                DecoderLayer(
                    hidden_size=cfg.hidden_size,
                    intermediate_size=cfg.intermediate_size,
                    num_heads=cfg.num_heads,
                    num_kv_heads=cfg.num_kv_heads,
                    head_dim=cfg.head_dim,
                    qk_norm=cfg.qk_norm,
                    eps=cfg.rms_norm_eps,
                    param_dtype=param_dtype,
                    compute_dtype=compute_dtype,
                    rngs=rngs,
                )
                for _ in range(cfg.num_layers)
            ]
        )
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, param_dtype=param_dtype, compute_dtype=compute_dtype)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else nnx.Linear(
                cfg.hidden_size,
                cfg.vocab_size,
                use_bias=False,
                dtype=compute_dtype,
                param_dtype=param_dtype,
                rngs=rngs,
            )
        )

    def embed(self, tokens: jax.Array) -> jax.Array:
        """tokens [...] -> [..., D]."""
        return self.embed_tokens(tokens).astype(self.compute_dtype)

    def unembed(self, h: jax.Array) -> jax.Array:
        """Normalized hidden states [..., D] -> logits [..., V] with the LM head (tied or not)."""
        if self.lm_head is None:
            return self.embed_tokens.attend(h.astype(self.compute_dtype))
        return self.lm_head(h)

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        cfg = self.cfg
        return KVCache.create(cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim, self.compute_dtype)

    def __call__(
        self,
        tokens: jax.Array,
        segment_ids: jax.Array,
        positions: jax.Array,
        *,
        hidden_layers: Sequence[int] = (),
        return_logits: bool = True,
    ) -> tuple[jax.Array | None, tuple[jax.Array, ...]]:
        """Packed forward of [B, S] rows -> (logits [B, S, V] or None, outputs [B, S, D] of
        `hidden_layers` in that order). With return_logits=False the forward stops after
        max(hidden_layers). Positions restart in every document, so all lie below S (a
        position at or past S yields NaN)."""
        with jax.named_scope("target"):  # names the collectives in `python -m dflash_jax.plan`
            last = self.cfg.num_layers - 1 if return_logits else max(hidden_layers)
            x = self.embed(tokens)
            tables = rotary(positions, self.cfg.rope, self.cfg.head_dim, num_positions=tokens.shape[-1])
            outputs = []
            for layer in self.layers[: last + 1]:
                x = layer(x, tables, segment_ids)
                outputs.append(x)
            logits = self.unembed(self.norm(x)) if return_logits else None
            return logits, tuple(outputs[i] for i in hidden_layers)

    def features(self, tokens, segment_ids, positions, layer_ids: Sequence[int]) -> jax.Array:
        """DFlash context features (docs/design.md §2): the chosen layers' outputs concatenated,
        [B, S, k·D]."""
        _, hidden = self(tokens, segment_ids, positions, hidden_layers=layer_ids, return_logits=False)
        return jnp.concatenate(hidden, axis=-1)

    def decode(
        self, tokens: jax.Array, cache: KVCache, *, feature_layers: Sequence[int] = ()
    ) -> tuple[jax.Array, jax.Array | None, KVCache]:
        """Append tokens [B, T] after `cache.lengths` -> (logits [B, T, V], features, new cache).

        Positions continue from each row's cache length. Features (concat of `feature_layers`
        outputs, [B, T, k·D]) are what the drafter's context cache needs for these tokens.
        """
        num_new = tokens.shape[1]
        positions = cache.lengths[:, None] + jnp.arange(num_new)[None, :]
        mask = attention.cached_causal_mask(cache.lengths, num_new, cache.max_len)
        x = self.embed(tokens)
        tables = rotary(positions, self.cfg.rope, self.cfg.head_dim)
        outputs, layer_caches = [], []
        for layer, layer_cache in zip(self.layers, cache.layers):
            x, layer_cache = layer.decode(x, tables, layer_cache, cache.lengths, mask)
            outputs.append(x)
            layer_caches.append(layer_cache)
        logits = self.unembed(self.norm(x))
        features = jnp.concatenate([outputs[i] for i in feature_layers], axis=-1) if feature_layers else None
        return logits, features, KVCache(tuple(layer_caches), cache.lengths + num_new)
