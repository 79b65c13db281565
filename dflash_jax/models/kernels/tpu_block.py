"""The drafter's DFlash block attention on TPUs (docs/design.md §3.2) as Pallas (Mosaic) kernels,
with its backward pass.

The visible keys are those of `block.py` (GPUs) and of the XLA reference: block n sees its
context span [start_n, end_n) and its own L keys. A TPU wants large matmuls and a static grid,
so the walk differs:

* the blocks are sorted by span end and taken CHUNK at a time: a chunk's CHUNK·G·L query rows
  (512 for Qwen3's G = 4, L = 16) are one matmul operand. In a packed row a later anchor lies in
  the same document or a later one, so sorted blocks' spans grow together and a chunk's spans
  cover one short run of context tiles;
* the grid's last axis walks that run: a scalar-prefetched (first tile, count) per chunk picks
  each step's key tile in the BlockSpec's index map; steps past the count keep the last tile (no
  new copy) and skip their compute. Each query row is masked to its own block's span;
* backward: dq, and the own block's dk and dv, walk the same way; the context's dk and dv walk,
  for each key tile, the run of chunks whose spans reach it (one contiguous run in end order), so
  every gradient element is written by one program, without atomics.

Scores in the backward kernels are computed transposed, [keys, query rows]: the per-row softmax
statistics (log-sum-exp, delta) are then lane vectors, and dk, dv are plain matmuls. Off a TPU
the kernels run in interpret mode (tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from dflash_jax.models.kernels import MASKED, cost, target_backend

CHUNK = 8  # blocks a grid step: 8 keeps the row count a multiple of the 8 sublanes of a tile
MAX_TILE = 512  # context keys a grid step
LANES = 128
_NT = (((1,), (1,)), ((), ()))  # a · bᵀ


def _tile(seq_len: int) -> int:
    return min(MAX_TILE, -(-seq_len // LANES) * LANES)


def _block_ids(shape: tuple[int, int], axis: int, size: int) -> jax.Array:
    """Which of the chunk's blocks each index along `axis` belongs to (runs of `size`), by
    comparisons: a vector division by a size that is not a power of two does not lower."""
    index = lax.broadcasted_iota(jnp.int32, shape, axis)
    ids = jnp.zeros(shape, jnp.int32)
    for i in range(1, CHUNK):
        ids += (index >= i * size).astype(jnp.int32)
    return ids


def _row_spans(start_ref, end_ref, first_block, shape, axis, rows_per_block):
    """Each query row's context span [start, end) as int32 arrays of `shape`, rows along `axis`."""
    ids = _block_ids(shape, axis, rows_per_block)
    start = jnp.zeros(shape, jnp.int32)
    end = jnp.zeros(shape, jnp.int32)
    for i in range(CHUNK):
        start = jnp.where(ids == i, start_ref[first_block + i], start)
        end = jnp.where(ids == i, end_ref[first_block + i], end)
    return start, end


def _dot(a, b, dims=None):
    if dims is None:
        return lax.dot(a, b, preferred_element_type=jnp.float32)
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


# ---------------------------------------------------------------------------------------------
# Kernels. Per program: q, do, o, dq [R, H] (R = CHUNK·G·L query rows, block-major, then head,
# then slot); own keys and values [CHUNK·L, H]; a context tile [T, H]; lse, delta [1, R].


def _forward_kernel(
    first_ref, count_ref, start_ref, end_ref, q_ref, kc_ref, vc_ref, kb_ref, vb_ref,
    o_ref, lse_ref, m_scr, l_scr, acc_scr, *, scale, rows_per_block, block_len, tile,
):  # fmt: skip
    chunk = pl.program_id(0) * pl.num_programs(2) + pl.program_id(2)
    step = pl.program_id(3)
    q = q_ref[...]
    rows = q.shape[0]

    @pl.when(step == 0)
    def _init():
        m_scr[...] = jnp.full(m_scr.shape, -jnp.inf, jnp.float32)
        l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
        acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

    def update(s, v):  # online softmax over masked scores s [R, keys]; m, l kept on all lanes
        m_prev = m_scr[...]
        m_new = jnp.maximum(m_prev, s.max(axis=-1, keepdims=True))
        p = jnp.exp(s - m_new[:, :1])
        correction = jnp.exp(m_prev - m_new)
        l_scr[...] = l_scr[...] * correction + p.sum(axis=-1, keepdims=True)
        acc_scr[...] = acc_scr[...] * correction[:, :1] + _dot(p.astype(v.dtype), v)
        m_scr[...] = m_new

    @pl.when(step < count_ref[chunk])
    def _context():
        s = _dot(q, kc_ref[...], _NT) * scale
        key = (first_ref[chunk] + step) * tile + lax.broadcasted_iota(jnp.int32, (1, tile), 1)
        start, end = _row_spans(start_ref, end_ref, chunk * CHUNK, (rows, 1), 0, rows_per_block)
        update(jnp.where((key >= start) & (key < end), s, MASKED), vc_ref[...])

    @pl.when(step == pl.num_programs(3) - 1)
    def _own_block_and_finish():  # last: a block always sees its own keys, so no row is empty
        kb = kb_ref[...]
        shape = (rows, kb.shape[0])
        own = _block_ids(shape, 0, rows_per_block) == _block_ids(shape, 1, block_len)
        update(jnp.where(own, _dot(q, kb, _NT) * scale, MASKED), vb_ref[...])
        total = l_scr[...]
        o_ref[...] = (acc_scr[...] / total[:, :1]).astype(o_ref.dtype)
        lse_ref[...] = (m_scr[...] + jnp.log(total)).T[:1]


