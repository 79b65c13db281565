"""DFlash's loss terms (docs/design.md §3.3): every slot after the anchor scored against its
label (or, distilling, the target's distribution there) on the frozen LM head, weighted by the
paper's position decay or D-PACE."""

from __future__ import annotations

import jax

from dflash_jax.models.drafter import DFlashDrafter
from dflash_jax.training.head_terms import Terms, Unembed
from dflash_jax.training.objective import Blocks, ObjectiveConfig, lm_head_cross_entropy, slot_weights


def terms(
    drafter: DFlashDrafter, unembed: Unembed, hidden: jax.Array, blocks: Blocks, cfg: ObjectiveConfig, step=0
) -> Terms:
    """hidden [R, N, Bk, D] -> (Σ w·CE, slot weights, hits), the last two [R, N, Bk-1]."""
    loss, label_ce, correct = lm_head_cross_entropy(
        unembed,
        hidden[:, :, 1:],
        blocks.labels,
        chunk_blocks=cfg.lm_head_chunk_blocks,
        target_hidden=blocks.target_hidden,
    )
    weights = slot_weights(label_ce, blocks.label_mask, cfg)
    return (weights * loss).sum(), weights, correct
