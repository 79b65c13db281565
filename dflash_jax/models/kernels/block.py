"""The drafter's DFlash block attention (docs/design.md §3.2) as Pallas (Triton) kernels.

Block n of a row sees the context keys of its span [start_n, end_n) — its document's positions
before its anchor — and the L keys of its own block. Only those keys are visited:

* forward, one program per (row, block, kv head, row tile): the G query heads x L slots of the
  block ([G·L, H], one tile) walk the context tiles that overlap the span, then the block's own
  keys, with an online softmax in base 2; the log-sum-exp is kept for the backward pass.
* backward dq (and the block's own dk, dv), one program per (row, block, kv head, row tile): the
  same walk, recomputing the probabilities from the saved log-sum-exp (FlashAttention-2).
* backward context dk, dv, one program per (row, context tile, kv head): the blocks are sorted
  by span end, so the blocks whose span overlaps the tile are one contiguous range of that
  order (found beforehand with a search); the program walks only that range.

Each kernel's tiles (query rows, context keys, pipeline stages) are the largest whose shared
memory fits the GPU's (`kernel_tiles`): a block's G·L rows in one program, 64 context keys a
step, 2 stages where they fit; for wide heads (Gemma 4's 512, Qwen3.5's 256 with G = 8) fewer
keys, or the rows split into tiles (the own block's dk, dv then summed over them).

No atomics: every gradient element is written by one program, so the backward is deterministic.
The visited work is the visible (query, key) pairs rounded up to tiles, about the span lengths,
instead of the whole row per block.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from dflash_jax.models import kernels
from dflash_jax.models.kernels import LOG2_E, MASKED, Tiles, cost, interpret_mode, next_power_of_2

BLOCK_K = 64  # context keys a tile at most: the context is padded to a multiple of it


# ---------------------------------------------------------------------------------------------
# Kernels. Shapes inside a program: q, do, o [R, H] (R = `tiles.rows` of the block's M = G query
# heads x Lp slots, padded to a power of two); block keys [Lp, H] of which the first `block_len`
# are real; context tile [T, H] (T = `tiles.keys`). Scores are in base 2: s = q·k * scale * log2(e).


def _span_tiles(start, end, keys):
    return lax.div(start, keys), lax.div(end + keys - 1, keys)


def _context_scores(q, kc_ref, j, start, end, scale, keys):
    span = pl.ds(j * keys, keys)
    k = kc_ref[span, :]
    s = plgpu.dot(q, k.T) * (scale * LOG2_E)
    k_pos = j * keys + jnp.arange(keys)
    visible = (k_pos >= start) & (k_pos < end)
    return jnp.where(visible[None, :], s, MASKED), k, span


def _block_scores(q, kb, block_len, scale):
    s = plgpu.dot(q, kb.T) * (scale * LOG2_E)
    return jnp.where((jnp.arange(kb.shape[0]) < block_len)[None, :], s, MASKED)


def _forward_kernel(
    q_ref, kc_ref, vc_ref, kb_ref, vb_ref, start_ref, end_ref, o_ref, lse_ref, *, scale, block_len, keys
):  # fmt: skip
    q = q_ref[...]
    start, end = start_ref[...], end_ref[...]

    def update(carry, s, v):
        acc, m, total = carry
        m_new = jnp.maximum(m, s.max(axis=-1))
        correction = jnp.exp2(m - m_new)
        p = jnp.exp2(s - m_new[:, None])
        acc = acc * correction[:, None] + plgpu.dot(p.astype(v.dtype), v)
        return acc, m_new, total * correction + p.sum(axis=-1)

    def body(j, carry):
        s, _, span = _context_scores(q, kc_ref, j, start, end, scale, keys)
        return update(carry, s, vc_ref[span, :])

    rows, head_dim = q.shape
    carry = (
        jnp.zeros((rows, head_dim), jnp.float32),
        jnp.full((rows,), -jnp.inf, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )
    carry = lax.fori_loop(*_span_tiles(start, end, keys), body, carry)
    acc, m, total = update(carry, _block_scores(q, kb_ref[...], block_len, scale), vb_ref[...])
    o_ref[...] = (acc / total[:, None]).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log2(total)


def _dq_kernel(
    q_ref, kc_ref, vc_ref, kb_ref, vb_ref, start_ref, end_ref, do_ref, lse_ref, delta_ref,
    dq_ref, dkb_ref, dvb_ref, *, scale, block_len, keys,
):  # fmt: skip
    q, do = q_ref[...], do_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]
    start, end = start_ref[...], end_ref[...]

    def grads(s, v):  # -> (p, ds) for scores s against values v
        p = jnp.exp2(s - lse[:, None])
        dp = plgpu.dot(do, v.T)
        return p, p * (dp - delta[:, None])

    def body(j, dq):
        s, k, span = _context_scores(q, kc_ref, j, start, end, scale, keys)
        _, ds = grads(s, vc_ref[span, :])
        return dq + plgpu.dot(ds.astype(k.dtype), k)

    dq = lax.fori_loop(*_span_tiles(start, end, keys), body, jnp.zeros(q.shape, jnp.float32))
    kb, vb = kb_ref[...], vb_ref[...]
    p, ds = grads(_block_scores(q, kb, block_len, scale), vb)
    dq = dq + plgpu.dot(ds.astype(kb.dtype), kb)
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)
    # This program's rows' share of the own block's dk, dv (summed over the row tiles outside).
    dkb_ref[...] = (plgpu.dot(ds.astype(q.dtype).T, q) * scale).astype(dkb_ref.dtype)
    dvb_ref[...] = plgpu.dot(p.astype(do.dtype).T, do).astype(dvb_ref.dtype)


def _dkv_context_kernel(
    q_ref, do_ref, lse_ref, delta_ref, start_ref, end_ref, first_ref, last_ref, kc_ref, vc_ref,
    dk_ref, dv_ref, *, scale, keys, rows, row_tiles,
):  # fmt: skip
    tile = pl.program_id(1)
    k, v = kc_ref[...], vc_ref[...]
    k_pos = tile * keys + jnp.arange(keys)

    def body(i, carry):  # i: (a block in span-end order) x row_tiles + (its row tile)
        dk, dv = carry
        n, part = lax.div(i, row_tiles), lax.rem(i, row_tiles)
        own_rows = pl.ds(part * rows, rows)
        q, do = q_ref[n, own_rows, :], do_ref[n, own_rows, :]
        visible = (k_pos >= start_ref[n]) & (k_pos < end_ref[n])
        s = plgpu.dot(q, k.T) * (scale * LOG2_E)
        p = jnp.where(visible[None, :], jnp.exp2(s - lse_ref[n, own_rows][:, None]), 0.0)
        dp = plgpu.dot(do, v.T)
        ds = p * (dp - delta_ref[n, own_rows][:, None])
        dv = dv + plgpu.dot(p.astype(do.dtype).T, do)
        dk = dk + plgpu.dot(ds.astype(q.dtype).T, q)
        return dk, dv

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = lax.fori_loop(first_ref[...] * row_tiles, last_ref[...] * row_tiles, body, (zeros, zeros))
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


# ---------------------------------------------------------------------------------------------
# What each kernel asks of shared memory, as Triton (num_warps=4) allocates it on a Hopper GPU (its
# figures for the tiles below at head widths 64 to 512: tests/training/test_kernel_fit.py). A
# matmul's rows pick its instructions (`kernels.uses_warpgroup_matmuls`); an operand two kinds
# of matmul read is kept in shared memory in each one's layout.


def _forward_shared_memory(tiles: Tiles, head_dim: int, itemsize: int) -> int:
    """The walk of `kernels.walk_shared_memory`; the own block's keys reuse the context tiles' space."""
    return kernels.walk_shared_memory(tiles, head_dim, itemsize)


def _dq_shared_memory(tiles: Tiles, head_dim: int, itemsize: int) -> int:
    """q and do [R, H] for the whole walk (twice from R = 64: the walk's warpgroup matmuls and the
    own block's [Lp, R] x [R, H] ones after it read them in different layouts), the walk's k and v
    tiles (`kernels.loop_buffers`) and, under mma.sync, ds [R, T] on its way to dq's matmul. Exact
    when pipelined; unpipelined under mma.sync Triton reuses some of it (up to a fifth less)."""
    rows = tiles.rows * head_dim * itemsize
    keys = tiles.keys * head_dim * itemsize
    wide = kernels.uses_warpgroup_matmuls(tiles.rows)
    scores = 0 if wide else tiles.rows * tiles.keys * itemsize
    return (2 if wide else 1) * 2 * rows + kernels.loop_buffers(tiles) * 2 * keys + scores


def _dkv_shared_memory(tiles: Tiles, head_dim: int, itemsize: int) -> int:
    """The key tile's k and v [T, H] for the whole walk; each step's q and do [R, H]. Two kinds of
    matmul read them: the scores' (R rows) and dk, dv's (T rows). Unpipelined, q and do are kept
    in both layouts where the kinds differ, and ds [T, R] converted where they do not; pipelined,
    `stages` copies where both are warpgroup matmuls and one copy else, ds converted, and the next
    step's log-sum-exp and delta [R] (f32) in flight with 20 bytes more (its span bounds, barriers)."""
    keys = 2 * tiles.keys * head_dim * itemsize
    rows = 2 * tiles.rows * head_dim * itemsize
    scores = tiles.rows * tiles.keys * itemsize
    kinds = {kernels.uses_warpgroup_matmuls(tiles.rows), kernels.uses_warpgroup_matmuls(tiles.keys)}
    if tiles.stages == 1:
        return keys + (2 * rows if len(kinds) == 2 else rows + scores)
    copies = tiles.stages if kinds == {True} else tiles.stages - 1
    in_flight = (tiles.stages - 1) * (2 * tiles.rows * 4 + 20)
    return keys + copies * rows + scores + in_flight


def kernel_tiles(rows: int, head_dim: int, itemsize: int) -> tuple[Tiles, Tiles, Tiles] | None:
    """The tiles of the forward, dq and context dk/dv kernels for blocks of `rows` query rows (M, a
    power of two) of `head_dim`: for each, the first of `kernels.candidates` (up to M rows and
    BLOCK_K keys) whose shared memory fits the GPU's; None if one of them has none."""
    options = kernels.candidates(rows, BLOCK_K)
    estimates = (_forward_shared_memory, _dq_shared_memory, _dkv_shared_memory)
    chosen = tuple(
        kernels.first_fitting(options, functools.partial(f, head_dim=head_dim, itemsize=itemsize)) for f in estimates
    )
    return None if None in chosen else chosen


# ---------------------------------------------------------------------------------------------
# pallas_calls on the kernel layout: q, o, do [B, K, N, M, H]; lse, delta [B, K, N, M];
# context keys/values [B, K, Sp, H] (Sp a multiple of BLOCK_K); block keys/values
# [B, K, N, Lp, H]; spans [B, N]. The forward and dq calls run a program per R of a block's M rows.


def _per_row_tile(r, h):
    return pl.BlockSpec((None, None, None, r, h), lambda b, n, g, i: (b, g, n, i, 0))


def _per_row_tile_rows(r):
    return pl.BlockSpec((None, None, None, r), lambda b, n, g, i: (b, g, n, i))


def _own_block(lp, h):
    return pl.BlockSpec((None, None, None, lp, h), lambda b, n, g, i: (b, g, n, 0, 0))


def _context(sp, h):
    return pl.BlockSpec((None, None, sp, h), lambda b, n, g, i: (b, g, 0, 0))


_SPAN = pl.BlockSpec((None, None), lambda b, n, g, i: (b, n))


def _operand_specs(q, kc, kb, rows) -> list:
    """The specs of q, kc, vc, kb, vb, start, end: the forward and dq kernels' first operands."""
    h = q.shape[4]
    sp, lp = kc.shape[2], kb.shape[3]
    return [
        _per_row_tile(rows, h),
        _context(sp, h),
        _context(sp, h),
        _own_block(lp, h),
        _own_block(lp, h),
        _SPAN,
        _SPAN,
    ]


def _params(tiles: Tiles):
    return plgpu.CompilerParams(num_warps=4, num_stages=tiles.stages)


def _stated(q, kc, keys: int, own_keys: int, *, context_matmuls: int, own_matmuls: int):
    """The FLOPs a call's walk is expected to compute (`cost.stating_flops`): per visited (block,
    context tile) pair `context_matmuls` [M, keys] x H products, per block `own_matmuls`
    [M, own_keys] x H ones."""
    tiles = kc.shape[2] // keys
    flops = cost.block_walk_flops(
        q.shape, keys, tiles, own_keys, context_matmuls=context_matmuls, own_matmuls=own_matmuls
    )
    return cost.stating_flops(flops)


def _forward_call(q, kc, vc, kb, vb, start, end, block_len, tiles):
    b, kv, n, m, h = q.shape
    call = pl.pallas_call(
        functools.partial(_forward_kernel, scale=h**-0.5, block_len=block_len, keys=tiles.keys),
        grid=(b, n, kv, m // tiles.rows),
        in_specs=_operand_specs(q, kc, kb, tiles.rows),
        out_specs=[_per_row_tile(tiles.rows, h), _per_row_tile_rows(tiles.rows)],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, kv, n, m), jnp.float32)],
        compiler_params=_params(tiles),
        interpret=interpret_mode(),
        name="dflash_block_attention_fwd",
    )
    with _stated(q, kc, tiles.keys, kb.shape[3], context_matmuls=2, own_matmuls=2):  # scores, values
        return call(q, kc, vc, kb, vb, start, end)


