"""Attention: the target's patterns (packed causal, cached for decoding) and the ops every pattern
shares; the drafter's DFlash block attention is in `block_attention.py`.

Shape letters (docs/design.md §9): B batch rows, T queries, S keys, N blocks per row, L block
length, M cache slots, K kv heads, G query heads per kv head (GQA), H head dim. Queries arrive as
[..., K*G, H] and are viewed as [..., K, G, H]. Scores and softmax run in fp32; masked scores get
a large finite negative value, so a fully masked row yields a finite (uniform) average instead of
NaN (docs/design.md §3.2).

gpt-oss targets add two options to the target's patterns (both off by default, and then the code
is the plain causal attention): `sliding_window` W > 0, where a query at position i sees only the
keys i - W < j <= i (transformers' sliding mask), and `sinks` [K*G], one learned logit per query
head that joins the softmax as an extra column whose probability is dropped: the outputs are
Σ p_j v_j with the p_j normalized by Σ exp(s_j) + exp(sink). A fully masked row with a sink
yields zeros.

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
  blocks the context tiles of their span and their own block: Triton kernels on GPUs; on TPUs
  jax's splash attention for the target (`kernels/tpu_packed_causal.py`) and Mosaic kernels for
  the blocks (`kernels/tpu_block.py`). Interpret mode, for tests, elsewhere.
* "auto" (the config's default): "fused" on GPUs and TPUs, where the compilers' figures favour
  the kernels for both patterns (docs/performance.md: on a TPU the drafter's block kernel takes a
  quarter of XLA's roofline time for Qwen3-30B-A3B, `bench/attention.py`, and splash cuts its
  target's attention from 0.164 s to 0.048 s a step); "xla" on CPUs.

A layer whose heads no kernel runs (DeepSeek-V3's latent attention: values narrower than keys;
tiles that fit no GPU's shared memory; a window on the drafter's blocks) runs the XLA code under
"fused" too, and says why once (`kernel_runs`): the plan prints each reason.

Decoding (`attend` with a cache mask, `block_attention.block_attention_cached`) always uses XLA.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from dflash_jax.models import kernels, sharding
from dflash_jax.models.kernels import MASKED, target_backend

IMPLEMENTATIONS = ("auto", "xla", "fused")


_AUTO_FUSED = ("gpu", "tpu")  # where "auto" runs the kernels (module docstring)


def resolve_implementation(name: str, backend: str | None = None) -> str:
    """'auto', 'xla' or 'fused' -> the code that runs on `backend` (default: JAX's): 'xla' or 'fused'."""
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"attention implementation {name!r} is not one of {', '.join(IMPLEMENTATIONS)}")
    if name == "auto":
        return "fused" if (backend or target_backend()) in _AUTO_FUSED else "xla"
    return name


def grouped(q: jax.Array, num_kv_heads: int) -> jax.Array:
    """[..., T, K*G, H] -> [..., T, K, G, H]."""
    *lead, t, heads, h = q.shape
    return q.reshape(*lead, t, num_kv_heads, heads // num_kv_heads, h)


def scaled_scores(qg: jax.Array, k: jax.Array, spec: str) -> jax.Array:
    """fp32 scores scaled by head_dim**-0.5."""
    return jnp.einsum(spec, qg, k, preferred_element_type=jnp.float32) * (qg.shape[-1] ** -0.5)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, sinks: jax.Array | None = None) -> jax.Array:
    """q [B, T, K*G, H], k [B, S, K, H], v [B, S, K, U], mask [B, T, S] (True = visible), optional
    sinks [K*G] -> [B, T, K*G, U] (U: the value head dim, H but for latent attention)."""
    qg = grouped(q, k.shape[-2])
    scores = jnp.where(mask[:, None, None], scaled_scores(qg, k, "BTKGH,BSKH->BKGTS"), MASKED)
    if sinks is None:
        probs = jax.nn.softmax(scores, axis=-1)
    else:
        sink = sinks.astype(jnp.float32).reshape(qg.shape[-3:-1])[:, :, None, None]  # [K, G, 1, 1]
        (weights,), denominator = unnormalized_softmax(scores, sink=sink)
        probs = weights / denominator
    return jnp.einsum("BKGTS,BSKU->BTKGU", probs.astype(v.dtype), v).reshape(*q.shape[:-1], v.shape[-1])


