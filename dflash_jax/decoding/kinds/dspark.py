"""DSpark's walk (DeepSpec's Markov walk): slot k's logits are U_k + W2·W1[x_{k-1}], x_{k-1} the
previous draft (the anchor for slot 0); its confidence head gives the probability that the draft
is accepted, and a confidence threshold > 0 proposes the drafts only up to the first slot below it."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dflash_jax.decoding.drafting import all_proposed, scan_slots
from dflash_jax.decoding.sampling import SamplingConfig, choose


def walk(vocab, drafter, hidden: jax.Array, anchor: jax.Array, sampling: SamplingConfig, key, threshold, embed=None):
    """hidden [B, γ, D] -> (drafts [B, γ], draft logits [B, γ, V], drafts proposed [B])."""
    markov = drafter.markov_head
    unary = vocab.logits(hidden).astype(jnp.float32)

    def step(previous, xs):
        unary_k, h_k, key_k = xs
        embedding = markov.embed(previous)
        logits = unary_k + vocab.columns(markov.bias(embedding))
        token = vocab.tokens(choose(logits, sampling, key_k))
        return token, (token, logits, jax.nn.sigmoid(drafter.confidence_head(h_k, embedding)))

    drafts, logits, confidence = scan_slots(step, anchor, (unary, hidden), key)
    logits = vocab.scatter(logits)
    if not threshold > 0:
        return drafts, logits, all_proposed(drafts)
    # The drafts before the first slot whose confidence is below the threshold.
    return drafts, logits, jnp.sum(jnp.cumprod(confidence >= threshold, axis=1), axis=1).astype(jnp.int32)