def _dq_call(q, kc, vc, kb, vb, start, end, do, lse, delta, block_len, tiles):
    b, kv, n, m, h = q.shape
    lp = kb.shape[3]
    row_tiles = m // tiles.rows
    own_block_share = pl.BlockSpec((None, None, None, None, lp, h), lambda b, n, g, i: (b, g, n, i, 0, 0))
    # The row tiles' shares of the own block's dk, dv, in fp32 to be summed (in its dtype when one).
    shares = jax.ShapeDtypeStruct((b, kv, n, row_tiles, lp, h), kb.dtype if row_tiles == 1 else jnp.float32)
    call = pl.pallas_call(
        functools.partial(_dq_kernel, scale=h**-0.5, block_len=block_len, keys=tiles.keys),
        grid=(b, n, kv, row_tiles),
        in_specs=[
            *_operand_specs(q, kc, kb, tiles.rows),
            _per_row_tile(tiles.rows, h),
            _per_row_tile_rows(tiles.rows),
            _per_row_tile_rows(tiles.rows),
        ],
        out_specs=[_per_row_tile(tiles.rows, h), own_block_share, own_block_share],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), shares, shares],
        compiler_params=_params(tiles),
        interpret=interpret_mode(),
        name="dflash_block_attention_dq",
    )
    with _stated(q, kc, tiles.keys, lp, context_matmuls=3, own_matmuls=5):  # scores, dp, dq (and own dk, dv)
        dq, dkb, dvb = call(q, kc, vc, kb, vb, start, end, do, lse, delta)
    return dq, dkb.sum(3).astype(kb.dtype), dvb.sum(3).astype(vb.dtype)


