"""What the drafting walks of decoding/kinds/ share: a scan over the slots of a block, each
choice feeding the next, and a row's drafts all proposed."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def scan_slots(step, first, xs, key: jax.Array):
    """lax.scan of `step(previous, (slot inputs..., key))` over the slots (axis 1 of every xs)."""
    slots = jax.tree.leaves(xs)[0].shape[1]
    xs = jax.tree.map(lambda x: jnp.moveaxis(x, 1, 0), xs)
    _, out = jax.lax.scan(step, first, (*xs, jax.random.split(key, slots)))
    return jax.tree.map(lambda y: jnp.moveaxis(y, 0, 1), out)


def all_proposed(drafts: jax.Array) -> jax.Array:
    """[B]: every draft of drafts [B, K] proposed."""
    return jnp.full(drafts.shape[:1], drafts.shape[1], jnp.int32)
