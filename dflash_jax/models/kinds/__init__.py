"""The registry of drafter kinds: every module of this package is one kind.

A kind module defines `KIND = Kind(...)` (models/kind.py): what it adds to the DFlash backbone
that every kind shares. The drafter's config (its fields, checks and config.json), the drafter
module, the training objective, the FLOP count and the speculative decoder read this registry,
which imports every module here at start-up; adding a kind is adding its module.
"""

from __future__ import annotations

from dflash_jax.errors import ModelError
from dflash_jax.models import registry
from dflash_jax.models.kind import Kind

KINDS: dict[str, Kind] = registry.discover(__name__, __path__, "KIND")
# The kind a drafter is unless its config says otherwise: the backbone alone.
DEFAULT = "dflash"
# config.json `architectures` entry -> its kind.
ARCHITECTURES = {arch: kind for kind in KINDS.values() for arch in kind.architectures}
# dflash_config `projector_type` -> its kind (SpecForge names some kinds so, under the backbone's
# architecture).
PROJECTOR_TYPES = {kind.projector_type: kind for kind in KINDS.values() if kind.projector_type}
# Every kind's trained sizes and released-only fields, with their defaults, in registry order.
SIZE_FIELDS = {name: default for kind in KINDS.values() for name, default in kind.fields.items()}
RELEASE_FIELDS = {name: default for kind in KINDS.values() for name, default in kind.release_fields.items()}


def get(name: str) -> Kind:
    """The kind called `name`; a one-line ModelError naming the kinds there are."""
    if name not in KINDS:
        raise ModelError(f"kind={name!r} is not one of {', '.join(KINDS)}")
    return KINDS[name]


def confidence_problem(name: str) -> str | None:
    """Why a confidence threshold does not apply to a `name` drafter (None: it does): it reads
    a confidence head, which only some kinds have."""
    if get(name).confidence_head:
        return None
    having = " / ".join(repr(k.name) for k in KINDS.values() if k.confidence_head)
    return f"applies to drafter.kind={having} only (this drafter is {name!r})"