def unnormalized_softmax(*parts: jax.Array, sink: jax.Array | None = None) -> tuple[tuple[jax.Array, ...], jax.Array]:
    """Softmax over the concatenation of score arrays [..., S_i] along their last axis, left
    unnormalized: (exp(part - max) for each part, their common denominator [..., 1]).

    Callers multiply the exponentials with the values and divide the [..., head_dim] result
    instead of the [..., S] probabilities: one pass over the scores fewer. The parts are never
    concatenated. `sink` (broadcastable to [..., 1]): one more logit per row that joins the max
    and the denominator but weighs no value (gpt-oss' attention sinks).
    """
    m = jnp.max(jnp.stack([p.max(-1, keepdims=True) for p in parts]), axis=0)
    if sink is not None:
        m = jnp.maximum(m, sink)
    exps = tuple(jnp.exp(p - m) for p in parts)
    denominator = sum(e.sum(-1, keepdims=True) for e in exps)
    if sink is not None:
        denominator = denominator + jnp.exp(sink - m)
    return exps, denominator


def weighted_values(weights: jax.Array, v: jax.Array, spec: str) -> jax.Array:
    """Σ weights · v in fp32 (weights cast to the values' dtype for the matmul)."""
    return jnp.einsum(spec, weights.astype(v.dtype), v, preferred_element_type=jnp.float32)


