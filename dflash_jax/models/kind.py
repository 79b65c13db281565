"""What a drafter kind module declares (`Kind`): everything that sets one kind of drafter apart
from the DFlash backbone they share (docs/design.md "Drafter kinds").

A kind is one module in each layer it touches, named after it:

    models/kinds/K.py      this record: its sizes (a dataclass `DrafterConfig` extends), checks,
                           config.json, heads, partition rules, FLOPs and what engines call it
    training/kinds/K.py    its loss terms (`terms`)
    decoding/kinds/K.py    its drafting walk (`walk`)

models/kinds/__init__.py lists the kinds; the training and decoding packages find their modules
by name, and tests/models/test_kind_registry.py checks that every kind has all three. Nothing
else names a kind.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

# A config.json reader: field(name, default) -> the value in dflash_config, else at the top level.
FieldReader = Callable[[str, Any], Any]
# Field metadata: a field that a released drafter's config.json may set and training never does
# (it is no field of the training config's drafter section).
RELEASED = {"released": True}


def _none(*_) -> list:
    return []


def _nothing(*_, **__) -> dict:
    return {}


def _zero(*_) -> int:
    return 0  # an int: FLOP counts stay exact integers


# Anchors as SpecForge draws them (up to 64 a conversation, about half of a response's
# positions): at most 64 a document, and 3 a row for every 8 of its tokens so that the cap, not the
# row, binds. `Kind(..., **PER_CONVERSATION_ANCHORS)` for a kind whose held-out τ gains from them.
PER_CONVERSATION_ANCHORS = dict(anchors_per_token=3 / 8, anchors_per_document=64)

# SpecForge's schedule: warmup over 1.5 % of the steps (the paper's 4 %), the gradient norm clipped
# at 0.5 (the paper's 1.0). `Kind(..., **SPECFORGE_SCHEDULE)` for a kind whose held-out τ gains from it.
SPECFORGE_SCHEDULE = dict(warmup_fraction=0.015, grad_clip_norm=0.5)


@dataclasses.dataclass(frozen=True, kw_only=True)
class NoFields:
    """The sizes of a kind that has none of its own (the backbone alone)."""


@dataclasses.dataclass(frozen=True)
class LlamaCpp:
    """How llama.cpp (b11434) serves a kind: its `--spec-type`, the GGUF metadata its loader reads
    beyond the backbone's and why an export cannot be served (both from the export's
    config.json), llama.cpp's names of the kind's own tensors (ours -> theirs; per layer: the
    names after `layers.{i}.`), and which of them are projections onto the vocabulary, whose rows
    a draft vocabulary cuts to its tokens."""

    spec_type: str
    metadata: Callable[[dict], dict] = _nothing
    problems: Callable[[dict], list[str]] = _none
    tensors: Mapping[str, str] = dataclasses.field(default_factory=dict)
    layer_tensors: Mapping[str, str] = dataclasses.field(default_factory=dict)
    vocab_rows: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Vllm:
    """How vLLM serves a kind: the `method` its `--speculative-config` names, why no vLLM release
    serves it (`refused`), and why its CPU build cannot (`cpu_refused`: that build runs the V1
    model runner, without what the kind needs)."""

    method: str = ""
    refused: str = ""
    cpu_refused: str = ""


@dataclasses.dataclass(frozen=True)
class Kind:
    """A drafter kind. `cfg` below is a `DrafterConfig` (models/drafter_config.py)."""

    name: str
    # config.json `architectures`: the one it is exported as, then other names that load as it.
    architectures: tuple[str, ...]
    # Its trained sizes with their defaults and meanings: a frozen keyword-only dataclass, which
    # `DrafterConfig` (and so the training config's drafter section) extends.
    fields: type = NoFields
    # Other kinds' fields it reads too (the sizes of another kind's layers it can be built on).
    borrowed_fields: tuple[str, ...] = ()
    # SpecForge's name for it in dflash_config's `projector_type`, which makes a config that says
    # the backbone's architecture (`DFlashDraftModel`) this kind; None: it has none.
    projector_type: str | None = None
    # The first block slot that drafts: 1 (slot k predicts the token at anchor + k; slot 0 holds
    # the anchor) or 0 (slot k predicts the token after it).
    first_draft_slot: int = 1
    # Whether decoding proposes the last slot's draft too (False: trained, never proposed, as
    # SpecForge decodes its shift-label drafters: a block of B verifies B tokens).
    drafts_last_slot: bool = True
    # (cfg, the target's hidden size) -> {field: value} for the sizes that follow the target
    # (those the config leaves at 0).
    sized_for_target: Callable[[Any, int], dict] = _nothing
    # cfg -> a message for each field that cannot work.
    problems: Callable[[Any], list[str]] = _none
    # cfg -> (fields under config.json's dflash_config, fields at its top level).
    export: Callable[[Any], tuple[dict, dict]] = lambda cfg: ({}, {})
    # A released config.json's `FieldReader` -> a message for each layout of the kind's heads
    # that is not ours to load.
    unsupported: Callable[[FieldReader], list[str]] = _none
    # A released config.json's `FieldReader` -> fields it implies without naming them (a variant
    # that its architecture alone names).
    implied_fields: Callable[[FieldReader], dict] = _nothing
    # (cfg, mixer, mlp, rngs, **block arguments) -> the drafter layer; None: layers.DecoderBlock.
    layer: Callable[..., Any] | None = None
    # (cfg, compute_dtype=, init_std=, param_dtype=, rngs=) -> {attribute: head module} of the drafter.
    heads: Callable[..., dict] = _nothing
    # (regex on a parameter path, logical axes) of its heads' parameters.
    partition_rules: tuple[tuple[str, tuple], ...] = ()
    # Multiply-adds per block token of a drafter layer beyond the backbone's: cfg -> count.
    layer_macs: Callable[[Any], float] = _zero
    # Forward FLOPs of its heads per scored slot: (cfg, vocab size) -> count.
    head_flops: Callable[[Any, int], float] = _zero
    # Its matrices that Muon leaves to AdamW (substrings of their parameter paths): token-indexed
    # tables and projections onto the vocabulary, as embeddings and LM heads are in Muon practice.
    # Their rows are looked up or scored one token at a time, not a linear map to orthogonalize,
    # and Newton-Schulz on a [V, r] matrix would cost more than the rest of the drafter's update.
    adam_params: tuple[str, ...] = ()
    # Training defaults: the slot weighting `train.loss` '' stands for, the loss decay γ
    # whatever the block size (0: the paper's for the block size), and D-PACE's smoothing α that
    # `train.dpace_alpha` -1 stands for (its paper's 0.5).
    loss: str = "dflash"
    loss_decay_gamma: float = 0.0
    dpace_alpha: float = 0.5
    # The anchors a row that `train.num_anchors` 0 stands for, per token of the row
    # (data.seq_len), and at most this many of them from one document (0: no cap).
    anchors_per_token: float = 1 / 8
    anchors_per_document: int = 0
    # The schedule that `train.warmup_fraction` -1 and `train.grad_clip_norm` 0 stand for (-1 and
    # 0 here too: the paper's, training/optim/optimizer.py).
    warmup_fraction: float = -1.0
    grad_clip_norm: float = 0.0
    # Whether its loss always reads the target's next-token distribution (train.distill then
    # does not apply); whether only the prefix of scored slots before the first unscored one is
    # scored; whether its loss reads the target's embeddings of the tokens realised from the
    # anchor on (`Blocks.realised_embeds`, training/objective.py).
    reads_target_distribution: bool = False
    scores_prefix: bool = False
    embeds_realised_tokens: bool = False
    # Whether it has a confidence head, which a decoding confidence threshold reads.
    confidence_head: bool = False
    # How llama.cpp serves it; None: llama.cpp does not.
    llama_cpp: LlamaCpp | None = None
    # How vLLM serves it, or why it does not.
    vllm: Vllm = Vllm(refused="vLLM has no method for it")

    @property
    def architecture(self) -> str:
        """The config.json `architectures` entry the export writes."""
        return self.architectures[0]

    def served_by(self) -> str:
        """The engines this project has seen serve its exports, or why vLLM does not (README
        "Serving" has the rest)."""
        engines = []
        if self.vllm.method:
            engines.append(f"vLLM's '{self.vllm.method}' method" + (" (GPU builds)" if self.vllm.cpu_refused else ""))
        if self.llama_cpp is not None:
            engines.append(f"llama.cpp's {self.llama_cpp.spec_type} (export --format=gguf)")
        if engines:
            return "served by " + " and ".join(engines)
        return f"{self.vllm.refused}; `dflash-jax evaluate` decodes it"

    def read_fields(self, field: FieldReader) -> dict:
        """Its fields from a released config.json (absent: their defaults)."""
        found = {}
        for f in dataclasses.fields(self.fields):
            value = field(f.name, None)
            found[f.name] = f.default if value is None else type(f.default)(value)
        borrowed = {name: field(name, None) for name in self.borrowed_fields}
        return {**found, **{k: v for k, v in borrowed.items() if v is not None}, **self.implied_fields(field)}
