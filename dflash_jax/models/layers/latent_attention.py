"""Multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi-K2), the target mixer of the DeepSeek-V3
architecture; transformers' `DeepseekV3Attention` is the reference.

Keys and values come from one low-rank latent per token: kv_a_proj_with_mqa maps x [D] to a latent
c [C] (RMS-normalized by kv_a_layernorm) and one rotary key k_r [R] shared by every head;
kv_b_proj expands c into each head's unrotated key part [N] and value [U]. Queries come from
q_proj, or low-rank through q_a_proj, q_a_layernorm, q_b_proj, per head [N + R]: a part without
position (no rope) and a rotated part. A head's score is q_n · k_n + q_r · k_r, scaled by
`softmax_scale` ((N + R)^-0.5, times YaRN's mscale(factor, mscale_all_dim)² where the config sets
mscale_all_dim; the rotary tables carry YaRN's other factor, `RopeConfig.attention_factor`).

The checkpoints rotate interleaved pairs (x0, x1), (x2, x3), ... of the rotary part
(`rope_interleave`); this module rotates halves, as every other mixer here. The two agree when the
rotary rows of q_b_proj (or q_proj) and kv_a_proj_with_mqa are reordered evens-then-odds at load
(`rope_rows_deinterleaved`); the rotated vectors are then exactly transformers'.

Two computations of the same attention:

* packed rows (training, prefill of features): c expanded to every head's keys and values, then
  the target's packed causal attention; values are narrower than keys (U < N + R).
* decoding: the cache keeps, per token, only [c, k_r] (C + R numbers, 576 for DeepSeek-V3, where
  expanded keys and values would take 128 · (192 + 128)). kv_b_proj is absorbed: each head's q_n
  is mapped into the latent space (q_n · W_uk, [C]), attends over the cached [c, k_r] as one
  shared key head, and its latent output is mapped to the head's value space (· W_uv).

Letters: B rows, S/T tokens, M cache slots, D model dim, heads, C kv_lora_rank, N qk_nope_head_dim,
R qk_rope_head_dim, U v_head_dim (docs/design.md §9).
"""

from __future__ import annotations

import math

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dflash_jax.models.architecture import LatentAttentionConfig, TransformerConfig
from dflash_jax.models.layers import attention
from dflash_jax.models.layers.basic import RMSNorm, Rotary, apply_rope, linear
from dflash_jax.models.layers.cache import leading_slots, write_rows
from dflash_jax.models.layers.mixers import DecodeStep, PackedRows
from dflash_jax.models.sharding import BATCH, EMBED, HEADS, PartitionRules, constrain

# The latent and q low-rank norms use transformers' default epsilon, not the config's rms_norm_eps.
LATENT_NORM_EPS = 1e-6

# The low-rank inputs whole, their expansions by head (q_proj, o_proj and the norms: mixers' and basic's rules).
PARTITION_RULES: PartitionRules = (
    (r"(q_a_proj|kv_a_proj_with_mqa)\.kernel", (EMBED, None)),
    (r"(q_b_proj|kv_b_proj)\.kernel", (None, HEADS)),
)


@flax.struct.dataclass
class LatentCache:
    """Per token, the normalized kv latent and then the rotated shared rotary key: [B, M, C + R]."""

    entries: jax.Array

    def write(self, entries: jax.Array, start: jax.Array) -> LatentCache:
        """entries [B, T, C + R] written at slots start[b] onwards."""
        return LatentCache(write_rows(self.entries, entries, start))


