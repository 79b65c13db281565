"""DFlash's walk: every slot after the anchor drafts on its own, from its logits."""

from __future__ import annotations

import jax

from dflash_jax.decoding.drafting import all_proposed
from dflash_jax.decoding.sampling import SamplingConfig, choose


def walk(vocab, drafter, hidden: jax.Array, anchor: jax.Array, sampling: SamplingConfig, key, threshold, embed=None):
    """hidden [B, Bk, D] -> (drafts [B, Bk-1], draft logits [B, Bk-1, V], drafts proposed [B])."""
    logits = vocab.logits(hidden[:, 1:])
    drafts = vocab.tokens(choose(logits, sampling, key))
    return drafts, vocab.scatter(logits), all_proposed(drafts)
