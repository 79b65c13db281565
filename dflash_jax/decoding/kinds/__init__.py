"""Each drafter kind's drafting walk: one module per kind, named as the kind (models/kinds/), whose
`walk(vocab, drafter, hidden [B, Bk, D], anchor [B], sampling, key, confidence threshold, embed)`
returns what verification needs: the drafts [B, K], per slot the logits whose
`sampling.warp_probs` is the distribution the draft was chosen from (the proposal q of rejection
sampling) [B, K, V], and how many drafts each row proposes [B]. `vocab` is the tokens it drafts
among (decoding/draft_vocab.py); `embed` the target's token embedding. decoding/speculative.py
keeps the first `DrafterConfig.num_drafts` of them."""

from __future__ import annotations

from dflash_jax.models import registry

WALKS = registry.by_module(__name__, __path__, "walk")
