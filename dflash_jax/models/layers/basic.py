"""Building blocks shared by the target LM and the drafter: RMSNorm, RoPE, projections, SwiGLU,
and the one decoder-block skeleton both are built of.

Numerics follow the Hugging Face Qwen3/Llama code so that parity holds in fp32: RMSNorm
normalizes in fp32 and multiplies the weight in the compute dtype, RoPE uses the rotate-half
layout, and q/k norms act per head before RoPE. Shape letters: docs/design.md §9.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dflash_jax.models.architecture import RopeConfig
from dflash_jax.models.sharding import BATCH, EMBED, MLP, NORM, PartitionRules, constrain

# SwiGLU's projections, and the scale of every RMSNorm (norm, hidden_norm, q_norm, *_layernorm).
PARTITION_RULES: PartitionRules = (
    (r"(gate|up)_proj\.kernel", (EMBED, MLP)),
    (r"down_proj\.kernel", (MLP, EMBED)),
    (r"\w*norm\.weight", (NORM,)),
)


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis. `zero_centered` (Qwen3.5 / Qwen3-Next) stores w and scales by
    1 + w, computed in fp32 as those models do."""

    def __init__(self, dim: int, *, eps: float, param_dtype, compute_dtype, zero_centered: bool = False):
        self.weight = nnx.Param(jnp.zeros((dim,), param_dtype) if zero_centered else jnp.ones((dim,), param_dtype))
        self.eps = eps
        self.compute_dtype = compute_dtype
        self.zero_centered = zero_centered

    def __call__(self, x: jax.Array) -> jax.Array:
        normed = rms_normalized(x, self.eps)
        if self.zero_centered:
            return (normed * (1.0 + self.weight[...].astype(jnp.float32))).astype(self.compute_dtype)
        return self.weight[...].astype(self.compute_dtype) * normed.astype(self.compute_dtype)


