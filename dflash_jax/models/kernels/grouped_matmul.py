"""The MoE's grouped matmul on GPUs as a Pallas (Triton) kernel, forward only (the experts are
the frozen target's).

XLA:GPU compiles `jax.lax.ragged_dot` as a dense product of every row with every group's matrix
(E times the work: a chunk of an expert-parallel device's pairs against all its experts). Here
one program computes a [ROWS, COLS] tile of the output: the rows are sorted by group, so a tile's
rows belong to a short run of groups (found beforehand with a search); the program multiplies
its rows by each of those groups' matrices in turn, the rows of other groups zeroed. The work
is the rows times K x N, plus a tile's rows again for each group boundary inside it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from dflash_jax.models.kernels import interpret_mode

ROWS, COLS, DEPTH = 64, 128, 64  # a program's output tile and the K slice it multiplies at a time
NAME = "dflash_grouped_matmul"  # in its op_name: the roofline counts it as a grouped matmul (training/planning/hlo.py)
_PARAMS = dict(num_warps=4, num_stages=2)


def _kernel(x_ref, w_ref, starts_ref, ends_ref, first_ref, last_ref, o_ref, *, depth_tiles):
    tile = pl.program_id(0)
    row = tile * ROWS + jnp.arange(ROWS)

    def group(g, acc):
        mine = (row >= starts_ref[g]) & (row < ends_ref[g])

        def slice_k(kk, acc):
            ks = pl.ds(kk * DEPTH, DEPTH)
            x = jnp.where(mine[:, None], x_ref[:, ks], 0)
            return acc + plgpu.dot(x, w_ref[g, ks, :])

        return lax.fori_loop(0, depth_tiles, slice_k, acc)

    acc = lax.fori_loop(first_ref[...], last_ref[...] + 1, group, jnp.zeros((ROWS, COLS), jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """x [R, K] sorted by group, w [E, K, N], group_sizes [E] (summing to R) -> [R, N]."""
    rows, depth = x.shape
    groups, _, cols = w.shape
    pad = lambda a, axis, m: jnp.pad(a, [(0, (-a.shape[axis]) % m if i == axis else 0) for i in range(a.ndim)])  # noqa: E731
    xp = pad(pad(x, 0, ROWS), 1, DEPTH)
    wp = pad(pad(w, 1, DEPTH), 2, COLS)
    ends = jnp.cumsum(group_sizes).astype(jnp.int32)
    starts = ends - group_sizes.astype(jnp.int32)
    tile_rows = jnp.arange(xp.shape[0] // ROWS, dtype=jnp.int32) * ROWS
    # The groups holding each tile's first and last real row (rows past R: the last group's).
    first = jnp.minimum(jnp.searchsorted(ends, tile_rows, side="right"), groups - 1).astype(jnp.int32)
    last_row = jnp.minimum(tile_rows + ROWS, rows) - 1
    last = jnp.minimum(jnp.searchsorted(ends, last_row, side="right"), groups - 1).astype(jnp.int32)
    last = jnp.maximum(last, first)
    whole = lambda a: pl.BlockSpec(a.shape, lambda t, n: (0,) * a.ndim)  # noqa: E731
    per_tile = pl.BlockSpec((None,), lambda t, n: (t,))
    out = pl.pallas_call(
        functools.partial(_kernel, depth_tiles=xp.shape[1] // DEPTH),
        grid=(xp.shape[0] // ROWS, wp.shape[2] // COLS),
        in_specs=[
            pl.BlockSpec((ROWS, xp.shape[1]), lambda t, n: (t, 0)),
            pl.BlockSpec((groups, wp.shape[1], COLS), lambda t, n: (0, 0, n)),
            whole(starts),
            whole(ends),
            per_tile,
            per_tile,
        ],
        out_specs=pl.BlockSpec((ROWS, COLS), lambda t, n: (t, n)),
        out_shape=jax.ShapeDtypeStruct((xp.shape[0], wp.shape[2]), x.dtype),
        compiler_params=plgpu.CompilerParams(**_PARAMS),
        interpret=interpret_mode(),
        name=NAME,
    )(xp, wp, starts, ends, first, last)
    return out[:rows, :cols]