def _dkv_context_call(q, do, lse, delta, start, end, kc, vc, tiles):
    """Context dk, dv; q, do, lse, delta, start, end already in span-end order along N."""
    b, kv, n, m, h = q.shape
    keys = tiles.keys
    sp = kc.shape[2]
    key_tiles = sp // keys
    tile_start = jnp.arange(key_tiles, dtype=jnp.int32) * keys
    # Blocks overlapping tile t: end > t·T (a suffix in end order) and start < (t+1)·T (up to
    # the last such block). Blocks in between that do not overlap are masked inside.
    first = jax.vmap(lambda e: jnp.searchsorted(e, tile_start, side="right"))(end).astype(jnp.int32)
    overlaps_before = start[:, None, :] < (tile_start + keys)[None, :, None]  # [B, T, N]
    last = (n - jnp.argmax(overlaps_before[..., ::-1], axis=-1)).astype(jnp.int32)
    last = jnp.where(overlaps_before.any(-1), last, 0)
    last = jnp.maximum(last, first)
    all_blocks = pl.BlockSpec((None, None, n, m, h), lambda r, t, g: (r, g, 0, 0, 0))
    all_rows = pl.BlockSpec((None, None, n, m), lambda r, t, g: (r, g, 0, 0))
    spans = pl.BlockSpec((None, n), lambda r, t, g: (r, 0))
    per_tile = pl.BlockSpec((None, None), lambda r, t, g: (r, t))
    key_tile = pl.BlockSpec((None, None, keys, h), lambda r, t, g: (r, g, t, 0))
    call = pl.pallas_call(
        functools.partial(_dkv_context_kernel, scale=h**-0.5, keys=keys, rows=tiles.rows, row_tiles=m // tiles.rows),
        grid=(b, key_tiles, kv),
        in_specs=[all_blocks, all_blocks, all_rows, all_rows, spans, spans, per_tile, per_tile, key_tile, key_tile],
        out_specs=[key_tile, key_tile],
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (kc, vc)],
        compiler_params=_params(tiles),
        interpret=interpret_mode(),
        name="dflash_block_attention_dkv",
    )
    with _stated(q, kc, keys, 0, context_matmuls=4, own_matmuls=0):  # scores, dp, dk, dv
        return call(q, do, lse, delta, start, end, first, last, kc, vc)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _fused(q, kc, vc, kb, vb, start, end, block_len, tiles):
    return _forward_call(q, kc, vc, kb, vb, start, end, block_len, tiles[0])[0]


