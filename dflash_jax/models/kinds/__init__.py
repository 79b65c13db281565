"""The registry of drafter kinds: each module of this package is one kind, listed here.

A kind module defines `KIND = Kind(...)` (models/kind.py): what it adds to the DFlash backbone
that every kind shares, and its sizes as a dataclass that `KindFields` (and so `DrafterConfig`)
extends. Its loss terms and drafting walk are modules of the same name in training/kinds/ and
decoding/kinds/. Adding a kind is adding its three modules and its line here.
"""

from __future__ import annotations

import dataclasses

from dflash_jax.errors import ModelError
from dflash_jax.models.kind import Kind
from dflash_jax.models.kinds.dflash import KIND as DFLASH
from dflash_jax.models.kinds.dflash2 import KIND as DFLASH2
from dflash_jax.models.kinds.dflash2 import DFlash2Fields
from dflash_jax.models.kinds.domino import KIND as DOMINO
from dflash_jax.models.kinds.domino import DominoFields
from dflash_jax.models.kinds.dspark import KIND as DSPARK
from dflash_jax.models.kinds.dspark import DSparkFields
from dflash_jax.models.kinds.xpress import KIND as XPRESS
from dflash_jax.models.kinds.xpress import XPressFields

KINDS: dict[str, Kind] = {kind.name: kind for kind in (DFLASH, DFLASH2, DSPARK, DOMINO, XPRESS)}
# The kind a drafter is unless its config says otherwise: the backbone alone.
DEFAULT = DFLASH.name
# config.json `architectures` entry -> its kind.
ARCHITECTURES = {arch: kind for kind in KINDS.values() for arch in kind.architectures}
# dflash_config `projector_type` -> its kind (SpecForge names some kinds so, under the backbone's
# architecture).
PROJECTOR_TYPES = {kind.projector_type: kind for kind in KINDS.values() if kind.projector_type}


@dataclasses.dataclass(frozen=True, kw_only=True)
class KindFields(DFlash2Fields, DSparkFields, DominoFields, XPressFields):
    """Every kind's sizes, with their defaults: a drafter of one kind leaves the others' alone."""


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
