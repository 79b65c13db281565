"""The DFlash drafter's configuration (docs/design.md §2): a frozen dataclass, checked once.

`DrafterHeads` holds the drafter's kind, its block size and every kind's head sizes with their
defaults (models/kinds/): the training config's drafter section (training/config/sections.py) and
`DrafterConfig` both extend it, so each default is written once. `DrafterConfig` adds the shape
the drafter takes from its target and checks all of it, raising a one-line ModelError; its
config.json is models/drafter_format.py's.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dflash_jax.errors import ModelError
from dflash_jax.models import drafter_format, kinds
from dflash_jax.models.architecture import RopeConfig, TransformerConfig

# The drafter's mask token, looked up by name in the target tokenizer (drafter.mask_token_id=-1).
MASK_TOKEN = "<|MASK|>"


def _fields_class(name: str, fields: dict[str, Any], docs: dict[str, str], base: type | None = None) -> type:
    """A frozen keyword-only dataclass of `fields` (name -> default), typed as their defaults;
    `docs`: the comment above a field, kept in its metadata (the class has no source to read)."""
    spec = [
        (field, type(default), dataclasses.field(default=default, metadata={"doc": docs.get(field, "")}))
        for field, default in fields.items()
    ]
    cls = dataclasses.make_dataclass(name, spec, bases=(base,) if base else (), frozen=True, kw_only=True)
    cls.__module__ = __name__
    return cls


# The drafter's kind, its block size, then every kind's head sizes (each kind's module declares
# them); the comments are what the config's text prints above them.
DrafterHeads = _fields_class(
    "DrafterHeads",
    {"kind": kinds.DEFAULT, "block_size": 16, **kinds.SIZE_FIELDS},
    {
        "kind": f'docs/design.md "Drafter kinds": {", ".join(kinds.KINDS)} (models/kinds/, a module each).',
        "block_size": "Tokens per block: the anchor and the positions drafted after it.",
        **{next(iter(k.fields)): f"{k.name!r}: {k.fields_doc}" for k in kinds.KINDS.values() if k.fields},
    },
)
# The fields a released drafter's config.json may set and training never does.
_ReleasedHeads = _fields_class("ReleasedHeads", kinds.RELEASE_FIELDS, {}, DrafterHeads)
DEFAULTS = _ReleasedHeads()


def default_target_layer_ids(num_target_layers: int, num_context_layers: int) -> tuple[int, ...]:
    """docs/design.md §2: one layer read is the middle one; k layers are spread from 1 to L-3."""
    if num_context_layers == 1:
        return (num_target_layers // 2,)
    k = num_context_layers
    return tuple(int(round(1 + i * (num_target_layers - 4) / (k - 1))) for i in range(k))


@dataclasses.dataclass(frozen=True)
class DrafterConfig(_ReleasedHeads):
    """A DFlash drafter: Qwen3-style layers over target features, sharing the target's E and W."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope: RopeConfig
    vocab_size: int
    num_target_layers: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    # The target's (`for_target`); by default TransformerConfig's.
    rms_norm_eps: float = TransformerConfig.rms_norm_eps
    max_position_embeddings: int = TransformerConfig.max_position_embeddings
    # The attention of every layer: 'full_attention' or 'sliding_attention'; () = all full.
    layer_types: tuple[str, ...] = ()
    # Positions a sliding layer's query sees, its own included (SpecForge's DFlash mask); 0 = none.
    sliding_window: int = 0
    # Causal attention inside the block: None = sliding layers causal and full layers not (as in
    # SpecForge's and z-lab's drafters); True / False = every layer (config.json `is_causal`).
    is_causal: bool | None = None

    LAYER_TYPES = ("full_attention", "sliding_attention")  # a class constant: no annotation, no field

    def __post_init__(self):
        object.__setattr__(self, "layer_types", tuple(self.layer_types) or ("full_attention",) * self.num_layers)
        for problem in self._problems():
            raise ModelError(problem)

    def _problems(self) -> list[str]:
        """Every check of the drafter's fields, in order; the first one found is raised."""
        if self.num_heads % self.num_kv_heads:
            return [f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"]
        if len(self.layer_types) != self.num_layers:
            return [f"layer_types has {len(self.layer_types)} entries for num_layers={self.num_layers}"]
        unknown = sorted(set(self.layer_types) - set(self.LAYER_TYPES))
        if unknown:
            return [f"layer_types {unknown} are not supported (supported: {', '.join(self.LAYER_TYPES)})"]
        if self.sliding_window < 0:
            return [f"sliding_window={self.sliding_window} must be at least 0 (0 = none)"]
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            return ["sliding_window=0: sliding_attention layers need a sliding_window > 0"]
        if self.is_causal is not None and not isinstance(self.is_causal, bool):
            return [f"is_causal={self.is_causal!r} must be true, false or absent"]
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
        if bad or not self.target_layer_ids:
            return [
                f"target_layer_ids {list(self.target_layer_ids)}: {bad or 'none'} out of range, the target has "
                f"{self.num_target_layers} layers (valid ids 0..{self.num_target_layers - 1})"
            ]
        if not 0 <= self.mask_token_id < self.vocab_size:
            return [
                f"mask_token_id={self.mask_token_id} is outside the target vocabulary "
                f"(vocab_size={self.vocab_size}); use an existing reserved token such as {MASK_TOKEN}"
            ]
        if self.block_size < 2:
            return [f"block_size={self.block_size} must be at least 2"]
        if self.kind not in kinds.KINDS:
            return [f"kind={self.kind!r} is not one of {', '.join(kinds.KINDS)}"]
        kind = kinds.KINDS[self.kind]
        problems = [
            f"{name}={getattr(self, name)} must be at least 1" for name in kind.fields if getattr(self, name) < 1
        ]
        for other in kinds.KINDS.values():
            if other is not kind and any(getattr(self, n) != d for n, d in other.release_fields.items()):
                problems.append(f"{' and '.join(other.release_fields)} are {other.name!r} options, not {self.kind!r}")
        return problems + kind.problems(self)

    @property
    def kind_spec(self) -> kinds.Kind:
        """What the drafter's kind adds to the backbone (models/kinds/)."""
        return kinds.KINDS[self.kind]

    @property
    def num_context_features(self) -> int:
        return len(self.target_layer_ids)

    @property
    def first_draft_slot(self) -> int:
        """The first block slot that drafts (the kind's)."""
        return self.kind_spec.first_draft_slot

    @property
    def num_drafts(self) -> int:
        """Draft tokens per block."""
        return self.block_size - self.first_draft_slot

    @property
    def verify_size(self) -> int:
        """Tokens the target verifies per step: the anchor and the drafts (the longest acceptance)."""
        return self.num_drafts + 1

    def attention_pattern(self, layer: int) -> tuple[int, bool]:
        """(window, causal) of a layer's block attention (SpecForge's DFlash mask): a query at
        block offset o of a layer with window W > 0 sees the context keys at anchor + o - (W - 1)
        and later; with causal, its own block's keys at offsets up to o. (0, False): all the
        context before the anchor and the whole block."""
        sliding = self.layer_types[layer] == "sliding_attention"
        return (self.sliding_window if sliding else 0), (sliding if self.is_causal is None else self.is_causal)

    @classmethod
    def for_target(
        cls,
        target: TransformerConfig,
        *,
        num_layers: int,
        mask_token_id: int,
        target_layer_ids: tuple[int, ...] | None = None,
        intermediate_size: int | None = None,
        num_heads: int | None = None,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        num_context_layers: int | None = None,
        **fields,
    ) -> DrafterConfig:
        """The target's hidden size (the drafter shares its embedding and LM head) and, unless
        given, its head layout and MLP width (the paper's default). The default target layers
        read are `num_context_layers` (default: one per drafter layer) spread over the target.
        RoPE is the target's, without partial rotation (the drafter's layers are Qwen3's).
        `fields`: the others of `DrafterConfig` (kind, block_size, the kind's sizes, layer_types,
        sliding_window, ...), else their defaults."""
        if target.intermediate_size == 0 and not intermediate_size:
            raise ModelError("intermediate_size=0 copies the target's dense MLP width, and it has none: set it")
        context_layers = num_context_layers or num_layers
        return cls(
            hidden_size=target.hidden_size,
            intermediate_size=intermediate_size or target.intermediate_size,
            num_layers=num_layers,
            num_heads=num_heads or target.num_heads,
            num_kv_heads=num_kv_heads or target.num_kv_heads,
            head_dim=head_dim or target.head_dim,
            rope=dataclasses.replace(target.rope, partial_factor=1.0),
            vocab_size=target.vocab_size,
            num_target_layers=target.num_layers,
            target_layer_ids=tuple(target_layer_ids or default_target_layer_ids(target.num_layers, context_layers)),
            mask_token_id=mask_token_id,
            rms_norm_eps=target.rms_norm_eps,
            max_position_embeddings=target.max_position_embeddings,
            **fields,
        )

    def to_hf(self) -> dict[str, Any]:
        """Its config.json (models/drafter_format.py)."""
        return drafter_format.write(self)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> DrafterConfig:
        """The drafter a config.json describes (models/drafter_format.py)."""
        return cls(**drafter_format.read(hf))
