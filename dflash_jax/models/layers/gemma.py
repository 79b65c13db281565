"""Gemma 4's decoder layer and attention (transformers' Gemma4TextDecoderLayer and
Gemma4TextAttention are the reference).

The layer normalizes around both halves ("sandwich" norms) and scales its output:

    h   = x + post_attention_layernorm(self_attn(input_layernorm(x)))
    f   = mlp(pre_feedforward_layernorm(h))                       GELU-tanh gated MLP
    MoE layers add experts beside the dense MLP:
    f   = post_feedforward_layernorm_1(f) + post_feedforward_layernorm_2(moe(rms(h)))
    out = (h + post_feedforward_layernorm(f)) · layer_scalar

where rms(h) is h divided by its root mean square, without scale: the router's input. Gemma's
router scales it by `router.scale` · D^-0.5 and its experts read it through
pre_feedforward_layernorm_2; both scales are folded into the router's and experts' input weights
at load (the family's weight map), and `router.per_expert_scale` into each expert's output weight,
so the experts are the shared `moe.MoE` (softmax, top-k, renormalized).

Attention: per-head q and k RMSNorms (scaled), values RMS-normalized without scale, scores not
scaled by H^-0.5; on the full layers of the large models, keys and values both come from k_proj
(`attention_k_eq_v`: no v_proj). Sliding and full layers have their own head size, kv heads and
RoPE (the model passes each layer its tables).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from dflash_jax.models.layers.basic import RMSNorm, Rotary, apply_rope, rms_normalized
from dflash_jax.models.layers.mixers import SelfAttention
from dflash_jax.models.sharding import BATCH, KV_HEADS, constrain


class Gemma4Attention(SelfAttention):
    """SelfAttention with Gemma 4's normalizations; `values_from_keys`: no v_proj, values are
    k_proj's output (normalized as values)."""

    def __init__(self, *, values_from_keys: bool = False, **attention):
        super().__init__(qk_norm=True, **attention)
        self.eps = attention["eps"]
        if values_from_keys:
            self.v_proj = None

    def queries(self, x: jax.Array, tables: Rotary) -> tuple[jax.Array, jax.Array | None]:
        q, gate = super().queries(x, tables)
        return q * jnp.asarray(math.sqrt(self.head_dim), q.dtype), gate  # scores unscaled: cancel H^-0.5

    def keys_values(self, x: jax.Array, tables: Rotary) -> tuple[jax.Array, jax.Array]:
        shape = (*x.shape[:-1], self.num_kv_heads, self.head_dim)
        k = self.k_proj(x).reshape(shape)
        v = k if self.v_proj is None else self.v_proj(x).reshape(shape)
        k = constrain(apply_rope(self.k_norm(k), tables), (BATCH, ..., KV_HEADS, None))
        v = constrain(rms_normalized(v, self.eps).astype(self.compute_dtype), (BATCH, ..., KV_HEADS, None))
        return k, v


class Gemma4Block(nnx.Module):
    """One Gemma 4 layer: the block interface of `layers.DecoderBlock` (`__call__`, `decode`,
    `mixer`) with Gemma's norms, optional experts and layer scalar."""

    mixer_name = "self_attn"

    def __init__(
        self,
        attention: Gemma4Attention,
        mlp: nnx.Module,
        moe: nnx.Module | None,
        *,
        hidden_size: int,
        eps: float,
        param_dtype,
        compute_dtype,
    ):
        norm_kw = dict(eps=eps, param_dtype=param_dtype, compute_dtype=compute_dtype)
        self.input_layernorm = RMSNorm(hidden_size, **norm_kw)
        self.self_attn = attention
        self.post_attention_layernorm = RMSNorm(hidden_size, **norm_kw)
        self.pre_feedforward_layernorm = RMSNorm(hidden_size, **norm_kw)
        self.mlp = mlp
        self.post_feedforward_layernorm = RMSNorm(hidden_size, **norm_kw)
        self.moe = moe
        if moe is not None:
            self.post_feedforward_layernorm_1 = RMSNorm(hidden_size, **norm_kw)
            self.post_feedforward_layernorm_2 = RMSNorm(hidden_size, **norm_kw)
        self.layer_scalar = nnx.Param(jnp.ones((1,), param_dtype))
        self.eps = eps
        self.compute_dtype = compute_dtype

    @property
    def mixer(self) -> nnx.Module:
        return self.self_attn

    def _feed_forward(self, h: jax.Array) -> jax.Array:
        out = self.mlp(self.pre_feedforward_layernorm(h))
        if self.moe is not None:
            experts = self.moe(rms_normalized(h, self.eps).astype(self.compute_dtype))
            out = self.post_feedforward_layernorm_1(out) + self.post_feedforward_layernorm_2(experts)
        return (h + self.post_feedforward_layernorm(out)) * self.layer_scalar[...].astype(self.compute_dtype)

    def __call__(self, x: jax.Array, inputs) -> jax.Array:
        """x [..., D] -> [..., D] (packed forward)."""
        return self._feed_forward(x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), inputs)))

    def decode(self, x: jax.Array, inputs, cache):
        """x [B, T, D] against the attention's cache slice -> ([B, T, D], updated slice)."""
        out, cache = self.self_attn.decode(self.input_layernorm(x), inputs, cache)
        return self._feed_forward(x + self.post_attention_layernorm(out)), cache