def _fused_fwd(q, kc, vc, kb, vb, start, end, block_len, tiles):
    o, lse = _forward_call(q, kc, vc, kb, vb, start, end, block_len, tiles[0])
    return o, (q, kc, vc, kb, vb, start, end, o, lse)


def _fused_bwd(block_len, tiles, residuals, do):
    q, kc, vc, kb, vb, start, end, o, lse = residuals
    delta = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)
    dq, dkb, dvb = _dq_call(q, kc, vc, kb, vb, start, end, do, lse, delta, block_len, tiles[1])
    order = jnp.argsort(end, axis=1, stable=True)  # [B, N]

    def by_end(x):  # sort axis 2 (blocks) of [B, K, N, ...] or axis 1 of [B, N]
        if x.ndim == 2:
            return jnp.take_along_axis(x, order, axis=1)
        index = order[:, None, :].reshape(order.shape[0], 1, -1, *([1] * (x.ndim - 3)))
        return jnp.take_along_axis(x, index, axis=2)

    sorted_blocks = (by_end(x) for x in (q, do, lse, delta, start, end))
    dkc, dvc = _dkv_context_call(*sorted_blocks, kc, vc, tiles[2])
    return dq, dkc, dvc, dkb, dvb, None, None


_fused.defvjp(_fused_fwd, _fused_bwd)


