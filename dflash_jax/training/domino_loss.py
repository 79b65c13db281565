"""Domino's objective (SpecForge's `OnlineDominoModel`; docs/design.md "Drafter kinds").

Every slot k = 0..Bk-1 drafts the token after it. Its final logits are the unary ones plus, from
slot `pure_draft_prefix_len` on, the correction of the GRU state after the teacher-forced tokens
up to slot k (the anchor, then the labels before slot k's: models/kinds/domino.py). The loss is
(1 − λ)·CE(final) + λ·CE(unary) (λ = `base_loss_weight`), each slot weighted by the 'dflash'
position decay exp(−k/γ).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dflash_jax.models.drafter import DFlashDrafter
from dflash_jax.models.kinds.domino import corrected, correction, kernels
from dflash_jax.models.sharding import BATCH, VOCAB, constrain
from dflash_jax.training.head_terms import Terms, Unembed, chunked_terms, vocab_parallel_logits
from dflash_jax.training.objective import lm_head_cross_entropy, slot_weights


def domino_terms(drafter: DFlashDrafter, unembed: Unembed, hidden: jax.Array, blocks, cfg) -> Terms:
    """hidden [R, N, Bk, D] -> (Σ w·loss, slot weights [R, N, Bk], hits [R, N, Bk]); the hits are
    the final logits'."""
    weights = slot_weights(None, blocks.label_mask, cfg)
    states = drafter.prefix_gru(blocks.realised_embeds)
    first, lam = drafter.cfg.pure_draft_prefix_len, cfg.base_loss_weight

    def slot_terms(inputs, constants, w):
        h, g = inputs
        labels, weights = constants
        logits = vocab_parallel_logits(unembed, h.shape)(h)
        logits = corrected(first, jnp.arange(h.shape[-2]), logits, constrain(correction(w, h, g), (BATCH, ..., VOCAB)))
        label_logit = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
        ce = jax.nn.logsumexp(logits, axis=-1) - label_logit
        return jnp.sum(weights * ce), label_logit >= jnp.max(logits, axis=-1)

    final, hits = chunked_terms(
        slot_terms,
        (hidden, states),
        (blocks.labels, weights),
        kernels(drafter.embed_proj),
        chunk_blocks=cfg.lm_head_chunk_blocks,
    )
    if not lam:
        return final, weights, hits
    base, _, _ = lm_head_cross_entropy(unembed, hidden, blocks.labels, chunk_blocks=cfg.lm_head_chunk_blocks)
    return (1 - lam) * final + lam * jnp.sum(weights * base), weights, hits
