"""The drafter's loss on a batch's blocks: its forward pass, then its kind's terms (training/kinds/)."""

from __future__ import annotations

from collections.abc import Callable

import jax

from dflash_jax.models.drafter import DFlashDrafter
from dflash_jax.training.kinds import TERMS
from dflash_jax.training.objective import Blocks, ObjectiveConfig, loss_denominator, metric_sums


def drafter_loss(
    drafter: DFlashDrafter,
    unembed: Callable[[jax.Array], jax.Array],
    features: jax.Array,
    block_embeds: jax.Array,
    ctx_positions: jax.Array,
    blocks: Blocks,
    cfg: ObjectiveConfig,
    step: jax.Array | int = 0,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(Σ w·loss over these rows, metric sums) — not yet divided. `step`: the optimizer steps taken
    so far (a loss term may change over the run, `ObjectiveConfig.total_steps`).

    docs/design.md §3.3: the loss is Σ w·loss / (Σw or documents) over the whole global batch, so
    the caller divides the accumulated sum (and its gradient) by the batch's total of the sums'
    "weight" entry (`loss_denominator`), once. Gradient accumulation then gives the update of
    one big batch.
    """
    hidden = drafter(
        block_embeds,
        blocks.positions,
        drafter.context(features),
        ctx_positions,
        blocks.ctx_mask,
        blocks_per_chunk=cfg.attention_chunk_blocks,
        remat_policy=cfg.remat_policy if cfg.remat else None,
    )
    weighted, weights, correct = TERMS[cfg.drafter.kind](drafter, unembed, hidden, blocks, cfg, step)
    return weighted, metric_sums(weighted, loss_denominator(weights, blocks, cfg), correct, blocks)