def query_rows(group: int, block_len: int) -> int:
    """M, a block's query rows in the kernels: G heads x Lp slots (Lp: L padded to a power of two,
    at least 16, as Triton's dots need), padded to a power of two."""
    return next_power_of_2(group * max(16, next_power_of_2(block_len)))


def tiles_for(q: jax.Array, kv_heads: int) -> tuple[Tiles, Tiles, Tiles] | None:
    """`kernel_tiles` for q [B, N, L, K*G, H] over `kv_heads` K; None: the kernels cannot run it."""
    _, _, block_len, heads, h = q.shape
    return kernel_tiles(query_rows(heads // kv_heads, block_len), h, q.dtype.itemsize)


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
    The kernels' tiles must fit the GPU (`tiles_for` is not None: the caller checks).

    Differentiable in q and every key/value (custom VJP with the kernels above).
    """
    b, n, block_len, heads, h = q.shape
    s, kv = k_ctx.shape[1], k_ctx.shape[2]
    group = heads // kv
    lp = max(16, next_power_of_2(block_len))
    m = group * lp
    mp = query_rows(group, block_len)
    pad_s = (-s) % BLOCK_K

    # q [B, N, L, K*G, H] -> [B, K, N, G*Lp (+ zero rows up to Mp), H]
    qk = q.reshape(b, n, block_len, kv, group, h)
    qk = jnp.pad(qk, ((0, 0), (0, 0), (0, lp - block_len), (0, 0), (0, 0), (0, 0)))
    qk = qk.transpose(0, 3, 1, 4, 2, 5).reshape(b, kv, n, m, h)
    qk = jnp.pad(qk, ((0, 0), (0, 0), (0, 0), (0, mp - m), (0, 0)))

    def context(x):  # [B, S, K, H] -> [B, K, Sp, H]
        return jnp.pad(x, ((0, 0), (0, pad_s), (0, 0), (0, 0))).transpose(0, 2, 1, 3)

    def own_block(x):  # [B, N, L, K, H] -> [B, K, N, Lp, H]
        return jnp.pad(x, ((0, 0), (0, 0), (0, lp - block_len), (0, 0), (0, 0))).transpose(0, 3, 1, 2, 4)

    tiles = tiles_for(q, kv)
    out = _fused(qk, context(k_ctx), context(v_ctx), own_block(k_blk), own_block(v_blk), start, end, block_len, tiles)
    out = out[:, :, :, :m].reshape(b, kv, n, group, lp, h)[:, :, :, :, :block_len]
    return out.transpose(0, 2, 4, 1, 3, 5).reshape(q.shape)
