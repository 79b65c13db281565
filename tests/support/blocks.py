"""`objective.Blocks` of labels alone, for the loss terms' tests (the other fields None)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from dflash_jax.training import objective


def scored_blocks(labels: np.ndarray, label_mask: np.ndarray, **fields) -> objective.Blocks:
    """Blocks [R, N, K] with these labels and scored slots; `fields` the other arrays a kind's
    terms read (`realised_embeds`, `target_hidden`)."""
    blank = dict(tokens=None, positions=None, valid=None, ctx_mask=None, documents=None)
    return objective.Blocks(
        labels=jnp.asarray(labels, jnp.int32), label_mask=jnp.asarray(label_mask), **blank, **fields
    )
