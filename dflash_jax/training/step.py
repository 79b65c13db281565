"""The jitted train step: frozen target forward, drafter forward/backward, optimizer update.

The drafter is split once into a static graph and a `TrainState` of plain arrays; the step is
one pure function jitted over the mesh with explicit shardings (batch rows over (data, fsdp);
master weights and optimizer state split ZeRO-style over every device; the frozen target and
the main activations placed by the logical-axis rules of `models/sharding.py`). Master weights
are fp32; the modules compute in their compute dtype (bf16 by default).

A step whose loss, gradient norm or new weights are not finite is skipped: the weights and
optimizer state stay as they were, `skipped_updates` and `nonfinite_streak` count it. The
state therefore never holds a non-finite weight, and neither does a checkpoint of it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dflash_jax.data.packing import FIELDS
from dflash_jax.models.drafter import DFlashDrafter
from dflash_jax.models.drafter_config import DrafterConfig
from dflash_jax.models.parameters import train_state_shardings
from dflash_jax.models.sharding import BATCH_MESH_AXES, activation_sharding
from dflash_jax.models.transformer import Transformer
from dflash_jax.training import objective, warm_start
from dflash_jax.training.loss import drafter_loss
from dflash_jax.training.mesh import batch_sharding
from dflash_jax.training.optim.optimizer import learning_rate_schedule, make_optimizer

if TYPE_CHECKING:
    from dflash_jax.training.config.run_config import TrainSetup


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32: batches consumed so far
    params: nnx.State  # drafter weights (fp32 master copy)
    opt_state: optax.OptState
    rng: jax.Array  # uint32 key data; step s samples anchors with fold_in(rng, s)
    skipped_updates: jax.Array  # int32: non-finite steps skipped so far
    nonfinite_streak: jax.Array  # int32: consecutive non-finite steps up to now


def _new_drafter(
    cfg: DrafterConfig, compute_dtype, seed: int, attention: str = "auto", scan_layers: bool = False
) -> DFlashDrafter:
    return DFlashDrafter(
        cfg,
        param_dtype=jnp.float32,
        compute_dtype=compute_dtype,
        attention=attention,
        scan_layers=scan_layers,
        rngs=nnx.Rngs(seed),
    )


def drafter_graph(
    cfg: DrafterConfig, compute_dtype, attention: str = "auto", scan_layers: bool = False
) -> nnx.GraphDef:
    """The drafter's static graph; `attention` is its training forward's attention code,
    `scan_layers` whether that forward scans its layers (the parameters are the same)."""
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: _new_drafter(cfg, compute_dtype, 0, attention, scan_layers)))
    return graphdef


def _state_initializer(
    cfg: DrafterConfig, tx, seed: int, compute_dtype, init_from_target_layer: int = -1
) -> Callable[..., TrainState]:
    """init(target_params) -> a fresh TrainState; the target's weights are read only to start from
    one of its layers (training/warm_start.py)."""

    def init(target_params=None) -> TrainState:
        _, params = nnx.split(_new_drafter(cfg, compute_dtype, seed))
        if init_from_target_layer >= 0:
            params = warm_start.from_target_layer(params, target_params, init_from_target_layer)
        zero = jnp.zeros((), jnp.int32)
        return TrainState(
            step=zero,
            params=params,
            opt_state=tx.init(params),
            rng=jax.random.key_data(jax.random.key(seed)),
            skipped_updates=zero,
            nonfinite_streak=zero,
        )

    return init


def abstract_train_state(
    cfg: DrafterConfig, tx: optax.GradientTransformation, *, seed: int, compute_dtype, mesh: Mesh
) -> TrainState:
    """ShapeDtypeStructs carrying their shardings: what a checkpoint is restored onto."""
    abstract = jax.eval_shape(_state_initializer(cfg, tx, seed, compute_dtype))
    shardings = train_state_shardings(mesh, abstract)
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)


def init_train_state(
    cfg: DrafterConfig,
    tx: optax.GradientTransformation,
    *,
    seed: int,
    compute_dtype,
    mesh: Mesh,
    target_params=None,
    init_from_target_layer: int = -1,
) -> TrainState:
    """A fresh drafter (normal(0.02) init, or target layer `init_from_target_layer`'s weights) and
    optimizer state, created already sharded."""
    abstract = abstract_train_state(cfg, tx, seed=seed, compute_dtype=compute_dtype, mesh=mesh)
    shardings = jax.tree.map(lambda a: a.sharding, abstract)
    init = _state_initializer(cfg, tx, seed, compute_dtype, init_from_target_layer)
    return jax.jit(init, out_shardings=shardings)(target_params if init_from_target_layer >= 0 else None)


def _split_micro_batches(batch: objective.Batch, num_micro: int, mesh: Mesh) -> tuple[objective.Batch, jax.Array]:
    """[R, S] -> ([num_micro, R/num_micro, S] each micro-batch spread over every device, the
    global row index of each micro-batch row [num_micro, R/num_micro]).

    Micro-batch m takes rows m, m + num_micro, …, so the rows each device holds split evenly.
    """
    spec = NamedSharding(mesh, PartitionSpec(None, BATCH_MESH_AXES))

    def split(x):
        x = x.reshape(x.shape[0] // num_micro, num_micro, *x.shape[1:]).swapaxes(0, 1)
        return jax.lax.with_sharding_constraint(x, spec)

    rows = batch["tokens"].shape[0]
    return {k: split(batch[k]) for k in FIELDS}, split(jnp.arange(rows))


def _all_finite(tree) -> jax.Array:
    return jnp.all(jnp.stack([jnp.isfinite(x).all() for x in jax.tree.leaves(tree)]))


def make_train_step(
    *,
    drafter_graphdef: nnx.GraphDef,
    target_graphdef: nnx.GraphDef,
    target_params: nnx.State,
    tx: optax.GradientTransformation,
    cfg: objective.ObjectiveConfig,
    grad_accum_steps: int,
    mesh: Mesh,
    state_sharding,
) -> Callable[[TrainState, nnx.State, objective.Batch], tuple[TrainState, dict]]:
    """Returns jitted `step(state, target_params, batch) -> (state, additive metrics)`.

    The attention code is the graphs' own (`Transformer(attention=...)`, `drafter_graph`).
    `batch` is a dict of global int32 [rows, seq_len] arrays sharded with `batch_sharding`.
    Micro-batches accumulate Σ w·CE, its gradient and the loss denominator `sums['weight']` (Σw for
    'dflash', the documents for 'dpace'); both are divided by the global denominator once
    (docs/design.md §3.3), and each row's anchors come from the row's own key, so 1 x 16 rows
    and 4 x 4 rows give the same update.
    """
    micro_step = _micro_batch_gradients(drafter_graphdef, cfg)

    def step(state: TrainState, target_params: nnx.State, batch: objective.Batch):
        target = nnx.merge(target_graphdef, target_params)
        grads, sums = _accumulated_gradients(micro_step, state, target, batch, grad_accum_steps, mesh)
        new_state, ok, grad_norm = _apply_if_finite(tx, state, grads, sums)
        return new_state, _step_metrics(sums, ok, grad_norm, batch["segment_ids"])

    def sharded_step(state: TrainState, target_params: nnx.State, batch: objective.Batch):
        with activation_sharding(mesh):  # activations placed by logical names while tracing
            return step(state, target_params, batch)

    target_sharding = jax.tree.map(lambda x: x.sharding, target_params)
    return jax.jit(
        sharded_step,
        in_shardings=(state_sharding, target_sharding, batch_sharding(mesh)),
        out_shardings=(state_sharding, None),
        donate_argnums=0,
    )


def _micro_batch_gradients(drafter_graphdef: nnx.GraphDef, cfg: objective.ObjectiveConfig) -> Callable:
    """`(params, target, micro-batch, row keys, step) -> (sums, gradient of Σ w·CE)`: the frozen
    target's inputs to the drafter, then the drafter's loss (at optimizer step `step`) and its
    gradient."""

    def loss_fn(params, target, features, block_embeds, positions, blocks, step):
        drafter = nnx.merge(drafter_graphdef, params)
        return drafter_loss(drafter, target.unembed, features, block_embeds, positions, blocks, cfg, step)

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def micro_step(params, target, micro, row_keys, step):
        features, block_embeds, blocks = objective.frozen_inputs(target, micro, row_keys, cfg)
        (_, sums), grads = grad_fn(params, target, features, block_embeds, micro["positions"], blocks, step)
        return sums, grads

    return micro_step


def _accumulated_gradients(micro_step, state: TrainState, target, batch, grad_accum_steps: int, mesh: Mesh):
    """Σ over micro-batches of the gradients and sums, the gradients divided by the global
    denominator. The denominator does not depend on the weights: d(Σ w·CE / n) = d(Σ w·CE) / n;
    nothing scored: 0."""
    step_key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)

    def accumulate(grads, xs):
        micro, row_ids = xs
        sums, micro_grads = micro_step(state.params, target, micro, objective.row_keys(step_key, row_ids), state.step)
        return jax.tree.map(jnp.add, grads, micro_grads), sums

    zeros = jax.tree.map(jnp.zeros_like, state.params)
    micro_batches, micro_row_ids = _split_micro_batches(batch, grad_accum_steps, mesh)
    grads, micro_sums = jax.lax.scan(accumulate, zeros, (micro_batches, micro_row_ids))
    sums = jax.tree.map(lambda x: x.sum(0), micro_sums)
    return jax.tree.map(lambda g: g / jnp.maximum(sums["weight"], 1e-9), grads), sums


def _apply_if_finite(tx, state: TrainState, grads, sums) -> tuple[TrainState, jax.Array, jax.Array]:
    """The optimizer's update, kept only when the loss, the gradient norm and the new weights
    are all finite -> (new state, whether it was kept, gradient norm)."""
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    grad_norm = optax.tree.norm(grads)
    ok = jnp.isfinite(sums["weighted_ce"]) & jnp.isfinite(grad_norm) & _all_finite(params)

    def keep_if_ok(new, old):
        return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)

    new_state = TrainState(
        step=state.step + 1,
        params=keep_if_ok(params, state.params),
        opt_state=keep_if_ok(opt_state, state.opt_state),
        rng=state.rng,
        skipped_updates=state.skipped_updates + (~ok).astype(jnp.int32),
        nonfinite_streak=jnp.where(ok, 0, state.nonfinite_streak + 1),
    )
    return new_state, ok, grad_norm


def _step_metrics(sums: dict, ok: jax.Array, grad_norm: jax.Array, segment_ids: jax.Array) -> dict:
    """The step's additive metrics; a skipped step contributes nothing but its count."""
    return {
        **{k: jnp.where(ok, v, 0.0) for k, v in sums.items()},
        "grad_norm_sum": jnp.where(ok, grad_norm, 0.0),
        "updates_applied": ok.astype(jnp.float32),
        "real_tokens": (segment_ids != 0).sum().astype(jnp.float32),
        "padded_tokens": jnp.float32(segment_ids.size),
    }


def new_target(setup: TrainSetup, *, seed: int = 0) -> Transformer:
    """A target of the run's architecture, dtype and attention code, with random weights (plans
    use its shapes, benchmarks its weights; a run loads the real ones with `hf.load_target`)."""
    return Transformer(
        setup.target,
        param_dtype=setup.target_dtype,
        compute_dtype=setup.target_dtype,
        attention=setup.run.attention,
        scan_layers=setup.run.scan_layers,
        rngs=nnx.Rngs(seed),
    )


@dataclasses.dataclass(frozen=True)
class TrainProgram:
    """A run's jitted train step and what goes with it, built by `build_train_step`."""

    step: Callable[[TrainState, nnx.State, objective.Batch], tuple[TrainState, dict]]
    tx: optax.GradientTransformation
    schedule: optax.Schedule
    drafter_graphdef: nnx.GraphDef
    abstract_state: TrainState  # ShapeDtypeStructs carrying the state's shardings
    init_state: Callable[[], TrainState]  # a fresh drafter and optimizer state, created sharded


def build_train_step(
    setup: TrainSetup, mesh: Mesh, target_graphdef: nnx.GraphDef, target_params, *, total_steps: int
) -> TrainProgram:
    """The one place a run's setup becomes its jitted step: the training loop, the plan and the
    benchmarks all call it. `target_params` are real or abstract (ShapeDtypeStructs with
    shardings); the attention code is the run's (`setup.run.attention`) for target and drafter."""
    tx = make_optimizer(setup.optimizer, total_steps, setup.drafter.kind_spec.adam_params)
    state_kw = dict(seed=setup.run.seed, compute_dtype=setup.compute_dtype, mesh=mesh)
    abstract = abstract_train_state(setup.drafter, tx, **state_kw)
    drafter_graphdef = drafter_graph(setup.drafter, setup.compute_dtype, setup.run.attention, setup.run.scan_layers)
    step = make_train_step(
        drafter_graphdef=drafter_graphdef,
        target_graphdef=target_graphdef,
        target_params=target_params,
        tx=tx,
        cfg=dataclasses.replace(setup.objective, total_steps=total_steps),
        grad_accum_steps=setup.run.grad_accum_steps,
        mesh=mesh,
        state_sharding=jax.tree.map(lambda x: x.sharding, abstract),
    )
    return TrainProgram(
        step=step,
        tx=tx,
        schedule=learning_rate_schedule(setup.optimizer, total_steps),
        drafter_graphdef=drafter_graphdef,
        abstract_state=abstract,
        init_state=lambda: init_train_state(
            setup.drafter,
            tx,
            target_params=warm_start.target_layer_params(
                nnx.merge(target_graphdef, target_params), setup.run.init_from_target_layer
            ),
            init_from_target_layer=setup.run.init_from_target_layer,
            **state_kw,
        ),
    )
