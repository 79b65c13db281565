"""DFlash2's walk (z-lab's `CandidateSelector.select`): slot t chooses among the top-k of its unary
logits, scoring candidate b after the previous choice a by U_t(b) + ⟨A[a] ⊙ P(h_t), B[b]⟩; q is
zero outside the k candidates (their logits are -inf)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dflash_jax.decoding.drafting import all_proposed, scan_slots
from dflash_jax.decoding.sampling import SamplingConfig, choose
from dflash_jax.models.kinds.dflash2 import unary_logits
from dflash_jax.models.layers.basic import top_k


def walk(vocab, drafter, hidden: jax.Array, anchor: jax.Array, sampling: SamplingConfig, key, threshold, embed=None):
    """hidden [B, Bk, D] of the block -> (drafts [B, Bk-1], draft logits [B, Bk-1, V], drafts
    proposed [B])."""
    d, selector = drafter.cfg, drafter.candidate_selector
    h = hidden[:, 1:]
    unary = unary_logits(vocab.logits(h).astype(jnp.float32), d.output_multiplier, d.final_logit_softcapping)
    values, candidates = top_k(unary, min(d.selector_top_k, unary.shape[-1]))  # a draft vocabulary may be smaller
    candidates = vocab.tokens(candidates)

    def step(previous, xs):
        h_t, values_t, candidates_t, key_t = xs
        scores = values_t + selector.pair_scores(selector.context(h_t, previous), candidates_t)
        token = jnp.take_along_axis(candidates_t, choose(scores, sampling, key_t)[:, None], axis=1)[:, 0]
        return token, (token, scores)

    drafts, scores = scan_slots(step, anchor, (h, values, candidates), key)
    rows, slots = jnp.indices(candidates.shape[:2])
    logits = (
        jnp.full((*candidates.shape[:2], d.vocab_size), -jnp.inf, jnp.float32)
        .at[rows[..., None], slots[..., None], candidates]
        .set(scores)
    )
    return drafts, logits, all_proposed(drafts)
