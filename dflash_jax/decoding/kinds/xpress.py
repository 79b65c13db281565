"""XPress's walk (vLLM's `XPressSpeculator`): the backbone's logits U of slots 1..B-1 once, the
backbone's own drafts as the seed, then `xpress_num_passes` Jacobi passes, each redrafting every
slot at once from U plus the refiner's bias after the previous pass's drafts (the anchor before
slots 0 and 1: models/kinds/xpress.py). The mixer is causal, so after p passes slots 1..p are the
sequential walk's drafts, and B - 1 passes give it exactly.

Sampled, every pass draws each slot from its refined logits with a key of its own, and q is the
last pass's: each draft is then a draw from q given the previous pass's drafts, which do not
depend on it, and rejection sampling needs no more (decoding/sampling.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dflash_jax.decoding.drafting import all_proposed
from dflash_jax.decoding.sampling import SamplingConfig, choose


def walk(vocab, drafter, hidden: jax.Array, anchor: jax.Array, sampling: SamplingConfig, key, threshold, embed=None):
    """hidden [B, Bk, D] -> (drafts [B, Bk-1], draft logits [B, Bk-1, V], drafts proposed [B])."""
    head = drafter.xpress_head
    base = vocab.logits(hidden[:, 1:]).astype(jnp.float32)
    hidden_part = head.hidden_part(hidden)
    anchor = anchor[:, None]

    def refine(carry, key):  # one Jacobi pass
        drafts, _ = carry
        previous = jnp.concatenate([anchor, anchor, drafts[:, :-1]], axis=1)
        logits = base + vocab.columns(head.bias(head.latent(hidden_part, previous)[:, 1:]))
        return (vocab.tokens(choose(logits, sampling, key)), logits), None

    keys = jax.random.split(key, 1 + drafter.cfg.xpress_num_passes)
    seed = (vocab.tokens(choose(base, sampling, keys[0])), base)
    (drafts, logits), _ = jax.lax.scan(refine, seed, keys[1:])
    return drafts, vocab.scatter(logits), all_proposed(drafts)
