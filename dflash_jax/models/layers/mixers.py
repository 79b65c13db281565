"""The target's attention token mixer, and the q/k/v/o projections every attention mixer shares.

A mixer is the first half of a `layers.DecoderBlock`: `__call__(h, inputs)` runs the packed
(training) forward, `decode(h, inputs, cache)` runs new tokens against the mixer's own cache
slice. `inputs` is prepared once per forward by the model and shared by every layer:
`PackedRows` / `DecodeStep` for the target (`drafter.py` has the drafter's). The attention
patterns themselves are in `attention.py`; Gated DeltaNet, the other target mixer, is in
`linear_attention.py`; the drafter's DFlash attention in `drafter.py`. Shape letters:
docs/design.md §9.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from dflash_jax.models.architecture import TransformerConfig, layer_attention, layer_window
from dflash_jax.models.layers import attention
from dflash_jax.models.layers.basic import RMSNorm, Rotary, apply_rope, linear
from dflash_jax.models.layers.cache import LayerCache, leading_slots
from dflash_jax.models.sharding import BATCH, EMBED, HEADS, KV_HEADS, NORM, PartitionRules, constrain

# The q/k/v/o projections of every attention mixer, target and drafter; biases per head like their outputs.
PARTITION_RULES: PartitionRules = (
    (r"q_proj\.bias", (HEADS,)),
    (r"[kv]_proj\.bias", (KV_HEADS,)),
    (r"o_proj\.bias", (NORM,)),
    (r"q_proj\.kernel", (EMBED, HEADS)),
    (r"[kv]_proj\.kernel", (EMBED, KV_HEADS)),
    (r"o_proj\.kernel", (HEADS, EMBED)),
)


@flax.struct.dataclass
class PackedRows:
    """What the target's mixers read in a packed forward of [B, S] rows."""

    segment_ids: jax.Array  # [B, S] (0 = padding)
    rotary: Rotary  # tables of the positions [B, S]


@flax.struct.dataclass
class DecodeStep:
    """What the target's mixers read when T new tokens are appended to their caches."""

    start: jax.Array  # [B] int32: tokens of each row already in the caches (the new ones follow)
    rotary: Rotary  # tables of the new tokens' positions [B, T]
    # [B] int32: the real new tokens of each row, the rest padding (a prefill of padded prompts);
    # None: all T. Attention rolls padding back by the caller's lengths; a recurrent state must
    # never take it in.
    num_valid: jax.Array | None = None
    # Static: attention reads only the first num_slots cache slots, which must cover every row's
    # start + T (the host loop picks a bucket, `decoding.generate.attended_slots`); None: all.
    num_slots: int | None = flax.struct.field(pytree_node=False, default=None)


class AttentionProjections(nnx.Module):
    """q/k/v/o projections with optional per-head q/k RMSNorm applied before RoPE.

    The attention pattern itself lives in `attention.py`; target and drafter differ only there.
    """

    def __init__(
        self,
        *,
        hidden_size,
        num_heads,
        num_kv_heads,
        head_dim,
        qk_norm: bool,
        eps,
        param_dtype,
        compute_dtype,
        rngs,
        init_std=None,
        implementation: str = "xla",
        output_gate: bool = False,
        zero_centered_norm: bool = False,
        use_bias: bool = False,
        qk_norm_across_heads: bool = False,
    ):
        """`output_gate` (Qwen3.5 / Qwen3-Next): q_proj also yields, per head after its queries, a
        gate whose sigmoid scales the attention output. `use_bias` (gpt-oss): q/k/v/o biases.
        `qk_norm_across_heads` (MiniMax-M2): q and k normalized over all their heads at once."""
        kw = dict(param_dtype=param_dtype, compute_dtype=compute_dtype, rngs=rngs, init_std=init_std, use_bias=use_bias)
        self.output_gate = output_gate
        self.q_proj = linear(hidden_size, num_heads * head_dim * (2 if output_gate else 1), **kw)
        self.k_proj = linear(hidden_size, num_kv_heads * head_dim, **kw)
        self.v_proj = linear(hidden_size, num_kv_heads * head_dim, **kw)
        self.o_proj = linear(num_heads * head_dim, hidden_size, **kw)
        norm_kw = dict(eps=eps, param_dtype=param_dtype, compute_dtype=compute_dtype, zero_centered=zero_centered_norm)
        q_width, k_width = (num_heads * head_dim, num_kv_heads * head_dim) if qk_norm_across_heads else (head_dim,) * 2
        self.q_norm = RMSNorm(q_width, **norm_kw) if qk_norm else None
        self.k_norm = RMSNorm(k_width, **norm_kw) if qk_norm else None
        self.qk_norm_across_heads = qk_norm_across_heads
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.compute_dtype = compute_dtype
        # Training's attention code, 'xla' or 'fused' (resolved); decoding always runs XLA.
        self.implementation = attention.resolve_implementation(implementation)

    def queries(self, x: jax.Array, tables: Rotary) -> tuple[jax.Array, jax.Array | None]:
        """x [..., T, D] -> (q [..., T, K*G, H] normalized and rotated, the output gate
        [..., T, K*G, H] or None)."""
        q = self.q_proj(x)
        if self.q_norm is not None and self.qk_norm_across_heads:
            q = self.q_norm(q)
        q = constrain(q.reshape(*x.shape[:-1], self.num_heads, -1), (BATCH, ..., HEADS, None))
        gate = None
        if self.output_gate:
            q, gate = jnp.split(q, 2, axis=-1)
        if self.q_norm is not None and not self.qk_norm_across_heads:
            q = self.q_norm(q)
        return apply_rope(q, tables), gate

    def keys_values(self, x: jax.Array, tables: Rotary) -> tuple[jax.Array, jax.Array]:
        """x [..., T, D] -> (k, v) [..., T, K, H]; k normalized and rotated."""
        shape = (*x.shape[:-1], self.num_kv_heads, self.head_dim)
        k = self.k_proj(x)
        if self.k_norm is not None and self.qk_norm_across_heads:
            k = self.k_norm(k)
        k = constrain(k.reshape(shape), (BATCH, ..., KV_HEADS, None))
        if self.k_norm is not None and not self.qk_norm_across_heads:
            k = self.k_norm(k)
        v = constrain(self.v_proj(x).reshape(shape), (BATCH, ..., KV_HEADS, None))
        return apply_rope(k, tables), v

    def output(self, attn: jax.Array, gate: jax.Array | None = None) -> jax.Array:
        """attn [..., T, K*G, H] (times sigmoid(gate), where there is one) -> [..., T, D]."""
        if gate is not None:
            attn = attn * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(attn.dtype)
        out = self.o_proj(attn.reshape(*attn.shape[:-2], self.num_heads * self.head_dim))
        return constrain(out, (BATCH, ..., EMBED))

    def new_cache(self, batch: int, max_len: int, max_step: int = 1) -> LayerCache:
        """Slots for `max_len` tokens a row (attention rolls back any number of them)."""
        return LayerCache.create(batch, max_len, self.num_kv_heads, self.head_dim, self.compute_dtype)


