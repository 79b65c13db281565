"""The drafter's DFlash block attention (docs/design.md §3.2) as Pallas (Triton) kernels.

Block n of a row sees the context keys of its span [start_n, end_n) — its document's positions
before its anchor — and the L keys of its own block. Only those keys are visited:

* forward, one program per (row, block, kv head): the G query heads x L slots of the block
  ([G·L, H], one tile) walk the context tiles that overlap the span, then the block's own keys,
  with an online softmax in base 2; the log-sum-exp is kept for the backward pass.
* backward dq (and the block's own dk, dv), one program per (row, block, kv head): the same
  walk, recomputing the probabilities from the saved log-sum-exp (FlashAttention-2).
* backward context dk, dv, one program per (row, context tile, kv head): the blocks are sorted
  by span end, so the blocks whose span overlaps the tile are one contiguous range of that
  order (found beforehand with a search); the program walks only that range.

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

from dflash_jax.models.kernels import LOG2_E, MASKED, cost, interpret_mode, next_power_of_2

BLOCK_K = 64  # context keys per tile
_PARAMS = dict(num_warps=4, num_stages=2)


# ---------------------------------------------------------------------------------------------
# Kernels. Shapes inside a program: q, do, o [M, H] (M = G query heads x Lp slots, padded to a
# power of two); block keys [Lp, H] of which the first `block_len` are real; context tile
# [BLOCK_K, H]. Scores are in base 2: s = q·k * scale * log2(e).


def _span_tiles(start, end):
    return lax.div(start, BLOCK_K), lax.div(end + BLOCK_K - 1, BLOCK_K)


def _context_scores(q, kc_ref, j, start, end, scale):
    keys = pl.ds(j * BLOCK_K, BLOCK_K)
    k = kc_ref[keys, :]
    s = plgpu.dot(q, k.T) * (scale * LOG2_E)
    k_pos = j * BLOCK_K + jnp.arange(BLOCK_K)
    visible = (k_pos >= start) & (k_pos < end)
    return jnp.where(visible[None, :], s, MASKED), k, keys


def _block_scores(q, kb, block_len, scale):
    s = plgpu.dot(q, kb.T) * (scale * LOG2_E)
    return jnp.where((jnp.arange(kb.shape[0]) < block_len)[None, :], s, MASKED)


def _forward_kernel(q_ref, kc_ref, vc_ref, kb_ref, vb_ref, start_ref, end_ref, o_ref, lse_ref, *, scale, block_len):
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
        s, _, keys = _context_scores(q, kc_ref, j, start, end, scale)
        return update(carry, s, vc_ref[keys, :])

    rows, head_dim = q.shape
    carry = (
        jnp.zeros((rows, head_dim), jnp.float32),
        jnp.full((rows,), -jnp.inf, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )
    carry = lax.fori_loop(*_span_tiles(start, end), body, carry)
    acc, m, total = update(carry, _block_scores(q, kb_ref[...], block_len, scale), vb_ref[...])
    o_ref[...] = (acc / total[:, None]).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log2(total)


def _dq_kernel(
    q_ref, kc_ref, vc_ref, kb_ref, vb_ref, start_ref, end_ref, do_ref, lse_ref, delta_ref,
    dq_ref, dkb_ref, dvb_ref, *, scale, block_len,
):  # fmt: skip
    q, do = q_ref[...], do_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]
    start, end = start_ref[...], end_ref[...]

    def grads(s, v):  # -> (p, ds) for scores s against values v
        p = jnp.exp2(s - lse[:, None])
        dp = plgpu.dot(do, v.T)
        return p, p * (dp - delta[:, None])

    def body(j, dq):
        s, k, keys = _context_scores(q, kc_ref, j, start, end, scale)
        _, ds = grads(s, vc_ref[keys, :])
        return dq + plgpu.dot(ds.astype(k.dtype), k)

    dq = lax.fori_loop(*_span_tiles(start, end), body, jnp.zeros(q.shape, jnp.float32))
    kb, vb = kb_ref[...], vb_ref[...]
    p, ds = grads(_block_scores(q, kb, block_len, scale), vb)
    dq = dq + plgpu.dot(ds.astype(kb.dtype), kb)
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)
    dkb_ref[...] = (plgpu.dot(ds.astype(q.dtype).T, q) * scale).astype(dkb_ref.dtype)
    dvb_ref[...] = plgpu.dot(p.astype(do.dtype).T, do).astype(dvb_ref.dtype)


def _dkv_context_kernel(
    q_ref, do_ref, lse_ref, delta_ref, start_ref, end_ref, first_ref, last_ref, kc_ref, vc_ref,
    dk_ref, dv_ref, *, scale,
):  # fmt: skip
    tile = pl.program_id(1)
    k, v = kc_ref[...], vc_ref[...]
    k_pos = tile * BLOCK_K + jnp.arange(BLOCK_K)

    def body(n, carry):  # n: a block in span-end order
        dk, dv = carry
        q, do = q_ref[n], do_ref[n]
        visible = (k_pos >= start_ref[n]) & (k_pos < end_ref[n])
        s = plgpu.dot(q, k.T) * (scale * LOG2_E)
        p = jnp.where(visible[None, :], jnp.exp2(s - lse_ref[n][:, None]), 0.0)
        dp = plgpu.dot(do, v.T)
        ds = p * (dp - delta_ref[n][:, None])
        dv = dv + plgpu.dot(p.astype(do.dtype).T, do)
        dk = dk + plgpu.dot(ds.astype(q.dtype).T, q)
        return dk, dv

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = lax.fori_loop(first_ref[...], last_ref[...], body, (zeros, zeros))
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


# ---------------------------------------------------------------------------------------------
# pallas_calls on the kernel layout: q, o, do [B, K, N, M, H]; lse, delta [B, K, N, M];
# context keys/values [B, K, Sp, H] (Sp a multiple of BLOCK_K); block keys/values
# [B, K, N, Lp, H]; spans [B, N].


def _per_block(m, h):
    return pl.BlockSpec((None, None, None, m, h), lambda b, n, g: (b, g, n, 0, 0))


def _per_block_rows(m):
    return pl.BlockSpec((None, None, None, m), lambda b, n, g: (b, g, n, 0))


def _context(sp, h):
    return pl.BlockSpec((None, None, sp, h), lambda b, n, g: (b, g, 0, 0))


_SPAN = pl.BlockSpec((None, None), lambda b, n, g: (b, n))


def _operand_specs(q, kc, kb) -> list:
    """The specs of q, kc, vc, kb, vb, start, end: every kernel's first operands."""
    _, _, _, m, h = q.shape
    sp, lp = kc.shape[2], kb.shape[3]
    return [_per_block(m, h), _context(sp, h), _context(sp, h), _per_block(lp, h), _per_block(lp, h), _SPAN, _SPAN]


