"""Muon whose Newton–Schulz iterations run on whole matrices under ZeRO (docs/design.md §3.5).

ZeRO splits every matrix of the trained state over every device (`models/parameters.py`). Run on a
split matrix, each of Newton–Schulz's 15 matmuls makes XLA gather it again. Here each matrix is
whole on one device instead, as distributed Muon implementations assign matrices round-robin:

1. each matrix is turned (transposed if need be, which moves no data) so that matrices of the same
   shape share one ZeRO split, and those are stacked into [k, m, n], padded with zero matrices to
   a multiple of the device count;
2. all-to-alls re-split the stack over k (one per mesh-axes group the matrices are split over):
   each device now holds k/N whole matrices;
3. each device orthogonalizes its own matrices;
4. all-to-alls split the stack back the ZeRO way, and each update is unstacked and turned back.

Per step each way moves a device's 1/N share of every matrix (fp32) once per mesh-axes group,
against 15 gathers of every whole matrix.

The update is optax.contrib.muon's: optax's Nesterov momentum and Frobenius normalization run
first (its `scale_by_muon` with zero Newton–Schulz steps: only the normalization), then the
iterations here with optax's coefficients, then the update-RMS scaling (Moonlight), decay and the
learning rate; the optimizer state is the same pytree as optax.contrib.muon's, so checkpoints
written by either restore into the other.
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from dflash_jax.models import parameters, sharding

# optax.contrib.muon's quintic coefficients (its 'standard' preset), five iterations.
NS_COEFFS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
MOMENTUM = 0.95
EPS = 1e-8


def newton_schulz(x: jax.Array) -> jax.Array:
    """The quintic Newton–Schulz iteration X <- aX + (bA + cA²)X, A = XXᵀ, on a Frobenius-normalized
    [m, n] matrix; on its transpose when m > n (the same result, smaller A)."""
    if x.shape[0] > x.shape[1]:
        return newton_schulz(x.T).T
    a, b, c = NS_COEFFS
    for _ in range(NS_STEPS):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x


def _canonical(x: jax.Array, spec: PartitionSpec) -> tuple[bool, tuple[int, int], PartitionSpec]:
    """(transpose?, shape, spec) of a matrix turned so that same-shaped matrices group: wide
    (m <= n), and a square one with its first axis split when only one is."""
    m, n = x.shape
    spec = tuple(spec) + (None,) * (2 - len(spec))
    turn = m > n or (m == n and spec[0] is None and spec[1] is not None)
    if turn:
        return True, (n, m), PartitionSpec(spec[1], spec[0])
    return False, (m, n), PartitionSpec(*spec)


def _moves(spec: PartitionSpec) -> list[PartitionSpec]:
    """The shardings a [k, m, n] stack of matrices split by `spec` passes through to be split over k
    alone: one mesh-axes group moved to k at a time (each an all-to-all; XLA replicates the
    stack when asked to move two at once)."""
    split = [sharding.spec_axes(spec[0]), sharding.spec_axes(spec[1])]
    over_k: tuple[str, ...] = ()
    layouts = [PartitionSpec(None, *spec)]
    for dim in (1, 0):
        if split[dim]:
            over_k, split[dim] = over_k + split[dim], ()
            layouts.append(PartitionSpec(over_k, *(s or None for s in split)))
    return layouts


def orthogonalize_whole(updates):
    """Newton–Schulz on every matrix of a (masked) update tree, each matrix whole on one device
    when traced inside `sharding.activation_sharding(mesh)` (the train step); plain otherwise."""
    mesh = sharding.active_mesh()
    leaves_with_paths, treedef = jax.tree_util.tree_flatten_with_path(updates)
    if mesh is None or mesh.devices.size == 1:
        return jax.tree.unflatten(treedef, [newton_schulz(x) for _, x in leaves_with_paths])
    groups: dict[tuple, list[tuple[int, bool]]] = defaultdict(list)
    for i, (path, x) in enumerate(leaves_with_paths):
        turn, shape, spec = _canonical(x, parameters.zero_spec(mesh, path, x.shape))
        groups[(shape, spec, x.dtype)].append((i, turn))
    out: list[jax.Array | None] = [None] * len(leaves_with_paths)
    for (shape, spec, dtype), members in groups.items():
        layouts = [NamedSharding(mesh, s) for s in _moves(spec)]
        owners = math.prod(mesh.shape[a] for a in sharding.spec_axes(spec[0]) + sharding.spec_axes(spec[1]))
        mats = [leaves_with_paths[i][1] for i, _ in members]
        mats = [m.T if turn else m for m, (_, turn) in zip(mats, members)]
        stack = jnp.stack(mats + [jnp.zeros(shape, dtype)] * (-len(mats) % owners))
        for layout in layouts:  # to whole matrices, k/owners on each device
            stack = jax.lax.with_sharding_constraint(stack, layout)
        stack = jax.vmap(newton_schulz)(stack)
        for layout in reversed(layouts):  # back to the ZeRO split
            stack = jax.lax.with_sharding_constraint(stack, layout)
        for j, (i, turn) in enumerate(members):
            out[i] = stack[j].T if turn else stack[j]
    return jax.tree.unflatten(treedef, out)


def _orthogonalize_and_scale(consistent_rms: float) -> optax.GradientTransformation:
    """Newton–Schulz on whole matrices, then each update scaled to RMS `consistent_rms`:
    ·sqrt(max(m, n))·rms (Moonlight, arXiv 2502.16982; optax's `consistent_rms`)."""

    def update(updates, state, params=None):
        del params
        updates = orthogonalize_whole(updates)
        return jax.tree.map(lambda u: u * (max(u.shape) ** 0.5 * consistent_rms), updates), state

    return optax.GradientTransformation(optax.init_empty_state, update)


def _matrices(updates):
    # Every leaf a plain matrix (rows reduced, columns out), masked leaves left as they are.
    return jax.tree.map(lambda _: optax.contrib.MuonDimensionNumbers(), updates)


def muon_labels(params, adam_params: tuple[str, ...] = ()):
    """'muon' for every 2-D leaf but those whose path holds one of `adam_params` (a drafter
    kind's token-indexed tables and projections onto the vocabulary, `Kind.adam_params`), 'adam'
    for the rest."""

    def label(path, x):
        name = jax.tree_util.keystr(path)
        return "muon" if x.ndim == 2 and not any(t in name for t in adam_params) else "adam"

    return jax.tree_util.tree_map_with_path(label, params)


def muon(
    learning_rate: optax.ScalarOrSchedule,
    *,
    consistent_rms: float,
    weight_decay: float,
    adam_b1: float,
    adam_b2: float,
    adam_params: tuple[str, ...] = (),
) -> optax.GradientTransformation:
    """optax.contrib.muon(learning_rate, consistent_rms=..., weight_decay=..., adam_b1=...,
    adam_b2=...) with its Newton–Schulz iterations on whole matrices: every 2-D leaf by Muon
    but those named in `adam_params` (`muon_labels`), the rest by AdamW (Nesterov, no decay)."""

    return optax.partition(
        {
            "muon": optax.chain(
                # Momentum and the Frobenius normalization only: the iterations are ours.
                optax.contrib.scale_by_muon(
                    NS_COEFFS, ns_steps=0, beta=MOMENTUM, eps=EPS, weight_dimension_numbers=_matrices
                ),
                _orthogonalize_and_scale(consistent_rms),
                optax.add_decayed_weights(weight_decay),
                optax.scale_by_learning_rate(learning_rate),
            ),
            "adam": optax.adamw(learning_rate, b1=adam_b1, b2=adam_b2, eps=EPS, weight_decay=0.0, nesterov=True),
        },
        functools.partial(muon_labels, adam_params=adam_params),
    )
