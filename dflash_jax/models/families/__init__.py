"""The registry of target families: every module of this package is one family.

A family module defines `FAMILY = Family(...)` (models/family.py): how its config.json reads and
where its weights live on the hub. The loader (models/formats/hf.py), the memory plan and the
training config (through `target_config`), the target model (a family's own decoder layer,
`decoder_layer`) and the error for an unknown architecture read this registry, which imports every
module here at start-up; adding a family is adding its module.
"""

from __future__ import annotations

from typing import Any

from dflash_jax.errors import ModelError
from dflash_jax.models import registry
from dflash_jax.models.architecture import PRE_NORM, TransformerConfig
from dflash_jax.models.family import DecoderLayer, Family, text_fields
from dflash_jax.models.weight_maps import WeightMap

FAMILIES: dict[str, Family] = registry.discover(__name__, __path__, "FAMILY")
# Hub class (config.json `architectures`) -> its family.
ARCHITECTURES = {arch: family for family in FAMILIES.values() for arch in family.architectures}
# GGUF `general.architecture` -> how a file of it reads as a family (models/formats/gguf.py).
GGUF_ARCHITECTURES = {name: arch for family in FAMILIES.values() for name, arch in family.gguf.items()}


def supported() -> str:
    return ", ".join(sorted(ARCHITECTURES))


def find(hf: dict[str, Any]) -> tuple[Family, str]:
    """(family, hub class) of a checkpoint's config.json; a one-line ModelError naming what is
    supported when no family reads it."""
    known = [a for a in hf.get("architectures") or () if a in ARCHITECTURES]
    if not known:
        named = hf.get("architectures") or hf.get("model_type")
        raise ModelError(f"unsupported target architecture {named!r}; supported: {supported()}")
    return ARCHITECTURES[known[0]], known[0]


def target_config(hf: dict[str, Any]) -> TransformerConfig:
    """The target a checkpoint's config.json describes."""
    family, _ = find(hf)
    return family.config(text_fields(hf))


def weight_map(hf: dict[str, Any]) -> WeightMap:
    """Where the weights of the checkpoint whose config.json is `hf` live."""
    family, architecture = find(hf)
    return family.weight_map(architecture)


def decoder_layer(cfg: TransformerConfig) -> DecoderLayer | None:
    """The family's own decoder layer that `cfg.block` names; None for the shared pre-norm block."""
    if cfg.block == PRE_NORM:
        return None
    family = FAMILIES.get(cfg.block)
    if family is None or family.layer is None:
        own = sorted(name for name, family in FAMILIES.items() if family.layer is not None)
        raise ModelError(f"block {cfg.block!r} is not supported (supported: {', '.join([PRE_NORM, *own])})")
    return family.layer
