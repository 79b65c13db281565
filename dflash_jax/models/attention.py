"""Attention: the target's patterns (packed causal, cached for decoding) and the ops every pattern
shares; the drafter's DFlash block attention is in `block_attention.py`.

Shape letters (docs/design.md §9): B batch rows, T queries, S keys, N blocks per row, L block
length, M cache slots, K kv heads, G query heads per kv head (GQA), H head dim. Queries arrive as
[..., K*G, H] and are viewed as [..., K, G, H]. Scores and softmax run in fp32; masked scores get
a large finite negative value, so a fully masked row yields a finite (uniform) average instead of
NaN (docs/design.md §3.2).

Training's two patterns have two implementations; the model's attention mixers hold which one
they use (the config's `train.attention`, resolved once by `resolve_implementation`) and pass
it to every call, like maxtext's `AttentionOp` holds its kernel:

* "xla": the XLA code of this module, the reference and the CPU path. Heads are moved in front
  of the tokens once per call, so every einsum is a plain batched matmul; the packed causal
  attention computes only the query-tile x key-tile pairs on or below the diagonal
  (`packed_causal_pairs`); the block attention runs a chunk of blocks at a time against every
  context position, masked, each chunk rematerialized in the backward pass.
* "fused": Pallas kernels (`models/kernels/`) that visit only the keys the mask lets a query
  see: the target's queries the key tiles of their document up to the diagonal, the drafter's
  blocks the context tiles of their span and their own block. GPUs only (interpret mode, for
  tests, elsewhere).
* "auto" (the config's default) resolves to "fused" on GPU, "xla" otherwise.

Decoding (`attend` with a cache mask, `block_attention.block_attention_cached`) always uses XLA.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from dflash_jax.models import sharding
from dflash_jax.models.kernels import MASKED

IMPLEMENTATIONS = ("auto", "xla", "fused")


def resolve_implementation(name: str, backend: str | None = None) -> str:
    """'auto', 'xla' or 'fused' -> the code that runs on `backend` (default: JAX's): 'xla' or
    'fused'."""
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"attention implementation {name!r} is not one of {', '.join(IMPLEMENTATIONS)}")
    if name == "auto":
        return "fused" if (backend or jax.default_backend()) == "gpu" else "xla"
    return name


def grouped(q: jax.Array, num_kv_heads: int) -> jax.Array:
    """[..., T, K*G, H] -> [..., T, K, G, H]."""
    *lead, t, heads, h = q.shape
    return q.reshape(*lead, t, num_kv_heads, heads // num_kv_heads, h)


def scaled_scores(qg: jax.Array, k: jax.Array, spec: str) -> jax.Array:
    """fp32 scores scaled by head_dim**-0.5."""
    return jnp.einsum(spec, qg, k, preferred_element_type=jnp.float32) * (qg.shape[-1] ** -0.5)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """q [B, T, K*G, H], k/v [B, S, K, H], mask [B, T, S] (True = visible) -> [B, T, K*G, H]."""
    qg = grouped(q, k.shape[-2])
    scores = jnp.where(mask[:, None, None], scaled_scores(qg, k, "BTKGH,BSKH->BKGTS"), MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("BKGTS,BSKH->BTKGH", probs, v).reshape(q.shape)


def unnormalized_softmax(*parts: jax.Array) -> tuple[tuple[jax.Array, ...], jax.Array]:
    """Softmax over the concatenation of score arrays [..., S_i] along their last axis, left
    unnormalized: (exp(part - max) for each part, their common denominator [..., 1]).

    Callers multiply the exponentials with the values and divide the [..., head_dim] result
    instead of the [..., S] probabilities: one pass over the scores fewer. The parts are never
    concatenated.
    """
    m = jnp.max(jnp.stack([p.max(-1, keepdims=True) for p in parts]), axis=0)
    exps = tuple(jnp.exp(p - m) for p in parts)
    return exps, sum(e.sum(-1, keepdims=True) for e in exps)


def weighted_values(weights: jax.Array, v: jax.Array, spec: str) -> jax.Array:
    """Σ weights · v in fp32 (weights cast to the values' dtype for the matmul)."""
    return jnp.einsum(spec, weights.astype(v.dtype), v, preferred_element_type=jnp.float32)


def packed_causal_tiles(seq_len: int) -> tuple[tuple[int, int], ...]:
    """The XLA packed causal attention's query tiles [lo, hi): up to 8 equal tiles, none shorter
    than 128 queries; tile [lo, hi) attends to keys [0, hi). On CPU, 64-query tiles made the
    batched score matmuls too small to run at speed: at S = 512, 4 tiles compute 11 % more pairs
    than 8 and the train step is 2-7 % faster (`bench/train_step_ab.py`)."""
    n = max(1, min(8, seq_len // 128))
    bounds = [round(i * seq_len / n) for i in range(n + 1)]
    return tuple(zip(bounds[:-1], bounds[1:]))


def packed_causal_pairs(seq_len: int) -> int:
    """(query, key) pairs per row and head the XLA packed causal attention computes: the tiles
    on and below the diagonal, S·(S + S/n)/2 for n tiles instead of S² (the bench's FLOP count)."""
    return sum((hi - lo) * hi for lo, hi in packed_causal_tiles(seq_len))


def packed_causal_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *, implementation: str
) -> jax.Array:
    """The target's attention over packed rows: causal, never across documents.

    q [B, S, K*G, H], k/v [B, S, K, H], segment_ids [B, S] (0 = padding) -> [B, S, K*G, H].
    Equals `attend` under the causal same-document mask (outputs at padding positions are
    unspecified on the fused path). `implementation`: 'xla' or 'fused' (resolved).
    """
    if implementation == "fused" and fused_supported(q):
        from dflash_jax.models.kernels import packed_causal

        return per_shard(
            packed_causal.packed_causal_attention,
            (q, k, v, segment_ids),
            (HEADS_SPEC, KV_SPEC, ROWS_SPEC),
            HEADS_SPEC,
        )
    return _packed_causal_xla(q, k, v, segment_ids)


def _packed_causal_xla(q, k, v, segment_ids):
    b, s, heads, h = q.shape
    kv = k.shape[2]
    g = heads // kv
    qh = q.reshape(b, s, kv, g, h).transpose(0, 2, 3, 1, 4)  # [B, K, G, S, H]
    kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, K, S, H]
    same_doc = (segment_ids[:, :, None] == segment_ids[:, None, :]) & (segment_ids[:, :, None] != 0)
    outs = []
    for lo, hi in packed_causal_tiles(s):
        t = hi - lo
        scores = scaled_scores(qh[:, :, :, lo:hi].reshape(b, kv, g * t, h), kh[:, :, :hi], "BKMH,BKSH->BKMS")
        causal = jnp.arange(lo, hi)[:, None] >= jnp.arange(hi)[None, :]
        mask = same_doc[:, lo:hi, :hi] & causal
        scores = jnp.where(mask[:, None, None], scores.reshape(b, kv, g, t, hi), MASKED)
        (weights,), denominator = unnormalized_softmax(scores.reshape(b, kv, g * t, hi))
        out = weighted_values(weights, vh[:, :, :hi], "BKMS,BKSH->BKMH") / denominator
        outs.append(out.astype(v.dtype).reshape(b, kv, g, t, h))
    out = jnp.concatenate(outs, axis=3)  # [B, K, G, S, H]
    return out.transpose(0, 3, 1, 2, 4).reshape(q.shape)


def cached_causal_mask(lengths: jax.Array, num_new: int, cache_size: int) -> jax.Array:
    """[B, T, M] mask for `num_new` tokens appended at `lengths` [B] to a cache of M slots.

    New token t sees every cached slot before it and the new tokens up to itself; slots past the
    current length hold stale entries from rolled-back drafts and are never visible.
    """
    query_slot = lengths[:, None] + jnp.arange(num_new)[None, :]
    return jnp.arange(cache_size)[None, None, :] <= query_slot[:, :, None]


# The fused kernels run per shard: rows split as the activations' batch axis, heads as theirs.
HEADS_SPEC = (sharding.BATCH, ..., sharding.HEADS, None)
KV_SPEC = (sharding.BATCH, ..., sharding.KV_HEADS, None)
ROWS_SPEC = (sharding.BATCH, ...)


def fused_supported(q: jax.Array) -> bool:
    from dflash_jax.models.kernels import supported_head_dim

    return supported_head_dim(q.shape[-1])


def per_shard(fn, args, logical_specs, out_logical_spec):
    """fn(*args) on each device's rows (and heads) under `sharding.activation_sharding`, where
    XLA cannot split a custom kernel call by itself; fn(*args) directly outside it."""
    mesh = sharding.active_mesh()
    if mesh is None or math.prod(mesh.shape.values()) == 1:
        return fn(*args)
    in_specs = tuple(sharding.activation_spec(x.shape, axes) for x, axes in zip(args, logical_specs))
    out_spec = sharding.activation_spec(args[0].shape, out_logical_spec)
    # Grouped-query heads stay together only if q and k/v heads are split the same way.
    head_axes = {spec[-2] if len(spec) >= 2 else None for spec, x in zip(in_specs, args) if x.ndim >= 4}
    if len(head_axes) > 1:
        in_specs = tuple(_without_heads(spec, x) for spec, x in zip(in_specs, args))
        out_spec = _without_heads(out_spec, args[0])
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_spec, check_vma=False)(*args)


def _without_heads(spec, x):
    if x.ndim < 4 or len(spec) < x.ndim - 1:
        return spec
    parts = list(spec) + [None] * (x.ndim - len(spec))
    parts[-2] = None
    return jax.sharding.PartitionSpec(*parts)
