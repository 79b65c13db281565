"""Attention token mixers: the target's causal self-attention and the drafter's DFlash attention.

A mixer is the first half of a `layers.DecoderBlock`: `__call__(h, inputs)` runs the packed
(training) forward, `decode(h, inputs, cache)` runs new tokens against the mixer's own cache
slice. `inputs` is prepared once per forward by the model and shared by every layer:
`PackedRows` / `DecodeStep` for the target, `DraftBlocks` / `DraftStep` for the drafter. The
attention patterns themselves are in `attention.py`; Gated DeltaNet, the other target mixer, is
in `linear_attention.py`. Shape letters: docs/design.md §9.
"""

from __future__ import annotations

import flax.struct
import jax
from flax import nnx

from dflash_jax.models import attention
from dflash_jax.models.cache import LayerCache
from dflash_jax.models.layers import RMSNorm, Rotary, apply_rope, linear
from dflash_jax.models.sharding import BATCH, EMBED, HEADS, KV_HEADS, constrain


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


@flax.struct.dataclass
class DraftBlocks:
    """What the drafter's mixers read in training: many blocks per packed row."""

    rotary: Rotary  # tables of the block positions [B, N, L]
    ctx: jax.Array  # [B, S, D]: hidden_norm(fc(target features)), shared by every layer
    ctx_rotary: Rotary  # tables of the context positions [B, S]
    ctx_mask: jax.Array  # [B, N, S]: the context each block sees (`attention.block_context_mask`)
    blocks_per_chunk: int = flax.struct.field(pytree_node=False, default=32)


@flax.struct.dataclass
class DraftStep:
    """What the drafter's mixers read when one block per row is drafted against their caches."""

    rotary: Rotary  # tables of the block positions [B, L]
    lengths: jax.Array  # [B]: context slots of each row's cache


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
    ):
        kw = dict(param_dtype=param_dtype, compute_dtype=compute_dtype, rngs=rngs, init_std=init_std)
        self.q_proj = linear(hidden_size, num_heads * head_dim, **kw)
        self.k_proj = linear(hidden_size, num_kv_heads * head_dim, **kw)
        self.v_proj = linear(hidden_size, num_kv_heads * head_dim, **kw)
        self.o_proj = linear(num_heads * head_dim, hidden_size, **kw)
        norm_kw = dict(eps=eps, param_dtype=param_dtype, compute_dtype=compute_dtype)
        self.q_norm = RMSNorm(head_dim, **norm_kw) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, **norm_kw) if qk_norm else None
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.compute_dtype = compute_dtype
        # Training's attention code, 'xla' or 'fused' (resolved); decoding always runs XLA.
        self.implementation = attention.resolve_implementation(implementation)

    def queries(self, x: jax.Array, tables: Rotary) -> jax.Array:
        """x [..., T, D] -> q [..., T, K*G, H], normalized and rotated."""
        q = self.q_proj(x).reshape(*x.shape[:-1], self.num_heads, self.head_dim)
        q = constrain(q, (BATCH, ..., HEADS, None))
        if self.q_norm is not None:
            q = self.q_norm(q)
        return apply_rope(q, tables)

    def keys_values(self, x: jax.Array, tables: Rotary) -> tuple[jax.Array, jax.Array]:
        """x [..., T, D] -> (k, v) [..., T, K, H]; k normalized and rotated."""
        shape = (*x.shape[:-1], self.num_kv_heads, self.head_dim)
        k = constrain(self.k_proj(x).reshape(shape), (BATCH, ..., KV_HEADS, None))
        if self.k_norm is not None:
            k = self.k_norm(k)
        v = constrain(self.v_proj(x).reshape(shape), (BATCH, ..., KV_HEADS, None))
        return apply_rope(k, tables), v

    def output(self, attn: jax.Array) -> jax.Array:
        """attn [..., T, K*G, H] -> [..., T, D]."""
        out = self.o_proj(attn.reshape(*attn.shape[:-2], self.num_heads * self.head_dim))
        return constrain(out, (BATCH, ..., EMBED))

    def new_cache(self, batch: int, max_len: int) -> LayerCache:
        return LayerCache.create(batch, max_len, self.num_kv_heads, self.head_dim, self.compute_dtype)


class SelfAttention(AttentionProjections):
    """The target's attention: causal over packed rows (never across documents), or over the
    layer's KV cache when decoding."""

    def __call__(self, h: jax.Array, rows: PackedRows) -> jax.Array:
        """h [B, S, D] -> [B, S, D]."""
        q = self.queries(h, rows.rotary)
        k, v = self.keys_values(h, rows.rotary)
        out = attention.packed_causal_attention(q, k, v, rows.segment_ids, implementation=self.implementation)
        return self.output(out)

    def decode(self, h: jax.Array, step: DecodeStep, cache: LayerCache) -> tuple[jax.Array, LayerCache]:
        """h [B, T, D] appended at slots step.start -> ([B, T, D], updated cache)."""
        q = self.queries(h, step.rotary)
        k, v = self.keys_values(h, step.rotary)
        cache = cache.write(k, v, step.start)
        mask = attention.cached_causal_mask(step.start, h.shape[1], cache.k.shape[1])
        attn = attention.attend(q, cache.k.astype(q.dtype), cache.v.astype(q.dtype), mask)
        return self.output(attn), cache


class DFlashAttention(AttentionProjections):
    """The drafter's attention: queries from the block only; keys/values from the context (the
    layer's own k/v projections of ctx) and from the block itself (non-causal)."""

    def __call__(self, h: jax.Array, blocks: DraftBlocks) -> jax.Array:
        """h [B, N, L, D] -> [B, N, L, D]."""
        q = self.queries(h, blocks.rotary)
        k_blk, v_blk = self.keys_values(h, blocks.rotary)
        k_ctx, v_ctx = self.keys_values(blocks.ctx, blocks.ctx_rotary)
        attn = attention.block_attention(
            q,
            k_ctx,
            v_ctx,
            k_blk,
            v_blk,
            blocks.ctx_mask,
            blocks_per_chunk=blocks.blocks_per_chunk,
            implementation=self.implementation,
        )
        return self.output(attn)

    def decode(self, h: jax.Array, step: DraftStep, cache: LayerCache) -> tuple[jax.Array, LayerCache]:
        """One block h [B, L, D] against the cached context -> ([B, L, D], the cache unchanged)."""
        q = self.queries(h, step.rotary)
        k, v = self.keys_values(h, step.rotary)
        attn = attention.block_attention_cached(q, cache.k, cache.v, step.lengths, k, v)
        return self.output(attn), cache

    def write_context(self, ctx: jax.Array, tables: Rotary, cache: LayerCache, start: jax.Array) -> LayerCache:
        """The k/v of context ctx [B, T, D] (tables of its positions) written at slots start [B]."""
        k, v = self.keys_values(ctx, tables)
        return cache.write(k, v, start)