class LatentAttention(nnx.Module):
    """The target's MLA mixer: `__call__` over packed rows, `decode` against a `LatentCache`
    (rolled back, like attention, by the caller's lengths)."""

    def __init__(
        self,
        config: LatentAttentionConfig,
        *,
        hidden_size: int,
        num_heads: int,
        param_dtype,
        compute_dtype,
        rngs,
        init_std=None,
        implementation: str = "xla",
    ):
        """`config.q_lora_rank` 0: queries by one q_proj (DeepSeek-V2-Lite); else q_a_proj,
        q_a_layernorm, q_b_proj."""
        q_lora_rank, kv_lora_rank, v_head_dim = config.q_lora_rank, config.kv_lora_rank, config.v_head_dim
        qk_nope_head_dim, qk_rope_head_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        kw = dict(param_dtype=param_dtype, compute_dtype=compute_dtype, rngs=rngs, init_std=init_std)
        norm_kw = dict(eps=LATENT_NORM_EPS, param_dtype=param_dtype, compute_dtype=compute_dtype)
        query_width = num_heads * (qk_nope_head_dim + qk_rope_head_dim)
        if q_lora_rank:
            self.q_a_proj = linear(hidden_size, q_lora_rank, **kw)
            self.q_a_layernorm = RMSNorm(q_lora_rank, **norm_kw)
            self.q_b_proj = linear(q_lora_rank, query_width, **kw)
        else:
            self.q_proj = linear(hidden_size, query_width, **kw)
        self.kv_a_proj_with_mqa = linear(hidden_size, kv_lora_rank + qk_rope_head_dim, **kw)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, **norm_kw)
        self.kv_b_proj = linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), **kw)
        self.o_proj = linear(num_heads * v_head_dim, hidden_size, **kw)
        self.q_lora_rank = q_lora_rank
        self.num_heads = num_heads
        self.kv_lora_rank = kv_lora_rank
        self.nope_dim = qk_nope_head_dim
        self.rope_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.softmax_scale = config.softmax_scale
        self.compute_dtype = compute_dtype
        self.implementation = attention.resolve_implementation(implementation)

    def _queries(self, x: jax.Array, tables: Rotary) -> tuple[jax.Array, jax.Array]:
        """x [B, T, D] -> (q_n [B, T, heads, N], rotated q_r [B, T, heads, R])."""
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora_rank else self.q_proj(x)
        q = constrain(q.reshape(*x.shape[:-1], self.num_heads, -1), (BATCH, ..., HEADS, None))
        return q[..., : self.nope_dim], apply_rope(q[..., self.nope_dim :], tables)

    def _latent(self, x: jax.Array, tables: Rotary) -> jax.Array:
        """x [B, T, D] -> [c, k_r] [B, T, C + R]: the normalized latent and the rotated shared key."""
        compressed = self.kv_a_proj_with_mqa(x)
        latent = self.kv_a_layernorm(compressed[..., : self.kv_lora_rank])
        rope_key = apply_rope(compressed[..., None, self.kv_lora_rank :], tables)[..., 0, :]
        return jnp.concatenate([latent, rope_key], axis=-1)

    def _output(self, out: jax.Array) -> jax.Array:
        """[B, T, heads, U] -> [B, T, D]."""
        return constrain(self.o_proj(out.reshape(*out.shape[:-2], -1)), (BATCH, ..., EMBED))

    def _scaled(self, q: jax.Array) -> jax.Array:
        """q [..., H] scaled so that attention's H^-0.5 makes `softmax_scale`."""
        return q * jnp.asarray(self.softmax_scale * math.sqrt(q.shape[-1]), q.dtype)

    def __call__(self, h: jax.Array, rows: PackedRows) -> jax.Array:
        """h [B, S, D] -> [B, S, D]: the latent expanded to every head's keys and values."""
        q_nope, q_rope = self._queries(h, rows.rotary)
        entries = self._latent(h, rows.rotary)
        kv = self.kv_b_proj(entries[..., : self.kv_lora_rank]).reshape(*h.shape[:-1], self.num_heads, -1)
        kv = constrain(kv, (BATCH, ..., HEADS, None))
        k_nope, v = kv[..., : self.nope_dim], kv[..., self.nope_dim :]
        k_rope = jnp.broadcast_to(entries[..., None, self.kv_lora_rank :], (*k_nope.shape[:-1], self.rope_dim))
        out = attention.packed_causal_attention(
            self._scaled(jnp.concatenate([q_nope, q_rope], axis=-1)),
            jnp.concatenate([k_nope, k_rope], axis=-1),
            v,
            rows.segment_ids,
            implementation=self.implementation,
        )
        return self._output(out)

    def decode(self, h: jax.Array, step: DecodeStep, cache: LatentCache) -> tuple[jax.Array, LatentCache]:
        """h [B, T, D] appended at slots step.start -> ([B, T, D], updated cache), kv_b_proj absorbed."""
        q_nope, q_rope = self._queries(h, step.rotary)
        cache = cache.write(self._latent(h, step.rotary), step.start)
        w = self.kv_b_proj.kernel[...].astype(self.compute_dtype).reshape(self.kv_lora_rank, self.num_heads, -1)
        w_uk, w_uv = w[..., : self.nope_dim], w[..., self.nope_dim :]  # [C, heads, N], [C, heads, U]
        q_latent = jnp.einsum("BTHN,CHN->BTHC", q_nope, w_uk)
        keys = leading_slots(cache.entries, step.num_slots).astype(h.dtype)[:, :, None, :]  # one head for all
        mask = attention.cached_causal_mask(step.start, h.shape[1], keys.shape[1])
        q = self._scaled(jnp.concatenate([q_latent, q_rope], axis=-1))
        out_latent = attention.attend(q, keys, keys[..., : self.kv_lora_rank], mask)  # [B, T, heads, C]
        return self._output(jnp.einsum("BTHC,CHU->BTHU", out_latent, w_uv)), cache

    def new_cache(self, batch: int, max_len: int, max_step: int = 1) -> LatentCache:
        """Slots for `max_len` tokens a row (rolled back, as attention, by lowering the lengths)."""
        return LatentCache(jnp.zeros((batch, max_len, self.kv_lora_rank + self.rope_dim), self.compute_dtype))


def latent_attention_macs(cfg: TransformerConfig, rows: int, seq_len: int) -> int:
    """Multiply-adds of a latent attention layer over [rows, seq_len] packed rows, as its packed
    forward computes them: the low-rank projections, the latent expanded to every head's keys and
    values, and attention of N + R wide keys and U wide values over the tiles below the diagonal."""
    latent, h, heads = cfg.latent_attention, cfg.hidden_size, cfg.num_heads
    qk = latent.qk_nope_head_dim + latent.qk_rope_head_dim
    rank = latent.q_lora_rank
    query = h * rank + rank * heads * qk if rank else h * heads * qk
    weights = (
        query
        + h * (latent.kv_lora_rank + latent.qk_rope_head_dim)
        + latent.kv_lora_rank * heads * (latent.qk_nope_head_dim + latent.v_head_dim)
        + heads * latent.v_head_dim * h
    )
    pairs = rows * attention.packed_causal_pairs(seq_len)
    return rows * seq_len * weights + pairs * heads * (qk + latent.v_head_dim)


def rope_rows_deinterleaved(weight: np.ndarray, head_width: int, rope_dim: int) -> np.ndarray:
    """A torch-layout projection [heads · head_width, in] whose every head ends with `rope_dim`
    rotary rows stored in interleaved pairs -> the same with those rows evens first, then odds
    (the rotate-half order this module uses)."""
    order = np.arange(weight.shape[0]).reshape(-1, head_width)
    rope = order[:, head_width - rope_dim :]
    order[:, head_width - rope_dim :] = np.concatenate([rope[:, 0::2], rope[:, 1::2]], axis=1)
    return weight[order.reshape(-1)]