def _stated(q, kc, own_keys: int, *, context_matmuls: int, own_matmuls: int):
    """The FLOPs a call's walk is expected to compute (`cost.stating_flops`): per visited (block,
    context tile) pair `context_matmuls` [M, BLOCK_K] x H products, per block `own_matmuls`
    [M, own_keys] x H ones."""
    tiles = kc.shape[2] // BLOCK_K
    flops = cost.block_walk_flops(
        q.shape, BLOCK_K, tiles, own_keys, context_matmuls=context_matmuls, own_matmuls=own_matmuls
    )
    return cost.stating_flops(flops)


def _forward_call(q, kc, vc, kb, vb, start, end, block_len):
    b, kv, n, m, h = q.shape
    call = pl.pallas_call(
        functools.partial(_forward_kernel, scale=h**-0.5, block_len=block_len),
        grid=(b, n, kv),
        in_specs=_operand_specs(q, kc, kb),
        out_specs=[_per_block(m, h), _per_block_rows(m)],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, kv, n, m), jnp.float32)],
        compiler_params=plgpu.CompilerParams(**_PARAMS),
        interpret=interpret_mode(),
        name="dflash_block_attention_fwd",
    )
    with _stated(q, kc, kb.shape[3], context_matmuls=2, own_matmuls=2):  # scores, values
        return call(q, kc, vc, kb, vb, start, end)


def _dq_call(q, kc, vc, kb, vb, start, end, do, lse, delta, block_len):
    b, kv, n, m, h = q.shape
    lp = kb.shape[3]
    call = pl.pallas_call(
        functools.partial(_dq_kernel, scale=h**-0.5, block_len=block_len),
        grid=(b, n, kv),
        in_specs=[*_operand_specs(q, kc, kb), _per_block(m, h), _per_block_rows(m), _per_block_rows(m)],
        out_specs=[_per_block(m, h), _per_block(lp, h), _per_block(lp, h)],
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, kb, vb)],
        compiler_params=plgpu.CompilerParams(**_PARAMS),
        interpret=interpret_mode(),
        name="dflash_block_attention_dq",
    )
    with _stated(q, kc, kb.shape[3], context_matmuls=3, own_matmuls=5):  # scores, dp, dq (and own dk, dv)
        return call(q, kc, vc, kb, vb, start, end, do, lse, delta)