def _dq_kernel(
    first_ref, count_ref, start_ref, end_ref, q_ref, kc_ref, vc_ref, kb_ref, vb_ref, do_ref, lse_ref, delta_ref,
    dq_ref, dkb_ref, dvb_ref, dq_scr, *, scale, rows_per_block, block_len, tile,
):  # fmt: skip
    chunk = pl.program_id(0) * pl.num_programs(2) + pl.program_id(2)
    step = pl.program_id(3)
    q, do = q_ref[...], do_ref[...]
    rows = q.shape[0]

    @pl.when(step == 0)
    def _init():
        dq_scr[...] = jnp.zeros(dq_scr.shape, jnp.float32)

    def grads(k, v, visible):  # -> pᵀ, dsᵀ [keys, R]
        p = jnp.where(visible, jnp.exp(_dot(k, q, _NT) * scale - lse_ref[...]), 0.0)
        return p, p * (_dot(v, do, _NT) - delta_ref[...])

    @pl.when(step < count_ref[chunk])
    def _context():
        k = kc_ref[...]
        key = (first_ref[chunk] + step) * tile + lax.broadcasted_iota(jnp.int32, (tile, 1), 0)
        start, end = _row_spans(start_ref, end_ref, chunk * CHUNK, (1, rows), 1, rows_per_block)
        _, ds = grads(k, vc_ref[...], (key >= start) & (key < end))
        dq_scr[...] += _dot(ds.T.astype(k.dtype), k)

    @pl.when(step == pl.num_programs(3) - 1)
    def _own_block_and_finish():
        kb = kb_ref[...]
        shape = (kb.shape[0], rows)
        own = _block_ids(shape, 1, rows_per_block) == _block_ids(shape, 0, block_len)
        p, ds = grads(kb, vb_ref[...], own)
        dq = dq_scr[...] + _dot(ds.T.astype(kb.dtype), kb)
        dq_ref[...] = (dq * scale).astype(dq_ref.dtype)
        dkb_ref[...] = (_dot(ds.astype(q.dtype), q) * scale).astype(dkb_ref.dtype)
        dvb_ref[...] = _dot(p.astype(do.dtype), do).astype(dvb_ref.dtype)


