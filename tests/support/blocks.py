"""`objective.Blocks` of labels alone, for the loss terms' tests (the other fields None), and
objective configs of tiny drafters."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from dflash_jax.models.drafter_config import DrafterConfig
from dflash_jax.training import objective


def scored_blocks(labels: np.ndarray, label_mask: np.ndarray, **fields) -> objective.Blocks:
    """Blocks [R, N, K] with these labels and scored slots; `fields` the other arrays a kind's
    terms read (`realised_embeds`, `target_hidden`)."""
    blank = dict(tokens=None, positions=None, valid=None, ctx_mask=None, documents=None)
    return objective.Blocks(
        labels=jnp.asarray(labels, jnp.int32), label_mask=jnp.asarray(label_mask), **blank, **fields
    )


def objective_config(target, *, num_layers: int = 1, **fields) -> objective.ObjectiveConfig:
    """The objective of a drafter for `target` (a TransformerConfig): `fields` are the drafter's
    (DrafterConfig) or the objective's; the loss, γ and D-PACE's α, unless given, are the drafter kind's (as
    training/config/run_config.py resolves them)."""
    drafter_fields = {f.name for f in dataclasses.fields(DrafterConfig)}
    drafter = DrafterConfig.for_target(
        target, num_layers=num_layers, **{k: v for k, v in fields.items() if k in drafter_fields}
    )
    settings = {k: v for k, v in fields.items() if k not in drafter_fields}
    kind = drafter.kind_spec
    settings["loss"] = settings.get("loss") or kind.loss
    settings.setdefault("loss_decay_gamma", kind.loss_decay_gamma or objective.PAPER_LOSS_DECAY_GAMMA[8])
    settings.setdefault("dpace_alpha", kind.dpace_alpha)
    return objective.ObjectiveConfig(**settings, drafter=drafter)