def _dkv_context_call(q, do, lse, delta, start, end, kc, vc):
    """Context dk, dv; q, do, lse, delta, start, end already in span-end order along N."""
    b, kv, n, m, h = q.shape
    sp = kc.shape[2]
    tiles = sp // BLOCK_K
    tile_start = jnp.arange(tiles, dtype=jnp.int32) * BLOCK_K
    # Blocks overlapping tile t: end > t·BK (a suffix in end order) and start < (t+1)·BK (up to
    # the last such block). Blocks in between that do not overlap are masked inside.
    first = jax.vmap(lambda e: jnp.searchsorted(e, tile_start, side="right"))(end).astype(jnp.int32)
    overlaps_before = start[:, None, :] < (tile_start + BLOCK_K)[None, :, None]  # [B, T, N]
    last = (n - jnp.argmax(overlaps_before[..., ::-1], axis=-1)).astype(jnp.int32)
    last = jnp.where(overlaps_before.any(-1), last, 0)
    last = jnp.maximum(last, first)
    all_blocks = pl.BlockSpec((None, None, n, m, h), lambda r, t, g: (r, g, 0, 0, 0))
    all_rows = pl.BlockSpec((None, None, n, m), lambda r, t, g: (r, g, 0, 0))
    spans = pl.BlockSpec((None, n), lambda r, t, g: (r, 0))
    per_tile = pl.BlockSpec((None, None), lambda r, t, g: (r, t))
    key_tile = pl.BlockSpec((None, None, BLOCK_K, h), lambda r, t, g: (r, g, t, 0))
    call = pl.pallas_call(
        functools.partial(_dkv_context_kernel, scale=h**-0.5),
        grid=(b, tiles, kv),
        in_specs=[all_blocks, all_blocks, all_rows, all_rows, spans, spans, per_tile, per_tile, key_tile, key_tile],
        out_specs=[key_tile, key_tile],
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (kc, vc)],
        compiler_params=plgpu.CompilerParams(**_PARAMS),
        interpret=interpret_mode(),
        name="dflash_block_attention_dkv",
    )
    with _stated(q, kc, 0, context_matmuls=4, own_matmuls=0):  # scores, dp, dk, dv
        return call(q, do, lse, delta, start, end, first, last, kc, vc)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _fused(q, kc, vc, kb, vb, start, end, block_len):
    return _forward_call(q, kc, vc, kb, vb, start, end, block_len)[0]


def _fused_fwd(q, kc, vc, kb, vb, start, end, block_len):
    o, lse = _forward_call(q, kc, vc, kb, vb, start, end, block_len)
    return o, (q, kc, vc, kb, vb, start, end, o, lse)


def _fused_bwd(block_len, residuals, do):
    q, kc, vc, kb, vb, start, end, o, lse = residuals
    delta = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)
    dq, dkb, dvb = _dq_call(q, kc, vc, kb, vb, start, end, do, lse, delta, block_len)
    order = jnp.argsort(end, axis=1, stable=True)  # [B, N]

    def by_end(x):  # sort axis 2 (blocks) of [B, K, N, ...] or axis 1 of [B, N]
        if x.ndim == 2:
            return jnp.take_along_axis(x, order, axis=1)
        index = order[:, None, :].reshape(order.shape[0], 1, -1, *([1] * (x.ndim - 3)))
        return jnp.take_along_axis(x, index, axis=2)

    dkc, dvc = _dkv_context_call(by_end(q), by_end(do), by_end(lse), by_end(delta), by_end(start), by_end(end), kc, vc)
    return dq, dkc, dvc, dkb, dvb, None, None


_fused.defvjp(_fused_fwd, _fused_bwd)


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
    lp = max(16, next_power_of_2(block_len))  # Triton dots need every side >= 16
    m = group * lp
    mp = next_power_of_2(m)
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

    out = _fused(qk, context(k_ctx), context(v_ctx), own_block(k_blk), own_block(v_blk), start, end, block_len)
    out = out[:, :, :, :m].reshape(b, kv, n, group, lp, h)[:, :, :, :, :block_len]
    return out.transpose(0, 2, 4, 1, 3, 5).reshape(q.shape)
