"""Whole-matrix Muon (training/optim/muon.py) is optax.contrib.muon: the same updates and the same state.

That it stays so on 8 devices, with each matrix whole on one device and no more gathering than
AdamW, is checked by sharded_step_check.py (tests/training/test_step.py runs it); that the update
is orthogonalized, by test_step.py's Muon test."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dflash_jax.training.optim import muon

SETTINGS = dict(consistent_rms=0.2, weight_decay=0.1, adam_b1=0.9, adam_b2=0.999)


def test_updates_and_state_are_optax_muons():
    rng = np.random.default_rng(0)
    # wide, tall and square matrices (tall ones are orthogonalized through their transpose), a vector
    shapes = {"wide": (16, 48), "tall": (40, 24), "square": (32, 32), "scale": (32,)}
    params = {k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in shapes.items()}
    ours, reference = muon.muon(1e-2, **SETTINGS), optax.contrib.muon(1e-2, **SETTINGS)
    state, ref_state = ours.init(params), reference.init(params)
    # One pytree: a checkpoint of either optimizer restores into the other.
    assert jax.tree.structure(state) == jax.tree.structure(ref_state)
    update, ref_update = jax.jit(ours.update), jax.jit(reference.update)
    for _ in range(3):
        grads = {k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in shapes.items()}
        updates, state = update(grads, state, params)
        ref_updates, ref_state = ref_update(grads, ref_state, params)
        for name in shapes:
            np.testing.assert_allclose(updates[name], ref_updates[name], rtol=1e-4, atol=1e-6 * 1e-2, err_msg=name)
        params = optax.apply_updates(params, updates)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), state, ref_state)