def _dkv_context_kernel(
    first_ref, count_ref, start_ref, end_ref, kc_ref, vc_ref, q_ref, do_ref, lse_ref, delta_ref,
    dk_ref, dv_ref, dk_scr, dv_scr, *, scale, rows_per_block, tile, chunks,
):  # fmt: skip
    row, key_tile, step = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    entry = row * pl.num_programs(2) + key_tile

    @pl.when(step == 0)
    def _init():
        dk_scr[...] = jnp.zeros(dk_scr.shape, jnp.float32)
        dv_scr[...] = jnp.zeros(dv_scr.shape, jnp.float32)

    @pl.when(step < count_ref[entry])
    def _chunk():
        q, do = q_ref[...], do_ref[...]
        k, v = kc_ref[...], vc_ref[...]
        chunk = row * chunks + first_ref[entry] + step
        key = key_tile * tile + lax.broadcasted_iota(jnp.int32, (tile, 1), 0)
        start, end = _row_spans(start_ref, end_ref, chunk * CHUNK, (1, q.shape[0]), 1, rows_per_block)
        visible = (key >= start) & (key < end)
        p = jnp.where(visible, jnp.exp(_dot(k, q, _NT) * scale - lse_ref[...]), 0.0)
        ds = p * (_dot(v, do, _NT) - delta_ref[...])
        dk_scr[...] += _dot(ds.astype(q.dtype), q)
        dv_scr[...] += _dot(p.astype(do.dtype), do)

    @pl.when(step == pl.num_programs(3) - 1)
    def _finish():
        dk_ref[...] = (dk_scr[...] * scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_scr[...].astype(dv_ref.dtype)


# ---------------------------------------------------------------------------------------------
# pallas_calls on the kernel layout: q, o, do [B, K, C, R, H]; lse, delta [B, K, C, 1, R]; own
# keys/values [B, K, C, CHUNK·L, H]; context keys/values [B, K, Sp, H] (Sp a multiple of the
# tile); spans [B, Np] in end order (Np = C·CHUNK).


def _chunk_tiles(start, end, tile):
    """(first tile, tile count) [B·C] of each chunk's spans; 0 tiles if none sees context."""
    b, n = start.shape
    start, end = start.reshape(b, n // CHUNK, CHUNK), end.reshape(b, n // CHUNK, CHUNK)
    seen = end > start
    lo = jnp.where(seen, start, jnp.iinfo(jnp.int32).max).min(-1) // tile
    hi = -(-jnp.where(seen, end, 0).max(-1) // tile)
    any_seen = seen.any(-1)
    return jnp.where(any_seen, lo, 0).reshape(-1), jnp.where(any_seen, hi - lo, 0).reshape(-1)


def _tile_chunks(first, count, tiles):
    """(first chunk, chunk count) [B·T] whose spans reach each key tile, from `_chunk_tiles`' [B, C]."""
    t = jnp.arange(tiles, dtype=jnp.int32)[None, :, None]
    reach = (first[:, None, :] <= t) & (t < (first + count)[:, None, :])  # [B, T, C]
    chunks = reach.shape[-1]
    lo = jnp.argmax(reach, axis=-1).astype(jnp.int32)
    hi = chunks - jnp.argmax(reach[..., ::-1], axis=-1).astype(jnp.int32)
    any_reach = reach.any(-1)
    return jnp.where(any_reach, lo, 0).reshape(-1), jnp.where(any_reach, hi - lo, 0).reshape(-1)


def _clamped(first_ref, count_ref, entry, step):
    return first_ref[entry] + jnp.minimum(step, jnp.maximum(count_ref[entry] - 1, 0))


def _cost(q, kc, own_keys, *, context_matmuls, own_matmuls, reread):
    """CostEstimate of one call: its FLOPs by `cost.block_walk_flops` (`own_keys` = CHUNK·L); each
    visit copies in `reread` bytes, besides the operands and results read or written once."""
    b, kv, chunks, rows, _ = q.shape
    tile = _tile(kc.shape[2])
    tiles = kc.shape[2] // tile
    visits = b * kv * cost.expected_visits(chunks, tiles)
    flops = cost.block_walk_flops(
        q.shape, tile, tiles, own_keys, context_matmuls=context_matmuls, own_matmuls=own_matmuls
    )
    operands = 2 * (q.size * q.dtype.itemsize + kc.size * kc.dtype.itemsize)  # q and k, v and o or gradients
    return pl.CostEstimate(
        flops=flops,
        transcendentals=rows * (visits * tile + b * kv * chunks * own_keys),
        bytes_accessed=operands + visits * reread,
    )


def _walk_call(kernel, operands, *, q, walk, spans, grid, in_specs, out_specs, scratch_shapes, out_shape,
               cost_estimate, name, **static):  # fmt: skip
    """What the three calls share: `kernel` (with q's softmax scale, its query rows a block and
    `static`) over `grid` on `operands`, after the four it prefetches into scalar memory: `walk`,
    each walk's first step (a tile or a chunk) and count of steps [B·C or B·T], and `spans`, the
    blocks' (start, end) [B, Np]. The grid's last axis walks the steps, accumulating in scratch."""
    _, _, _, rows, h = q.shape
    prefetched = (*walk, *(x.reshape(-1) for x in spans))
    return pl.pallas_call(
        functools.partial(kernel, scale=h**-0.5, rows_per_block=rows // CHUNK, **static),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(prefetched),
            grid=grid,
            in_specs=in_specs,
            out_specs=out_specs,
            scratch_shapes=scratch_shapes,
        ),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        cost_estimate=cost_estimate,
        interpret=target_backend() != "tpu",
        name=name,
    )(*prefetched, *operands)


def _per_chunk(x):
    return pl.BlockSpec((None, None, None, *x.shape[3:]), lambda b, k, c, j, *_: (b, k, c, 0, 0))


def _chunk_walk(q, kc, start, end):
    """What the forward and dq calls share: (tile, the grid (b, k, chunk, step), the `walk` of
    `_walk_call`, the BlockSpec of the context tile each grid step reads)."""
    b, kv, chunks, _, h = q.shape
    tile = _tile(kc.shape[2])
    first, count = _chunk_tiles(start, end, tile)

    def context_tile(b, k, c, j, first_ref, count_ref, *_):
        return b, k, _clamped(first_ref, count_ref, b * chunks + c, j), 0

    grid = (b, kv, chunks, kc.shape[2] // tile)
    return tile, grid, (first, count), pl.BlockSpec((None, None, tile, h), context_tile)


def _forward_call(q, kc, vc, kb, vb, start, end, block_len):
    b, kv, chunks, rows, h = q.shape
    tile, grid, walk, ctx = _chunk_walk(q, kc, start, end)
    lse_shape = jax.ShapeDtypeStruct((b, kv, chunks, 1, rows), jnp.float32)
    return _walk_call(
        _forward_kernel,
        (q, kc, vc, kb, vb),
        q=q,
        walk=walk,
        spans=(start, end),
        grid=grid,
        in_specs=[_per_chunk(q), ctx, ctx, _per_chunk(kb), _per_chunk(vb)],
        out_specs=[_per_chunk(q), _per_chunk(lse_shape)],
        scratch_shapes=[
            pltpu.VMEM((rows, LANES), jnp.float32),
            pltpu.VMEM((rows, LANES), jnp.float32),
            pltpu.VMEM((rows, h), jnp.float32),
        ],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), lse_shape],
        cost_estimate=_cost(
            q, kc, kb.shape[3], context_matmuls=2, own_matmuls=2, reread=2 * tile * h * kc.dtype.itemsize
        ),
        name="dflash_block_attention_fwd_tpu",
        block_len=block_len,
        tile=tile,
    )


def _dq_call(q, kc, vc, kb, vb, start, end, do, lse, delta, block_len):
    rows, h = q.shape[3:]
    tile, grid, walk, ctx = _chunk_walk(q, kc, start, end)
    return _walk_call(
        _dq_kernel,
        (q, kc, vc, kb, vb, do, lse, delta),
        q=q,
        walk=walk,
        spans=(start, end),
        grid=grid,
        in_specs=[_per_chunk(q), ctx, ctx, *map(_per_chunk, (kb, vb, do, lse, delta))],
        out_specs=[_per_chunk(q), _per_chunk(kb), _per_chunk(vb)],
        scratch_shapes=[pltpu.VMEM((rows, h), jnp.float32)],
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, kb, vb)],
        cost_estimate=_cost(
            q, kc, kb.shape[3], context_matmuls=3, own_matmuls=5, reread=2 * tile * h * kc.dtype.itemsize
        ),
        name="dflash_block_attention_dq_tpu",
        block_len=block_len,
        tile=tile,
    )


