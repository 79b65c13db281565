"""What a drafter kind module declares (`Kind`): everything that sets one kind of drafter apart
from the DFlash backbone they share (docs/design.md "Drafter kinds").

A kind is one module of models/kinds/: its config fields with their defaults, the checks on them,
how its config.json is written and read (the serving engines' layout), its heads and the
partition rules of their parameters, its FLOP count, which slot drafts first, and what its loss
and its drafting walk are. models/kinds/__init__.py finds every such module; nothing else names
a kind. The loss terms and the drafting walk run in higher layers (training, decoding), which
models may not import: the record names them as 'module:function', imported by `Kind.part` when
those layers first ask.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Callable, Mapping
from typing import Any

# A config.json reader: field(name, default) -> the value in dflash_config, else at the top level.
FieldReader = Callable[[str, Any], Any]


def _none(*_) -> list:
    return []


def _no_heads(cfg, **_) -> dict:
    return {}


def _zero(*_) -> int:
    return 0  # an int: FLOP counts stay exact integers


@dataclasses.dataclass(frozen=True)
class Kind:
    """A drafter kind. `cfg` below is a `DrafterConfig` (models/drafter_config.py)."""

    name: str
    # config.json `architectures`: the one it is exported as, then other names that load as it.
    architectures: tuple[str, ...]
    # SpecForge's name for it in dflash_config's `projector_type`, which makes a config that says
    # the backbone's architecture (`DFlashDraftModel`) this kind; None: it has none.
    projector_type: str | None = None
    # Its trained sizes, with their defaults: fields of the training config's drafter section and
    # of `DrafterConfig` (which every kind's fields join, unused by the other kinds).
    fields: Mapping[str, int] = dataclasses.field(default_factory=dict)
    # What they mean, printed above them in the config's text (training/config/config_text.py).
    fields_doc: str = ""
    # Fields a released drafter's config.json may set and training never does (`DrafterConfig`
    # only); another kind's config must leave them at these defaults.
    release_fields: Mapping[str, float] = dataclasses.field(default_factory=dict)
    # The first block slot that drafts: 1 (slot k predicts the token at anchor + k; slot 0 holds
    # the anchor) or 0 (slot k predicts the token after it).
    first_draft_slot: int = 1
    # cfg -> a message for each field that cannot work.
    problems: Callable[[Any], list[str]] = _none
    # cfg -> (fields under config.json's dflash_config, fields at its top level).
    export: Callable[[Any], tuple[dict, dict]] = lambda cfg: ({}, {})
    # A released config.json's `FieldReader` -> a message for each layout of the kind's heads
    # that is not ours to load.
    unsupported: Callable[[FieldReader], list[str]] = _none
    # (cfg, mixer, mlp, rngs, **block arguments) -> the drafter layer; None: layers.DecoderBlock.
    layer: Callable[..., Any] | None = None
    # (cfg, compute_dtype=, init_std=, param_dtype=, rngs=) -> {attribute: head module} of the drafter.
    heads: Callable[..., dict] = _no_heads
    # (regex on a parameter path, logical axes) of its heads' parameters (models/sharding.py).
    partition_rules: tuple[tuple[str, tuple], ...] = ()
    # Multiply-adds per block token of a drafter layer beyond the backbone's: cfg -> count.
    layer_macs: Callable[[Any], float] = _zero
    # Forward FLOPs of its heads per scored slot: (cfg, vocab size) -> count.
    head_flops: Callable[[Any, int], float] = _zero
    # Training: the loss decay γ whatever the block size (0: the paper's for the block size);
    # the train.loss values it takes (() = all); whether its loss always reads the target's
    # next-token distribution (train.distill then does not apply); whether only the prefix of
    # scored slots before the first unscored one is scored.
    loss_decay_gamma: float = 0.0
    losses: tuple[str, ...] = ()
    reads_target_distribution: bool = False
    scores_prefix: bool = False
    # Whether its loss reads the target's embeddings of the tokens realised from the anchor on
    # (`Blocks.realised_embeds`, training/objective.py).
    embeds_realised_tokens: bool = False
    # Whether it has a confidence head, which a decoding confidence threshold reads.
    confidence_head: bool = False
    # 'module:function' of its loss terms, (drafter, unembed, hidden [R, N, Bk, D], blocks, cfg,
    # step) -> (Σ w·loss, slot weights [R, N, K], hits [R, N, K]) (training/objective.py), and of its
    # drafting walk, (vocab, drafter, hidden [B, Bk, D], anchor, sampling, key, confidence
    # threshold, the target's token embedding) -> (drafts [B, K], their logits [B, K, V], drafts
    # proposed [B]) (decoding/).
    loss_terms: str = "dflash_jax.training.objective:dflash_terms"
    walk: str = "dflash_jax.decoding.drafting:independent_walk"

    @property
    def architecture(self) -> str:
        """The config.json `architectures` entry the export writes."""
        return self.architectures[0]

    def part(self, which: str) -> Callable:
        """The function a 'module:function' field (`loss_terms`, `walk`) names."""
        return _imported(getattr(self, which))

    def read_fields(self, field: FieldReader) -> dict:
        """Its `fields` and `release_fields` from a released config.json (absent: the defaults)."""
        sizes = {name: int(field(name, default)) for name, default in self.fields.items()}
        released = {name: float(_given(field(name, default), default)) for name, default in self.release_fields.items()}
        return {**sizes, **released}


def _given(value, default):
    return default if value is None else value


@functools.cache
def _imported(path: str) -> Callable:
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)