class SelfAttention(AttentionProjections):
    """The target's attention: causal over packed rows (never across documents), or over the
    layer's KV cache when decoding; optionally over a sliding window of keys and with a learned
    sink logit per head (gpt-oss)."""

    def __init__(self, *, sliding_window: int = 0, sinks: bool = False, **projections):
        super().__init__(**projections)
        self.sliding_window = sliding_window  # 0: every earlier key of the document
        self.sinks = nnx.Param(jnp.zeros((self.num_heads,), projections["param_dtype"])) if sinks else None

    def _sinks(self) -> jax.Array | None:
        return None if self.sinks is None else self.sinks[...].astype(jnp.float32)

    def __call__(self, h: jax.Array, rows: PackedRows) -> jax.Array:
        """h [B, S, D] -> [B, S, D]."""
        q, gate = self.queries(h, rows.rotary)
        k, v = self.keys_values(h, rows.rotary)
        out = attention.packed_causal_attention(
            q,
            k,
            v,
            rows.segment_ids,
            implementation=self.implementation,
            sliding_window=self.sliding_window,
            sinks=self._sinks(),
        )
        return self.output(out, gate)

    def decode(self, h: jax.Array, step: DecodeStep, cache: LayerCache) -> tuple[jax.Array, LayerCache]:
        """h [B, T, D] appended at slots step.start -> ([B, T, D], updated cache)."""
        q, gate = self.queries(h, step.rotary)
        k, v = self.keys_values(h, step.rotary)
        cache = cache.write(k, v, step.start)
        keys, values = leading_slots(cache.k, step.num_slots), leading_slots(cache.v, step.num_slots)
        mask = attention.cached_causal_mask(step.start, h.shape[1], keys.shape[1], self.sliding_window)
        attn = attention.attend(q, keys.astype(q.dtype), values.astype(q.dtype), mask, self._sinks())
        return self.output(attn, gate), cache


def projection_macs(
    hidden_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    output_gate: bool = False,
    values_from_keys: bool = False,
) -> int:
    """Multiply-adds a token of the q/k/v/o projections (`AttentionProjections`); `output_gate`
    doubles q_proj, `values_from_keys` drops v_proj."""
    q_width = num_heads * head_dim * (2 if output_gate else 1)
    kv_width = num_kv_heads * head_dim * (1 if values_from_keys else 2)
    return hidden_size * (q_width + kv_width) + num_heads * head_dim * hidden_size


def attention_macs(cfg: TransformerConfig, layer_type: str, rows: int, seq_len: int) -> int:
    """Multiply-adds of a target attention layer of `layer_type` over [rows, seq_len] packed rows:
    its projections (the layer kind's own head size and kv heads) and its scores and outputs over
    the tiles below the diagonal, inside the window of a sliding layer
    (`attention.packed_causal_pairs`)."""
    own = layer_attention(cfg, layer_type)
    weights = projection_macs(
        cfg.hidden_size,
        cfg.num_heads,
        own.num_kv_heads,
        own.head_dim,
        output_gate=cfg.attention_output_gate,
        values_from_keys=own.values_from_keys,
    )
    pairs = attention.packed_causal_pairs(seq_len, layer_window(cfg, layer_type))
    return rows * seq_len * weights + 2 * rows * pairs * cfg.num_heads * own.head_dim
