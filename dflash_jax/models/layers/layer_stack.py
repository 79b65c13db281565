"""Layers run under a scan over stacked weights (docs/design.md §8, "Scanned layers").

A model's layers are cut into segments by their kinds (`segments`): the longest run of whole
periods of a repeating pattern (hybrid linear/full attention 3:1, sliding/full alternation, MoE
layers after dense ones) is one segment whose layers run under one `jax.lax.scan`, the body one
period; what the run leaves on either side is cut the same way, and a layer no run covers runs
alone. A scanned segment's weights are stacked: `period` modules whose parameters carry a leading
axis of `repeats` (the logical axis `layers`, never split), layer `segment.layer(g, j)` at slot g
of module j. Program size and compile time then grow with the period, not with the depth.

The frozen target stores its scanned layers stacked (`LayerStack`, filled at load one layer at a
time); the drafter keeps one module per layer (its checkpoints, optimizer and export stay per
layer) and stacks its few layers' weights inside the step (`stack_modules`).
Shape letters: docs/design.md §9.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Hashable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from dflash_jax.models.sharding import is_stacked

# What a rematerialized layer keeps for the backward pass (jax.checkpoint_policies): 'full' keeps
# nothing and recomputes the layer; 'dots_saveable' keeps every matmul's output;
# 'dots_with_no_batch_dims_saveable' the weight matmuls' (not attention's batched ones).
REMAT_POLICIES: dict[str, Callable] = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


@dataclasses.dataclass(frozen=True)
class Segment:
    """Layers start .. stop-1: `repeats` periods of `period` layers (repeats 1: one layer alone)."""

    start: int
    period: int = 1
    repeats: int = 1

    @property
    def stop(self) -> int:
        return self.start + self.period * self.repeats

    @property
    def scanned(self) -> bool:
        return self.repeats > 1

    def layer(self, step: int, position: int) -> int:
        """The layer at `position` of period `step`."""
        return self.start + step * self.period + position


def segments(kinds: Sequence[Hashable], *, scan: bool = True) -> tuple[Segment, ...]:
    """Layers of these kinds (equal kinds: equal modules) -> segments covering them in order.
    scan=False: every layer alone."""
    if not scan:
        return tuple(Segment(i) for i in range(len(kinds)))
    return _cover(tuple(kinds), 0, len(kinds))


def _cover(kinds: tuple, lo: int, hi: int) -> tuple[Segment, ...]:
    run = _longest_run(kinds, lo, hi)
    if run is None:
        return tuple(Segment(i) for i in range(lo, hi))
    return _cover(kinds, lo, run.start) + (run,) + _cover(kinds, run.stop, hi)


def _longest_run(kinds: tuple, lo: int, hi: int) -> Segment | None:
    """The run of at least two whole periods in layers lo .. hi-1 that covers the most layers;
    among equals the shortest period (the smallest program), then the earliest."""
    best = None
    for period in range(1, (hi - lo) // 2 + 1):
        for start in range(lo, hi - 2 * period + 1):
            length = period
            while start + length < hi and kinds[start + length] == kinds[start + length - period]:
                length += 1
            repeats = length // period
            if repeats >= 2 and (best is None or repeats * period > best.repeats * best.period):
                best = Segment(start, period, repeats)
    return best


def _stacked_module(make: Callable[[nnx.Rngs], nnx.Module], repeats: int, rngs: nnx.Rngs) -> nnx.Module:
    """`make(rngs)` built `repeats` times at once (its own random draws each): one module whose
    parameters carry a leading axis of `repeats`."""

    @nnx.split_rngs(splits=repeats)
    @nnx.vmap(in_axes=(0,), out_axes=0, axis_size=repeats)
    def build(rngs):
        return make(rngs)

    return build(rngs)


class LayerStack(nnx.Module):
    """The layers of a scanned segment, stacked: `stacked[j]` holds position j of every period,
    its parameters [repeats, ...]. `make(layer, rngs)` builds layer `layer` alone; layers at the
    same position are of one kind, so the first of each position stands for the others."""

    def __init__(self, segment: Segment, make: Callable[[int, nnx.Rngs], nnx.Module], *, rngs: nnx.Rngs):
        self.segment = segment
        self.stacked = nnx.List(
            [
                _stacked_module(lambda r, j=j: make(segment.start + j, r), segment.repeats, rngs)
                for j in range(segment.period)
            ]
        )

    def split(self) -> Stacked:
        graphdefs, states = zip(*(nnx.split(module) for module in self.stacked))
        return Stacked(self.segment, graphdefs, states)


@dataclasses.dataclass(frozen=True)
class Stacked:
    """What a scan runs: a segment's graph per position and its stacked weights [repeats, ...]."""

    segment: Segment
    graphdefs: tuple[nnx.GraphDef, ...]
    states: tuple[nnx.State, ...]

    def layer(self, step, position: int) -> nnx.Module:
        """The module of layer `segment.layer(step, position)` (its weights sliced out)."""
        return nnx.merge(self.graphdefs[position], jax.tree.map(lambda w: w[step], self.states[position]))