def top_k(logits: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """`lax.top_k` over the last axis of logits [..., V], taken over rows [-1, V]: XLA:CPU turns
    the top-k sort into its TopK kernel only for some shapes, and the training step's [R, N, Bk, V]
    became a full sort of every row (4.9 DFlash steps a step instead of 1.4)."""
    values, ids = jax.lax.top_k(logits.reshape(-1, logits.shape[-1]), k)
    return values.reshape(*logits.shape[:-1], k), ids.reshape(*logits.shape[:-1], k)


def soft_capped(logits: jax.Array, cap: float) -> jax.Array:
    """cap · tanh(logits / cap) (a target's or a drafter's logit soft cap); 0 = no cap."""
    return cap * jnp.tanh(logits / cap) if cap else logits


def rms_normalized(x: jax.Array, eps: float) -> jax.Array:
    """x [..., N] divided by its root mean square over the last axis, in fp32 (no scale)."""
    x32 = x.astype(jnp.float32)
    return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


class Linear(nnx.Linear):
    """nnx.Linear on [..., in] as one [tokens, in] x [in, out] matmul. With several leading axes
    XLA:CPU transposes the activations (slowly) for the weight gradient; flat, it needs none."""

    def __call__(self, x: jax.Array) -> jax.Array:
        return super().__call__(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1)


def linear(
    in_features: int, out_features: int, *, param_dtype, compute_dtype, rngs, init_std=None, use_bias: bool = False
):
    """A projection, bias-free unless asked; kernel stored [in, out] (torch stores the transpose)."""
    init = nnx.initializers.normal(init_std) if init_std is not None else nnx.initializers.lecun_normal()
    return Linear(
        in_features,
        out_features,
        use_bias=use_bias,
        dtype=compute_dtype,
        param_dtype=param_dtype,
        kernel_init=init,
        rngs=rngs,
    )


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """Inverse frequencies [R/2] of the R = head_dim·partial_factor rotating dimensions, with
    Llama-3's or YaRN's long-context rescaling; or (Gemma 4's 'proportional') [head_dim/2] whose
    first head_dim·partial_factor/2 frequencies are those of a head_dim-wide rotation and the rest 0:
    every pair (i, i + head_dim/2) rotates, the later ones by angle 0."""
    if rope.kind == "proportional":
        angles = int(rope.partial_factor * head_dim // 2)
        inv_freq = 1.0 / (rope.theta ** (np.arange(0, 2 * angles, 2, dtype=np.float32) / head_dim))
        return np.pad(inv_freq, (0, head_dim // 2 - angles)).astype(np.float32)
    dim = int(head_dim * rope.partial_factor)
    inv_freq = 1.0 / (rope.theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    if rope.kind == "default":
        return inv_freq.astype(np.float32)
    if rope.kind == "yarn":
        return _yarn_inv_freq(rope, inv_freq, dim)
    # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, the band between
    # interpolated smoothly.
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn_inv_freq(rope: RopeConfig, inv_freq: np.ndarray, dim: int) -> np.ndarray:
    """YaRN: dimensions that rotate fewer than `beta_slow` times over the original context are
    interpolated (divided by `factor`), those rotating more than `beta_fast` times kept, a linear
    ramp between."""

    def dimension_of(rotations):  # the dimension that rotates `rotations` times over the context
        context = rope.original_max_position_embeddings
        return dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = dimension_of(rope.beta_fast), dimension_of(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    kept = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate
    return (inv_freq / rope.factor * (1 - kept) + inv_freq * kept).astype(np.float32)


class Rotary(NamedTuple):
    """cos and sin of the RoPE angles, [..., T, 1, R] fp32 (broadcast over heads), R the rotating
    dimensions (the head dim unless partial rotary).

    Computed once per forward, for every layer and for queries and keys alike.
    """

    cos: jax.Array
    sin: jax.Array


def rotary(positions: jax.Array, rope: RopeConfig, head_dim: int, *, num_positions: int | None = None) -> Rotary:
    """positions [..., T] -> the RoPE tables of those positions (rotate-half layout), scaled by
    YaRN's attention factor where it applies.

    `num_positions`, a static bound (every position below it), evaluates cos and sin once per
    position 0 .. num_positions-1 and gathers the rows: XLA:CPU fuses a table computed from
    `positions` into each of its consumers and evaluates cos and sin again in every one (every
    key tile of every layer's attention: 15 % of the tiny target's forward). A position at or past
    the bound gives NaN.
    """
    inv_freq = jnp.asarray(rope_inv_freq(rope, head_dim))
    scale = rope.attention_factor if rope.kind == "yarn" else 1.0

    def tables(p):  # [...] -> cos, sin [..., R]
        freqs = p.astype(jnp.float32)[..., None] * inv_freq
        angles = jnp.concatenate([freqs, freqs], axis=-1)
        return jnp.cos(angles) * scale, jnp.sin(angles) * scale

    if num_positions is None:
        cos, sin = tables(positions)
    else:
        cos, sin = (
            jnp.take(t, positions, axis=0, mode="fill", fill_value=jnp.nan) for t in tables(jnp.arange(num_positions))
        )
    return Rotary(cos[..., None, :], sin[..., None, :])


def apply_rope(x: jax.Array, tables: Rotary) -> jax.Array:
    """x [..., T, heads, H] -> rotated x (rotate-half layout over the first R dimensions; the rest
    pass unrotated)."""
    x32 = x.astype(jnp.float32)
    dim = tables.cos.shape[-1]
    rot, rest = x32[..., :dim], x32[..., dim:]
    half = dim // 2
    rotated = jnp.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
    out = rot * tables.cos + rotated * tables.sin
    return (jnp.concatenate([out, rest], axis=-1) if rest.shape[-1] else out).astype(x.dtype)


# The gate's activation of a gated MLP: SiLU (SwiGLU), or GELU's tanh approximation (GeGLU, Gemma).
GATE_ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True)}


class SwiGLU(nnx.Module):
    """down(act(gate(x)) · up(x)); act SiLU, or GELU-tanh with activation='gelu_tanh' (GeGLU)."""

    def __init__(
        self, hidden_size, intermediate_size, *, param_dtype, compute_dtype, rngs, init_std=None, activation="silu"
    ):
        kw = dict(param_dtype=param_dtype, compute_dtype=compute_dtype, rngs=rngs, init_std=init_std)
        self.gate_proj = linear(hidden_size, intermediate_size, **kw)
        self.up_proj = linear(hidden_size, intermediate_size, **kw)
        self.down_proj = linear(intermediate_size, hidden_size, **kw)
        self.activation = activation

    def __call__(self, x: jax.Array) -> jax.Array:
        gate = GATE_ACTIVATIONS[self.activation](self.gate_proj(x))
        hidden = constrain(gate * self.up_proj(x), (BATCH, ..., MLP))
        return constrain(self.down_proj(hidden), (BATCH, ..., EMBED))


def swiglu_macs(hidden_size: int, intermediate_size: int) -> int:
    """Multiply-adds a token of `SwiGLU`: its gate, up and down projections."""
    return 3 * hidden_size * intermediate_size


class DecoderBlock(nnx.Module):
    """The one pre-norm block skeleton of target and drafter:
    x + mixer(norm(x)), then x + mlp(norm(x)).

    The token mixer (full, sliding or DFlash attention, linear attention) and the MLP (SwiGLU,
    mixture of experts) are modules chosen per layer; the block only composes them. The mixer is
    stored under its checkpoint name (`self_attn`, `linear_attn`) so parameter paths mirror the
    Hugging Face names. A mixer has `__call__(h, inputs)` for the packed (training) forward and
    `decode(h, inputs, cache) -> (out, cache)` for its cache slice; `inputs` is whatever the model
    prepared once for all layers (positions, RoPE tables, masks, context).
    """

    def __init__(self, mixer_name: str, mixer: nnx.Module, mlp: nnx.Module, *, hidden_size: int, norm_kw: dict):
        self.input_layernorm = RMSNorm(hidden_size, **norm_kw)
        self.mixer_name = mixer_name
        setattr(self, mixer_name, mixer)
        self.post_attention_layernorm = RMSNorm(hidden_size, **norm_kw)
        self.mlp = mlp

    @property
    def mixer(self) -> nnx.Module:
        return getattr(self, self.mixer_name)

    def _mlp_residual(self, x: jax.Array) -> jax.Array:
        return x + self.mlp(self.post_attention_layernorm(x))

    def __call__(self, x: jax.Array, inputs) -> jax.Array:
        """x [..., D] -> [..., D] (packed forward)."""
        return self._mlp_residual(x + self.mixer(self.input_layernorm(x), inputs))

    def decode(self, x: jax.Array, inputs, cache):
        """x [B, T, D] against the mixer's cache slice -> ([B, T, D], updated slice)."""
        out, cache = self.mixer.decode(self.input_layernorm(x), inputs, cache)
        return self._mlp_residual(x + out), cache
