"""Each drafter kind's loss terms: one module per kind, named as the kind (models/kinds/), whose
`terms(drafter, unembed, hidden [R, N, Bk, D], blocks, cfg, step)` returns (Σ w·loss, slot weights
[R, N, K], hits [R, N, K]) for training/loss.py (training/objective.py has the pieces they share)."""

from __future__ import annotations

from dflash_jax.models import registry

TERMS = registry.by_module(__name__, __path__, "terms")
