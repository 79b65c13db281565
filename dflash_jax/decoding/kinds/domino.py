"""Domino's walk (SpecForge's GRU rollout): the GRU reads the target's embedding of the previous
draft (the anchor for slot 0), and from slot `pure_draft_prefix_len` on its state corrects slot
k's logits (`embed`: the target's token embedding, which only this walk reads)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dflash_jax.decoding.drafting import all_proposed, scan_slots
from dflash_jax.decoding.sampling import SamplingConfig, choose
from dflash_jax.models.kinds.domino import corrected, correction, kernels


def walk(vocab, drafter, hidden: jax.Array, anchor: jax.Array, sampling: SamplingConfig, key, threshold, embed):
    """hidden [B, Bk, D] -> (drafts [B, K], draft logits [B, K, V], drafts proposed [B]), K the
    drafts a block proposes (all its slots but the last, which is trained and never proposed)."""
    gru, first, w = drafter.prefix_gru, drafter.cfg.pure_draft_prefix_len, kernels(drafter.embed_proj)
    hidden = hidden[:, : drafter.cfg.num_drafts]
    unary = vocab.logits(hidden).astype(jnp.float32)

    def step(carry, xs):
        previous, state, slot = carry
        unary_k, h_k, key_k = xs
        state = gru.step(state, embed(previous))
        logits = corrected(first, slot, unary_k, vocab.columns(correction(w, h_k, state)))
        token = vocab.tokens(choose(logits, sampling, key_k))
        return (token, state, slot + 1), (token, logits)

    first_carry = (anchor, gru.initial(anchor.shape), jnp.zeros((), jnp.int32))
    drafts, logits = scan_slots(step, first_carry, (unary, hidden), key)
    return drafts, vocab.scatter(logits), all_proposed(drafts)
