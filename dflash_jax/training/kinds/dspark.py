"""DSpark's objective (DeepSeek's DeepSpec `dspark/loss.py`; docs/design.md "Drafter kinds").

Every slot k = 0..γ-1 drafts the token after it; its logits are the unary ones plus the Markov
bias of the teacher-forced previous token (the data token before the label; the anchor for slot
0). With q the drafter's distribution and p the target's (its frozen LM head on its last hidden
state before the label), a slot's loss is

    0.1·CE(q, label) + 0.9·‖q − p‖₁ + BCE(c_k, 1 − ½‖q − p‖₁),

the confidence target 1 − ½‖q − p‖₁ (the probability that a draft from q is accepted against
p) a constant. Slots are weighted by exp(−k/γ_decay) (γ_decay = 4), over the prefix of scored
slots of each block, as DeepSpec weights them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dflash_jax.models.drafter import DFlashDrafter
from dflash_jax.models.sharding import BATCH, VOCAB, constrain
from dflash_jax.training.head_terms import Terms, Unembed, chunked_terms, vocab_parallel_logits
from dflash_jax.training.objective import slot_weights

# DeepSpec's weights of the three terms.
CE_WEIGHT, L1_WEIGHT, CONFIDENCE_WEIGHT = 0.1, 0.9, 1.0


def terms(drafter: DFlashDrafter, unembed: Unembed, hidden: jax.Array, blocks, cfg, step=0) -> Terms:
    """hidden [R, N, γ, D] -> (Σ w·loss, slot weights [R, N, γ], hits [R, N, γ]); the weights (a
    constant to the gradient) from each slot's label CE, as `slot_weights` reads it."""
    markov = drafter.markov_head
    embedding = markov.embed(jnp.concatenate([blocks.tokens[..., :1], blocks.labels[..., :-1]], axis=-1))

    def slot_terms(inputs, constants, w2):
        h, embedding = inputs
        labels, scored, target_h = constants
        logits_of = vocab_parallel_logits(unembed, h.shape)
        logits = logits_of(h) + constrain(markov.bias(embedding, w2), (BATCH, ..., VOCAB))
        log_q = jax.nn.log_softmax(logits, axis=-1)
        label_logit = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
        label_ce = -jnp.take_along_axis(log_q, labels[..., None], axis=-1)[..., 0]
        p = jax.lax.stop_gradient(jax.nn.softmax(logits_of(target_h), axis=-1))
        l1 = jnp.sum(jnp.abs(jnp.exp(log_q) - p), axis=-1)
        accept = jax.lax.stop_gradient(jnp.clip(1.0 - 0.5 * l1, 0.0, 1.0))
        loss = CE_WEIGHT * label_ce + L1_WEIGHT * l1
        weights = jax.lax.stop_gradient(slot_weights(label_ce, scored, cfg))
        return jnp.sum(weights * loss), (weights, label_logit >= jnp.max(logits, axis=-1), accept)

    total, (weights, hits, accept) = chunked_terms(
        slot_terms,
        (hidden, embedding),
        (blocks.labels, blocks.label_mask, blocks.target_hidden),
        markov.markov_w2.kernel[...],
        chunk_blocks=cfg.lm_head_chunk_blocks,
    )
    confidence = drafter.confidence_head(hidden, embedding)
    bce = jax.nn.softplus(confidence) - accept * confidence  # BCE with logits, target `accept`
    return total + CONFIDENCE_WEIGHT * jnp.sum(weights * bce), weights, hits
