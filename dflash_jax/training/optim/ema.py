"""An exponential moving average of the drafter's weights, served in place of the last weights
(`train.ema_decay` > 0; docs/design.md §3.5).

The average lives in the optimizer state, so checkpoints, exact resume, ZeRO sharding and the
skip of non-finite steps carry it like any optimizer moment. Its rate ramps up as
min(decay, (1 + t) / (10 + t)) so that the first steps' weights, far from trained, fade fast.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax


class WeightAverage(NamedTuple):
    count: jax.Array  # int32: updates averaged so far
    params: optax.Params  # fp32, the drafter's structure


def with_weight_average(tx: optax.GradientTransformation, decay: float) -> optax.GradientTransformation:
    """`tx`, whose state also averages the weights its updates produce."""

    def init(params):
        return tx.init(params), WeightAverage(jnp.zeros((), jnp.int32), jax.tree.map(jnp.copy, params))

    def update(updates, state, params):
        inner, average = state
        updates, inner = tx.update(updates, inner, params)
        new_params = optax.apply_updates(params, updates)
        count = average.count + 1
        rate = jnp.minimum(decay, (1.0 + count) / (10.0 + count))
        averaged = jax.tree.map(lambda a, p: rate * a + (1.0 - rate) * p, average.params, new_params)
        return updates, (inner, WeightAverage(count, averaged))

    return optax.GradientTransformation(init, update)


def served_params(params: optax.Params, opt_state: optax.OptState) -> optax.Params:
    """The weights to evaluate and export: the average where the optimizer keeps one."""
    if isinstance(opt_state, tuple) and len(opt_state) == 2 and isinstance(opt_state[1], WeightAverage):
        return opt_state[1].params
    return params
