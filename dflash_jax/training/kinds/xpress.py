"""XPress's objective (speculators PR #1061's `XPressDraftModel.forward`; docs/design.md "Drafter
kinds"): on the backbone's logits U of slots 1..K and the refiner's bias after the tokens before
each slot (models/kinds/xpress.py),

    loss = T(U + bias(labels)) + 0.3 · mean_j T(U + bias(d_j)) + β · T(U),

the first term teacher-forced (the tokens before the slots are the data's), the middle one over
the free-running Jacobi rounds j = 1..`xpress_consistency_passes` as decoding runs them: d_1 the
backbone's own argmax, d_{j+1} the argmax of round j's logits (no gradient through the argmax).
Gradients reach the backbone through every term: it is trained jointly, its own term weighed
by β (`xpress_backbone_weight`). T is the run's loss of each slot (the label's cross-entropy, or
the KL from the target's distribution when distilling) under the run's slot weights ('dflash':
exp(-(k-1)/γ); 'dpace': from that term's own label CE).

The hits (per-slot accuracy, tau_train) are the teacher-forced logits': greedy decoding drafts
the label at slot k after a correct prefix exactly when slot k's teacher-forced logits pick it, so
their leading hits are the acceptance of the sequential walk, which Jacobi reaches in B - 1 passes
(the last free-running round's would be that of 3 passes).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dflash_jax.decoding.sampling import argmax
from dflash_jax.models.drafter import DFlashDrafter
from dflash_jax.models.sharding import BATCH, VOCAB, constrain
from dflash_jax.training.head_terms import Terms, Unembed, chunked_terms, vocab_parallel_logits
from dflash_jax.training.objective import slot_weights

# The authors' weight of the free-running rounds' mean (β, the backbone's: `xpress_backbone_weight`).
CONSISTENCY_WEIGHT = 0.3


def terms(drafter: DFlashDrafter, unembed: Unembed, hidden: jax.Array, blocks, cfg, step=0) -> Terms:
    """hidden [R, N, Bk, D] (the anchor's slot too: the refiner reads it) -> (Σ w·loss, slot
    weights [R, N, Bk-1], hits [R, N, Bk-1]); the weights the teacher-forced term's ('dflash':
    every term's)."""
    graphdef, params = nnx.split(drafter.xpress_head)
    rounds, backbone_weight = drafter.cfg.xpress_consistency_passes, drafter.cfg.xpress_backbone_weight
    constants = (blocks.labels, blocks.label_mask, blocks.tokens[..., :1])
    constants += () if blocks.target_hidden is None else (blocks.target_hidden,)

    def slot_terms(h, constants, params):
        labels, mask, anchor, *target_h = constants
        head = nnx.merge(graphdef, params)
        logits_of = vocab_parallel_logits(unembed, h[..., 1:, :].shape)
        base = logits_of(h[..., 1:, :])
        hidden_part = head.hidden_part(h)
        target_log_p = jax.lax.stop_gradient(jax.nn.log_softmax(logits_of(target_h[0]), axis=-1)) if target_h else None

        def refined(drafts):
            """The logits of slots 1..K after the tokens drafts [.., K] they hold: the anchor
            before slots 0 and 1, then the drafts but the last."""
            previous = jnp.concatenate([anchor, anchor, drafts[..., :-1]], axis=-1)
            bias = head.bias(head.latent(hidden_part, previous)[..., 1:, :])
            return base + constrain(bias, (BATCH, ..., VOCAB))

        def scored(logits):  # -> (Σ w·loss, w, hits)
            log_q = jax.nn.log_softmax(logits, axis=-1)
            label_ce = -jnp.take_along_axis(log_q, labels[..., None], axis=-1)[..., 0]
            loss = label_ce
            if target_log_p is not None:
                loss = jnp.sum(jnp.exp(target_log_p) * (target_log_p - log_q), axis=-1)
            weights = jax.lax.stop_gradient(slot_weights(label_ce, mask, cfg))
            label_logit = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
            return jnp.sum(weights * loss), weights, label_logit >= jnp.max(logits, axis=-1)

        total, weights, hits = scored(refined(labels))
        drafts, consistency = argmax(jax.lax.stop_gradient(base)), 0.0
        for _ in range(rounds):
            logits = refined(drafts)
            consistency += scored(logits)[0]
            drafts = argmax(jax.lax.stop_gradient(logits))
        total += CONSISTENCY_WEIGHT / rounds * consistency + backbone_weight * scored(base)[0]
        return total, (weights, hits)

    total, (weights, hits) = chunked_terms(slot_terms, hidden, constants, params, chunk_blocks=cfg.lm_head_chunk_blocks)
    return total, weights, hits