def _dkv_context_call(q, do, lse, delta, start, end, kc, vc):
    b, kv, chunks, rows, h = q.shape
    tile, tiles = _tile(kc.shape[2]), kc.shape[2] // _tile(kc.shape[2])
    chunk_first, chunk_count = _chunk_tiles(start, end, tile)
    first, count = _tile_chunks(chunk_first.reshape(b, chunks), chunk_count.reshape(b, chunks), tiles)

    def chunk_of_tile(b_, k, t, i, first_ref, count_ref, *_):
        return b_, k, _clamped(first_ref, count_ref, b_ * tiles + t, i), 0, 0

    per_chunk = [pl.BlockSpec((None, None, None, *x.shape[3:]), chunk_of_tile) for x in (q, do, lse, delta)]
    key_tile = pl.BlockSpec((None, None, tile, h), lambda b_, k, t, i, *_: (b_, k, t, 0))
    return _walk_call(
        _dkv_context_kernel,
        (kc, vc, q, do, lse, delta),
        q=q,
        walk=(first, count),
        spans=(start, end),
        grid=(b, kv, tiles, chunks),
        in_specs=[key_tile, key_tile, *per_chunk],
        out_specs=[key_tile, key_tile],
        scratch_shapes=[pltpu.VMEM((tile, h), jnp.float32), pltpu.VMEM((tile, h), jnp.float32)],
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (kc, vc)],
        cost_estimate=_cost(q, kc, 0, context_matmuls=4, own_matmuls=0, reread=2 * rows * (h * q.dtype.itemsize + 4)),
        name="dflash_block_attention_dkv_tpu",
        tile=tile,
        chunks=chunks,
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _fused(q, kc, vc, kb, vb, start, end, block_len):
    return _forward_call(q, kc, vc, kb, vb, start, end, block_len)[0]