def stack_modules(modules: Sequence[nnx.Module], segment: Segment) -> Stacked:
    """The segment's layers, one module each (the drafter's), stacked in the forward pass."""
    graphdefs, states = [], []
    for j in range(segment.period):
        parts = [nnx.split(modules[segment.layer(g, j)]) for g in range(segment.repeats)]
        graphdefs.append(parts[0][0])
        states.append(jax.tree.map(lambda *w: jnp.stack(w), *(state for _, state in parts)))
    return Stacked(segment, tuple(graphdefs), tuple(states))


def layer_modules(units: Sequence[nnx.Module | Stacked]) -> Iterator[nnx.Module]:
    """Every layer's module in order (scanned ones sliced out of their stacks): decoding runs its
    layers one by one, each with its own cache slice."""
    for unit in units:
        if isinstance(unit, Stacked):
            for g in range(unit.segment.repeats):
                for j in range(unit.segment.period):
                    yield unit.layer(g, j)
        else:
            yield unit


def run_layers(
    x: jax.Array,
    units: Sequence[tuple[Segment, nnx.Module | Stacked]],
    inputs_of: Callable[[int], Any],
    *,
    last: int | None = None,
    keep: Collection[int] = (),
    remat_policy: str | None = None,
) -> tuple[jax.Array, dict[int, jax.Array]]:
    """x [..., D] through the layers up to `last` (default: all) -> (the last layer's output,
    {layer: its output} for the layers in `keep`).

    `units` pairs each segment with its module (a layer alone) or its `Stacked` weights; a layer
    runs as `module(x, inputs_of(layer))`, and inside a scan every layer of a position takes the
    inputs of its first one (same kind, same inputs). A scan keeps the outputs of `keep` in a
    buffer of their number, not one per step. `remat_policy` (`REMAT_POLICIES`; None: none)
    recomputes each layer alone, or each period of a scan, in the backward pass.
    """
    last = units[-1][0].stop - 1 if last is None else last
    policy = None if remat_policy is None else REMAT_POLICIES[remat_policy]
    kept: dict[int, jax.Array] = {}

    def run_one(module: nnx.Module, x: jax.Array, layer: int) -> jax.Array:
        if policy is None:
            return module(x, inputs_of(layer))
        graphdef, state = nnx.split(module)
        apply = lambda state, x: nnx.merge(graphdef, state)(x, inputs_of(layer))  # noqa: E731
        return jax.checkpoint(apply, policy=policy)(state, x)

    for segment, unit in units:
        if segment.start > last:
            break
        if not isinstance(unit, Stacked):
            x = run_one(unit, x, segment.start)
            if segment.start in keep:
                kept[segment.start] = x
            continue
        whole = min(segment.repeats, (last - segment.start + 1) // segment.period)
        if whole:
            x, scanned = _scan(x, unit, whole, inputs_of, keep, policy)
            kept.update(scanned)
        for j in range(segment.period if whole < segment.repeats else 0):  # a partial period, up to `last`
            layer = segment.layer(whole, j)
            if layer > last:
                break
            x = run_one(unit.layer(whole, j), x, layer)
            if layer in keep:
                kept[layer] = x
    return x, kept


def _scan(x, unit: Stacked, steps: int, inputs_of, keep, policy) -> tuple[jax.Array, dict[int, jax.Array]]:
    """The first `steps` periods of a stacked segment under one scan -> (x, {kept layer: output})."""
    segment = unit.segment
    kept_ids = [segment.layer(g, j) for g in range(steps) for j in range(segment.period) if segment.layer(g, j) in keep]
    # slots[g, j]: where the output of layer (g, j) goes in the buffer, -1 for nowhere
    slots = np.full((steps, segment.period), -1, np.int32)
    for n, layer in enumerate(kept_ids):
        slots[divmod(layer - segment.start, segment.period)] = n
    inputs = [inputs_of(segment.start + j) for j in range(segment.period)]

    def run_period(x, states) -> list[jax.Array]:
        outputs = []
        for j in range(segment.period):
            x = nnx.merge(unit.graphdefs[j], states[j])(x, inputs[j])
            outputs.append(x)
        return outputs

    if policy is not None:  # a period recomputed in the backward pass
        run_period = jax.checkpoint(run_period, policy=policy, prevent_cse=False)

    def body(carry, xs):
        x, buffer = carry
        step, step_slots = xs
        # The weights are indexed in place, not scanned over: a scan of fewer steps than the
        # stack holds would copy the slice it runs.
        states = jax.tree.map(lambda w: jax.lax.dynamic_index_in_dim(w, step, keepdims=False), unit.states)
        outputs = run_period(x, states)
        for j, output in enumerate(outputs):
            buffer = _record(buffer, output, step_slots[j])
        return (outputs[-1], buffer), None

    buffer = jnp.zeros((len(kept_ids), *x.shape), x.dtype)
    (x, buffer), _ = jax.lax.scan(body, (x, buffer), (jnp.arange(steps), jnp.asarray(slots)))
    return x, {layer: buffer[n] for n, layer in enumerate(kept_ids)}


def _record(buffer: jax.Array, x: jax.Array, slot: jax.Array) -> jax.Array:
    """buffer [n, ...] with x at `slot` when slot >= 0; unchanged otherwise (no-op for n = 0)."""
    if buffer.shape[0] == 0:
        return buffer
    index = jnp.maximum(slot, 0)
    current = jax.lax.dynamic_index_in_dim(buffer, index, keepdims=False)
    return jax.lax.dynamic_update_index_in_dim(buffer, jnp.where(slot >= 0, x, current), index, 0)


def moved(
    params: dict[tuple, jax.Array],
    paths_of: Callable[[tuple], list[tuple]],
    wanted: dict[tuple, Any],
    wanted_paths_of: Callable[[tuple], list[tuple]],
    placement: Callable[[Mesh, tuple, tuple[int, ...]], NamedSharding],
) -> dict[tuple, jax.Array]:
    """Weights of one layout -> those of another (`wanted`, abstract): each layout says by
    `paths_of` which layers' tensors a parameter holds (`Transformer.checkpoint_paths`). A stack is
    built from its layers, or cut into them, and the source buffers are freed at once, so the
    devices hold at most one stack twice; a layer alone in both moves as it is. `params` are
    consumed. On a mesh, every result lies where `placement(mesh, path, shape)` puts it."""
    where = {}  # a layer's tensor -> (the parameter holding it, its slot in a stack or None)
    for path in params:
        for slot, layer_path in enumerate(paths_of(path)):
            where[layer_path] = (path, slot if is_stacked(path) else None)
    placed = next(iter(params.values())).sharding
    mesh = placed.mesh if isinstance(placed, NamedSharding) else None

    def sharding_of(path):
        return None if mesh is None else placement(mesh, path, wanted[path].shape)

    out, cut = {}, {}
    for path in wanted:
        sources = [where[layer_path] for layer_path in wanted_paths_of(path)]
        if is_stacked(path):
            layers = [params[source] for source, _ in sources]
            out[path] = jax.jit(jnp.stack, out_shardings=sharding_of(path))(layers)
            _free(layers)
            continue
        ((source, slot),) = sources
        if slot is None:
            out[path] = params[source]
            continue
        if source not in cut:
            layer_sharding = sharding_of(path)  # every slot of the stack is a parameter of one shape
            cut[source] = jax.jit(tuple, out_shardings=layer_sharding)(params[source])
            _free([params[source]])
        out[path] = cut[source][slot]
    return out


def _free(arrays: list[jax.Array]) -> None:
    """Give the buffers back now (the runtime waits for the computations still reading them)."""
    for array in arrays:
        array.delete()
