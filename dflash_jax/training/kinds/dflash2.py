"""DFlash2's objective (docs/design.md "Drafter kinds"; speculators' and SpecForge's DFlash2
trainers): the DFlash loss on the unary logits U plus α times the cross-entropy of the data
token among the k selector candidates, both with the slot weights.

Candidates are the top-k of U; when the data token is not among them it replaces the last (the
k-th best), so every scored slot has its label among the k. The selector scores a candidate
after the slot's teacher-forced predecessor (the data token before the label; the anchor for the
first slot). A slot is a hit, for the per-slot accuracy and tau_train, where greedy decoding
would draft the label after a correct prefix: the label is among the true top-k and scores best.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from dflash_jax.models.drafter import DFlashDrafter
from dflash_jax.models.kinds.dflash2 import successor_scores, unary_logits
from dflash_jax.training.head_terms import Terms, Unembed, chunked_terms, vocab_parallel_logits, vocab_parallel_top_k
from dflash_jax.training.objective import slot_weights


def training_candidates(logits: jax.Array, labels: jax.Array, k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(candidates [..., k], the label's index among them, whether the top-k held it): the top-k
    of logits [..., V], the label put in the last place when missing."""
    candidates = vocab_parallel_top_k(jax.lax.stop_gradient(logits), k)[1]
    matches = candidates == labels[..., None]
    in_top = matches.any(-1)
    gold = jnp.where(in_top, jnp.argmax(matches, axis=-1), k - 1)
    candidates = candidates.at[..., -1].set(jnp.where(in_top, candidates[..., -1], labels))
    return candidates, gold, in_top


def terms(drafter: DFlashDrafter, unembed: Unembed, hidden: jax.Array, blocks, cfg, step=0) -> Terms:
    """hidden [R, N, Bk, D] -> (Σ w·(unary loss + α·candidate CE), weights w, hits), the last two
    [R, N, Bk-1]; the slot weights from each slot's label CE (a constant to the gradient)."""
    weights_of = functools.partial(slot_weights, cfg=cfg)
    d = drafter.cfg
    selector = drafter.candidate_selector
    h = hidden[:, :, 1:]
    predecessors = jnp.concatenate([blocks.tokens[..., :1], blocks.labels[..., :-1]], axis=-1)
    inputs = (h, selector.context(h, predecessors))
    constants = (blocks.labels, blocks.label_mask) + (() if blocks.target_hidden is None else (blocks.target_hidden,))

    def slot_terms(inputs, constants, successors):
        h, context = inputs
        labels, scored, *target_h = constants
        logits_of = vocab_parallel_logits(unembed, h.shape)
        logits = unary_logits(logits_of(h), d.output_multiplier, d.final_logit_softcapping)
        log_q = jax.nn.log_softmax(logits, axis=-1)
        label_ce = -jnp.take_along_axis(log_q, labels[..., None], axis=-1)[..., 0]
        unary = label_ce
        if target_h:  # distill: KL from the target's distribution
            log_p = jax.lax.stop_gradient(jax.nn.log_softmax(logits_of(target_h[0]), axis=-1))
            unary = jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)
        candidates, gold, in_top = training_candidates(logits, labels, d.selector_top_k)
        scores = jnp.take_along_axis(logits + successor_scores(context, successors), candidates, axis=-1)
        candidate_ce = jax.nn.logsumexp(scores, axis=-1) - jnp.take_along_axis(scores, gold[..., None], -1)[..., 0]
        weights = jax.lax.stop_gradient(weights_of(label_ce, scored))
        hit = in_top & (jnp.argmax(scores, axis=-1) == gold)
        return jnp.sum(weights * (unary + cfg.selector_alpha * candidate_ce)), (weights, hit)

    total, (weights, hits) = chunked_terms(
        slot_terms, inputs, constants, selector.successor_codebook[...], chunk_blocks=cfg.lm_head_chunk_blocks
    )
    return total, weights, hits