def _fused_fwd(q, kc, vc, kb, vb, start, end, block_len):
    o, lse = _forward_call(q, kc, vc, kb, vb, start, end, block_len)
    return o, (q, kc, vc, kb, vb, start, end, o, lse)


def _fused_bwd(block_len, residuals, do):
    q, kc, vc, kb, vb, start, end, o, lse = residuals
    delta = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)[:, :, :, None, :]
    dq, dkb, dvb = _dq_call(q, kc, vc, kb, vb, start, end, do, lse, delta, block_len)
    dkc, dvc = _dkv_context_call(q, do, lse, delta, start, end, kc, vc)
    return dq, dkc, dvc, dkb, dvb, None, None


_fused.defvjp(_fused_fwd, _fused_bwd)


@jax.custom_vjp
def _permute_blocks(x, order, inverse):
    """x[b, order[b]] along axis 1; its gradient gathers back with `inverse` (not a scatter)."""
    return _take_blocks(x, order)


def _take_blocks(x, order):
    return jnp.take_along_axis(x, order.reshape(*order.shape, *([1] * (x.ndim - 2))), axis=1)


def _permute_fwd(x, order, inverse):
    return _take_blocks(x, order), (order, inverse)


def _permute_bwd(residuals, g):
    order, inverse = residuals
    return _take_blocks(g, inverse), None, None


_permute_blocks.defvjp(_permute_fwd, _permute_bwd)


def block_attention_in_spans(
    q: jax.Array,
    k_ctx: jax.Array,
    v_ctx: jax.Array,
    k_blk: jax.Array,
    v_blk: jax.Array,
    start: jax.Array,
    end: jax.Array,
) -> jax.Array:
    """Shapes as `block_attention.block_attention`: q [B, N, L, K*G, H]; k_ctx, v_ctx [B, S, K, H];
    k_blk, v_blk [B, N, L, K, H]; block n's context span [start, end) [B, N] -> [B, N, L, K*G, H].

    Differentiable in q and every key/value (custom VJP with the kernels above).
    """
    b, n, block_len, heads, h = q.shape
    s, kv = k_ctx.shape[1], k_ctx.shape[2]
    group = heads // kv
    padded_n = -(-n // CHUNK) * CHUNK
    chunks = padded_n // CHUNK
    tile = _tile(s)
    padded_s = -(-s // tile) * tile

    order = jnp.argsort(end, axis=1, stable=True).astype(jnp.int32)
    inverse = jnp.argsort(order, axis=1).astype(jnp.int32)

    def blocks(x):  # [B, N, ...] in end order, N padded with blocks that see no context
        x = _permute_blocks(x, order, inverse)
        return jnp.pad(x, [(0, 0), (0, padded_n - n)] + [(0, 0)] * (x.ndim - 2))

    start, end = blocks(start), blocks(end)
    # q [B, Np, L, K*G, H] -> [B, K, C, CHUNK·G·L, H]; own keys [B, Np, L, K, H] -> [B, K, C, CHUNK·L, H]
    qk = blocks(q).reshape(b, chunks, CHUNK, block_len, kv, group, h).transpose(0, 4, 1, 2, 5, 3, 6)
    qk = qk.reshape(b, kv, chunks, CHUNK * group * block_len, h)

    def own_block(x):
        x = blocks(x).reshape(b, chunks, CHUNK, block_len, kv, h).transpose(0, 4, 1, 2, 3, 5)
        return x.reshape(b, kv, chunks, CHUNK * block_len, h)

    def context(x):  # [B, S, K, H] -> [B, K, Sp, H]
        return jnp.pad(x, ((0, 0), (0, padded_s - s), (0, 0), (0, 0))).transpose(0, 2, 1, 3)

    out = _fused(qk, context(k_ctx), context(v_ctx), own_block(k_blk), own_block(v_blk), start, end, block_len)
    out = out.reshape(b, kv, chunks, CHUNK, group, block_len, h).transpose(0, 2, 3, 5, 1, 4, 6)
    out = out.reshape(b, padded_n, block_len, heads, h)[:, :n]
    return _permute_blocks(out, inverse, order)