def packed_causal_tiles(seq_len: int) -> tuple[tuple[int, int], ...]:
    """The XLA packed causal attention's query tiles [lo, hi): up to 8 equal tiles, none shorter
    than 128 queries; tile [lo, hi) attends to keys [0, hi) (from `window_start(lo, W)` under a
    sliding window W). On CPU, 64-query tiles made the batched score matmuls too small to run at
    speed: at S = 512, 4 tiles compute 11 % more pairs than 8 and the train step is 2-7 % faster
    (`bench/train_step.py --base`)."""
    n = max(1, min(8, seq_len // 128))
    bounds = [round(i * seq_len / n) for i in range(n + 1)]
    return tuple(zip(bounds[:-1], bounds[1:]))


def window_start(first_query: int, sliding_window: int) -> int:
    """The first key any query at or after `first_query` sees under a sliding window (0: none)."""
    return max(0, first_query - sliding_window + 1) if sliding_window else 0


def packed_causal_pairs(seq_len: int, sliding_window: int = 0) -> int:
    """(query, key) pairs per row and head the XLA packed causal attention computes: the tiles
    on and below the diagonal, S·(S + S/n)/2 for n tiles instead of S² (the bench's FLOP count);
    with a sliding window only the keys from the window start of each tile's first query."""
    return sum((hi - lo) * (hi - window_start(lo, sliding_window)) for lo, hi in packed_causal_tiles(seq_len))


@jax.named_scope("attention")  # the plan's time per part of the step (training/planning/hlo.py `region`)
def packed_causal_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array,
    *,
    implementation: str,
    sliding_window: int = 0,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """The target's attention over packed rows: causal, never across documents.

    q [B, S, K*G, H], k [B, S, K, H], v [B, S, K, U], segment_ids [B, S] (0 = padding) ->
    [B, S, K*G, U]. Equals `attend` under the causal same-document mask (outputs at padding
    positions are unspecified on the fused path). `implementation`: 'xla' or 'fused' (resolved);
    where the kernel cannot run these heads (latent attention's U < H, no tile fitting the GPU's
    shared memory) the XLA code runs and says why (`kernels.fall_back`).
    `sliding_window` (0: none) and `sinks` [K*G] fp32 (None: none): the module docstring.
    """
    if implementation == "fused" and kernel_runs("target", _why_no_causal_kernel(q, v)):
        from dflash_jax.models.kernels import packed_causal, tpu_packed_causal

        fused = tpu_packed_causal if target_backend() == "tpu" else packed_causal
        kernel = functools.partial(fused.packed_causal_attention, sliding_window=sliding_window)
        if sinks is None:
            return per_shard(kernel, (q, k, v, segment_ids), (HEADS_SPEC, KV_SPEC, KV_SPEC, ROWS_SPEC), HEADS_SPEC)
        # Sinks laid out like q's rows and heads, so each shard gets its own heads' sinks.
        row_sinks = jnp.broadcast_to(sinks.astype(jnp.float32)[None, None, :, None], (q.shape[0], 1, q.shape[2], 1))

        def with_sinks(q, k, v, segment_ids, row_sinks):
            return kernel(q, k, v, segment_ids, sinks=row_sinks[0, 0, :, 0])

        return per_shard(
            with_sinks,
            (q, k, v, segment_ids, row_sinks),
            (HEADS_SPEC, KV_SPEC, KV_SPEC, ROWS_SPEC, HEADS_SPEC),
            HEADS_SPEC,
        )
    return _packed_causal_xla(q, k, v, segment_ids, sliding_window, sinks)


def _packed_causal_xla(q, k, v, segment_ids, sliding_window=0, sinks=None):
    b, s, heads, h = q.shape
    kv = k.shape[2]
    g = heads // kv
    qh = q.reshape(b, s, kv, g, h).transpose(0, 2, 3, 1, 4)  # [B, K, G, S, H]
    kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, K, S, H]
    same_doc = (segment_ids[:, :, None] == segment_ids[:, None, :]) & (segment_ids[:, :, None] != 0)
    sink = None if sinks is None else sinks.astype(jnp.float32).reshape(kv, g, 1)
    outs = []
    for lo, hi in packed_causal_tiles(s):
        # Keys [first, hi): keys before the window of the tile's first query are never computed.
        t, first = hi - lo, window_start(lo, sliding_window)
        num_keys = hi - first
        scores = scaled_scores(qh[:, :, :, lo:hi].reshape(b, kv, g * t, h), kh[:, :, first:hi], "BKMH,BKSH->BKMS")
        causal = jnp.arange(lo, hi)[:, None] >= jnp.arange(first, hi)[None, :]
        if sliding_window:
            causal &= jnp.arange(lo, hi)[:, None] - jnp.arange(first, hi)[None, :] < sliding_window
        mask = same_doc[:, lo:hi, first:hi] & causal
        scores = jnp.where(mask[:, None, None], scores.reshape(b, kv, g, t, num_keys), MASKED)
        tile_sink = None if sink is None else jnp.broadcast_to(sink, (kv, g, t)).reshape(kv, g * t, 1)
        (weights,), denominator = unnormalized_softmax(scores.reshape(b, kv, g * t, num_keys), sink=tile_sink)
        out = weighted_values(weights, vh[:, :, first:hi], "BKMS,BKSH->BKMH") / denominator
        outs.append(out.astype(v.dtype).reshape(b, kv, g, t, -1))
    out = jnp.concatenate(outs, axis=3)  # [B, K, G, S, U]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, s, heads, -1)


def cached_causal_mask(lengths: jax.Array, num_new: int, cache_size: int, sliding_window: int = 0) -> jax.Array:
    """[B, T, M] mask for `num_new` tokens appended at `lengths` [B] to a cache of M slots.

    New token t sees every cached slot before it and the new tokens up to itself; slots past the
    current length hold stale entries from rolled-back drafts and are never visible. With a
    sliding window W > 0 it sees only the last W slots up to itself (the cache keeps them all).
    """
    query_slot = lengths[:, None] + jnp.arange(num_new)[None, :]
    slots = jnp.arange(cache_size)[None, None, :]
    visible = slots <= query_slot[:, :, None]
    if sliding_window:
        visible &= slots > query_slot[:, :, None] - sliding_window
    return visible


# The fused kernels run per shard: rows split as the activations' batch axis, heads as theirs.
HEADS_SPEC = (sharding.BATCH, ..., sharding.HEADS, None)
KV_SPEC = (sharding.BATCH, ..., sharding.KV_HEADS, None)
ROWS_SPEC = (sharding.BATCH, ...)


def kernel_runs(part: str, unfit: str) -> bool:
    """Whether the `part`'s kernel runs; where it cannot (`unfit` says why), the XLA code runs and
    says so once (`kernels.fall_back`: the plan prints it)."""
    if unfit:
        kernels.fall_back(f"the {part}'s attention runs XLA's code, not a kernel: {unfit}")
    return not unfit


def why_no_kernel(q: jax.Array) -> str:
    """Why no kernel takes these heads ('' when they do)."""
    h = q.shape[-1]
    return "" if kernels.supported_head_dim(h) else f"heads of {h} (the kernels take powers of two from 16)"


def no_tile_fits(h: int) -> str:
    limit = kernels.shared_memory_per_block()
    return f"heads of {h} (no tile of its kernels fits the GPU's {limit:,} bytes of shared memory a block)"


def _why_no_causal_kernel(q: jax.Array, v: jax.Array) -> str:
    """Why the packed causal kernel cannot run q [B, S, K*G, H] and v [..., U] ('' when it can)."""
    from dflash_jax.models.kernels import packed_causal, tpu_packed_causal

    h, u = q.shape[-1], v.shape[-1]
    if u != h:
        return f"heads of {h} with values of {u} (the kernels take values as wide)"
    if why_no_kernel(q):
        return why_no_kernel(q)
    if target_backend() == "tpu":
        return (
            "" if tpu_packed_causal.supported(q.shape[1]) else f"rows of {q.shape[1]} (splash takes multiples of 128)"
        )
    return "" if packed_causal.tiles_for(h, q.dtype.itemsize) else no_tile_fits(h)


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
