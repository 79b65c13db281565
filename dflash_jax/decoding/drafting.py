"""From one drafter pass to a block of drafts: each drafter kind's walk (`Kind.walk`,
docs/design.md "Drafter kinds"). Every walk returns what verification needs: the drafts, per
slot the logits whose `sampling.warp_probs` is the distribution the draft was chosen from (the
proposal q of rejection sampling), and how many drafts each row proposes.

* DFlash drafts every slot after the anchor on its own, from its logits (`independent_walk`).

DFlash2 and DSpark walk the block slot by slot, each choice conditioning the next:

* DFlash2 (z-lab's `CandidateSelector.select`): slot t chooses among the top-k of its unary
  logits, scoring candidate b after the previous choice a by U_t(b) + ⟨A[a] ⊙ P(h_t), B[b]⟩; q is
  zero outside the k candidates (their logits are -inf).
* DSpark (DeepSpec's Markov walk): slot k's logits are U_k + W2·W1[x_{k-1}], x_{k-1} the previous
  draft (the anchor for slot 0); its confidence head gives the probability that the draft is
  accepted, and `confidence_threshold` > 0 proposes the drafts only up to the first slot below it.
* Domino (SpecForge's GRU rollout): the GRU reads the target's embedding of the previous draft
  (the anchor for slot 0), and from slot `pure_draft_prefix_len` on its state corrects slot k's
  logits (`embed`: the target's token embedding, which only this walk reads).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dflash_jax.decoding.sampling import SamplingConfig, choose
from dflash_jax.models.kinds.dflash2 import top_k, unary_logits
from dflash_jax.models.kinds.domino import corrected, correction, kernels


def _walk(step, first, xs, key: jax.Array):
    """lax.scan of `step(previous, (slot inputs..., key))` over the slots (axis 1 of every xs)."""
    slots = jax.tree.leaves(xs)[0].shape[1]
    xs = jax.tree.map(lambda x: jnp.moveaxis(x, 1, 0), xs)
    _, out = jax.lax.scan(step, first, (*xs, jax.random.split(key, slots)))
    return jax.tree.map(lambda y: jnp.moveaxis(y, 0, 1), out)


def _all_proposed(drafts: jax.Array) -> jax.Array:
    """[B]: every draft of drafts [B, K] proposed."""
    return jnp.full(drafts.shape[:1], drafts.shape[1], jnp.int32)


def independent_walk(
    vocab, drafter, hidden: jax.Array, anchor: jax.Array, sampling: SamplingConfig, key, threshold, embed=None
):
    """DFlash: hidden [B, Bk, D] -> (drafts [B, Bk-1], draft logits [B, Bk-1, V], drafts proposed
    [B]); `vocab`: the tokens it drafts among (`draft_vocab.py`)."""
    logits = vocab.logits(hidden[:, 1:])
    drafts = vocab.tokens(choose(logits, sampling, key))
    return drafts, vocab.scatter(logits), _all_proposed(drafts)


def selector_walk(
    vocab, drafter, hidden: jax.Array, anchor: jax.Array, sampling: SamplingConfig, key, threshold, embed=None
):
    """DFlash2: hidden [B, Bk, D] of the block -> (drafts [B, Bk-1], draft logits [B, Bk-1, V],
    drafts proposed [B]); `vocab`: the tokens it drafts among (`draft_vocab.py`)."""
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

    drafts, scores = _walk(step, anchor, (h, values, candidates), key)
    rows, slots = jnp.indices(candidates.shape[:2])
    logits = (
        jnp.full((*candidates.shape[:2], d.vocab_size), -jnp.inf, jnp.float32)
        .at[rows[..., None], slots[..., None], candidates]
        .set(scores)
    )
    return drafts, logits, _all_proposed(drafts)


def markov_walk(
    vocab,
    drafter,
    hidden: jax.Array,
    anchor: jax.Array,
    sampling: SamplingConfig,
    key: jax.Array,
    threshold: float,
    embed=None,
):
    """DSpark: hidden [B, γ, D] -> (drafts [B, γ], draft logits [B, γ, V], drafts proposed [B]);
    `vocab`: the tokens it drafts among (`draft_vocab.py`)."""
    markov = drafter.markov_head
    unary = vocab.logits(hidden).astype(jnp.float32)

    def step(previous, xs):
        unary_k, h_k, key_k = xs
        embedding = markov.embed(previous)
        logits = unary_k + vocab.columns(markov.bias(embedding))
        token = vocab.tokens(choose(logits, sampling, key_k))
        return token, (token, logits, jax.nn.sigmoid(drafter.confidence_head(h_k, embedding)))

    drafts, logits, confidence = _walk(step, anchor, (unary, hidden), key)
    logits = vocab.scatter(logits)
    if not threshold > 0:
        return drafts, logits, _all_proposed(drafts)
    # The drafts before the first slot whose confidence is below the threshold.
    return drafts, logits, jnp.sum(jnp.cumprod(confidence >= threshold, axis=1), axis=1).astype(jnp.int32)


def gru_walk(vocab, drafter, hidden: jax.Array, anchor: jax.Array, sampling: SamplingConfig, key, threshold, embed):
    """Domino: hidden [B, Bk, D] -> (drafts [B, Bk], draft logits [B, Bk, V], drafts proposed
    [B]); `vocab`: the tokens it drafts among (`draft_vocab.py`)."""
    gru, first, w = drafter.prefix_gru, drafter.cfg.pure_draft_prefix_len, kernels(drafter.embed_proj)
    unary = vocab.logits(hidden).astype(jnp.float32)

    def step(carry, xs):
        previous, state, slot = carry
        unary_k, h_k, key_k = xs
        state = gru.step(state, embed(previous))
        logits = corrected(first, slot, unary_k, vocab.columns(correction(w, h_k, state)))
        token = vocab.tokens(choose(logits, sampling, key_k))
        return (token, state, slot + 1), (token, logits)

    drafts, logits = _walk(step, (anchor, gru.initial(anchor.shape), jnp.zeros((), jnp.int32)), (unary, hidden), key)
    return drafts, vocab.scatter(logits), _all_proposed(drafts)
