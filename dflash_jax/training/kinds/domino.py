"""Domino's objective (SpecForge's `OnlineDominoModel`; docs/design.md "Drafter kinds").

Every slot k = 0..Bk-1 drafts the token after it. Its final logits are the unary ones plus, from
slot `pure_draft_prefix_len` on, the correction of the GRU state after the teacher-forced tokens
up to slot k (the anchor, then the labels before slot k's: models/kinds/domino.py). The loss is
(1 − λ)·CE(final) + λ·CE(unary), each slot weighted by the 'dflash' position decay exp(−k/γ);
λ starts at `base_loss_weight` and falls linearly to 0 over the first `base_loss_decay` of the
run (SpecForge's curriculum: the backbone learns to draft before the correction is trained).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dflash_jax.models.drafter import DFlashDrafter
from dflash_jax.models.kinds.domino import corrected, correction, kernels
from dflash_jax.models.sharding import BATCH, VOCAB, constrain
from dflash_jax.training.head_terms import Terms, Unembed, chunked_terms, vocab_parallel_logits
from dflash_jax.training.objective import slot_weights


def base_loss_weight(cfg, step: jax.Array | int) -> jax.Array:
    """λ after `step` optimizer steps: `base_loss_weight` · (1 − step / decay steps), at least 0,
    the decay steps `base_loss_decay` of `total_steps` (at least 1, as SpecForge counts them);
    base_loss_decay=0 keeps λ fixed."""
    if not cfg.base_loss_decay:
        return jnp.float32(cfg.base_loss_weight)
    decay_steps = max(1, int(cfg.base_loss_decay * cfg.total_steps))
    return cfg.base_loss_weight * jnp.clip(1 - jnp.asarray(step, jnp.float32) / decay_steps, 0.0, 1.0)


def terms(drafter: DFlashDrafter, unembed: Unembed, hidden: jax.Array, blocks, cfg, step=0) -> Terms:
    """hidden [R, N, Bk, D] -> (Σ w·loss, slot weights [R, N, Bk], hits [R, N, Bk]); the hits are
    the final logits', and so are the slot weights (a constant to the gradient: `slot_weights`
    reads the final logits' label CE)."""
    states = drafter.prefix_gru(blocks.realised_embeds)
    first, lam = drafter.cfg.pure_draft_prefix_len, base_loss_weight(cfg, step)
    mixes_unary = cfg.base_loss_weight > 0  # else λ is 0 throughout: no unary cross-entropy

    def cross_entropy(logits, labels):
        label_logit = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
        return jax.nn.logsumexp(logits, axis=-1) - label_logit, label_logit >= jnp.max(logits, axis=-1)

    def slot_terms(inputs, constants, w):
        h, g = inputs
        labels, scored = constants
        unary = vocab_parallel_logits(unembed, h.shape)(h)
        final = corrected(first, jnp.arange(h.shape[-2]), unary, constrain(correction(w, h, g), (BATCH, ..., VOCAB)))
        ce, hits = cross_entropy(final, labels)
        weights = jax.lax.stop_gradient(slot_weights(ce, scored, cfg))
        if mixes_unary:
            ce = (1 - lam) * ce + lam * cross_entropy(unary, labels)[0]
        return jnp.sum(weights * ce), (weights, hits)

    total, (weights, hits) = chunked_terms(
        slot_terms,
        (hidden, states),
        (blocks.labels, blocks.label_mask),
        kernels(drafter.embed_proj),
        chunk_blocks=cfg.lm_head_chunk_blocks,
    )
    return total, weights, hits
