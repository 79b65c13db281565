"""The DFlash drafter's configuration (docs/design.md §2): one frozen dataclass, each field declared once.

`DrafterConfig` is both the training config's drafter section and the drafter a model is built
from. As a section it holds what a run chooses, 0 / -1 / () standing for "from the target" (the
comment above each field says how); `for_target` resolves those against the target, takes the
target's own sizes (the `DERIVED` fields, which no config sets) and checks the whole, raising a
one-line ModelError. A released drafter's config.json is read straight into a resolved one
(models/drafter_format.py). The kinds' own sizes are the dataclasses `KindFields` gathers.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dflash_jax.errors import ModelError
from dflash_jax.field_checks import at_least, one_of
from dflash_jax.models import drafter_format, kinds
from dflash_jax.models.architecture import RopeConfig, TransformerConfig

# The drafter's mask token, looked up by name in the target tokenizer (mask_token_id=-1).
MASK_TOKEN = "<|MASK|>"
# Field metadata: taken from the target (or a config.json), never set by a training config.
DERIVED = {"derived": True}


def default_target_layer_ids(num_target_layers: int, num_context_layers: int) -> tuple[int, ...]:
    """docs/design.md §2: one layer read is the middle one; k layers are spread from 1 to L-3."""
    if num_context_layers == 1:
        return (num_target_layers // 2,)
    k = num_context_layers
    return tuple(int(round(1 + i * (num_target_layers - 4) / (k - 1))) for i in range(k))


def section_fields(cls) -> list[dataclasses.Field]:
    """The fields of a config section's dataclass that a training config sets: not those a
    drafter takes from its target (`DERIVED`) or only a released config.json sets (`kind.RELEASED`)."""
    return [f for f in dataclasses.fields(cls) if not f.metadata.keys() & {"derived", "released"}]


@dataclasses.dataclass(frozen=True, kw_only=True)
class DrafterConfig(kinds.KindFields):
    """The drafter: its kind, block size and shape; everything else follows the target (docs/design.md §2)."""

    # The drafter kind (docs/design.md "Drafter kinds"; models/kinds/__init__.py lists them).
    kind: str = kinds.DEFAULT
    # Tokens per block: the anchor and the positions drafted after it.
    block_size: int = 16
    num_layers: int = 5
    # Target layers whose hidden states the drafter reads; () = the docs/design.md §2 spread.
    target_layer_ids: tuple[int, ...] = ()
    # How many target layers the default spread reads when target_layer_ids is (); 0 = num_layers.
    num_context_layers: int = 0
    # -1 = the id of <|MASK|> in the target tokenizer.
    mask_token_id: int = -1
    # MLP width; 0 = the target's.
    intermediate_size: int = 0
    # Attention shape, independent of the target's (released drafters for Qwen3.5 use 32 x 128
    # over 8 kv heads on targets with 24 x 256 over 4); 0 = the target's.
    num_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    # Per layer 'full_attention' or 'sliding_attention' (released drafters: four sliding, then one
    # full); () = all full.
    layer_types: tuple[str, ...] = ()
    # Context positions a sliding layer's query sees, its own included (SpecForge's DFlash mask,
    # released drafters: 2048); 0 = none.
    sliding_window: int = 0
    # The target's (the drafter shares its embedding and LM head; RoPE without partial rotation).
    hidden_size: int = dataclasses.field(default=0, metadata=DERIVED)
    vocab_size: int = dataclasses.field(default=0, metadata=DERIVED)
    num_target_layers: int = dataclasses.field(default=0, metadata=DERIVED)
    rope: RopeConfig | None = dataclasses.field(default=None, metadata=DERIVED)
    rms_norm_eps: float = dataclasses.field(default=TransformerConfig.rms_norm_eps, metadata=DERIVED)
    max_position_embeddings: int = dataclasses.field(
        default=TransformerConfig.max_position_embeddings, metadata=DERIVED
    )
    # Causal attention inside the block (config.json `is_causal`): None = sliding layers causal
    # and full layers not (as in SpecForge's and z-lab's drafters); True / False = every layer.
    is_causal: bool | None = dataclasses.field(default=None, metadata=DERIVED)

    LAYER_TYPES = ("full_attention", "sliding_attention")  # a class constant: no annotation, no field

    def __post_init__(self):
        if self.resolved:
            object.__setattr__(self, "layer_types", tuple(self.layer_types) or ("full_attention",) * self.num_layers)
            for problem in self._problems():
                raise ModelError(problem)

    @property
    def resolved(self) -> bool:
        """Whether it has its target's sizes (else it is a config section's settings)."""
        return self.hidden_size > 0

    def problems(self) -> list[str]:
        """The checks of the config section alone: each sentinel's range (the rest needs the
        target, `for_target`)."""
        return one_of("drafter", self, kind=tuple(kinds.KINDS)) + at_least(
            "drafter",
            self,
            num_layers=1,
            block_size=2,
            mask_token_id=-1,
            intermediate_size=0,
            num_heads=0,
            num_kv_heads=0,
            head_dim=0,
            num_context_layers=0,
            sliding_window=0,
        )

    def _problems(self) -> list[str]:
        """Every check of a resolved drafter, in order; the first one found is raised."""
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
        problems = [  # the kinds' counts and sizes
            f"{f.name}={getattr(self, f.name)} must be at least 1"
            for f in section_fields(kind.fields)
            if isinstance(getattr(self, f.name), int) and getattr(self, f.name) < 1
        ]
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
    def num_scored(self) -> int:
        """Block slots that predict a token (trained): those from the kind's first draft slot on."""
        return self.block_size - self.first_draft_slot

    @property
    def num_drafts(self) -> int:
        """Draft tokens decoding proposes per block."""
        return self.num_scored - (0 if self.kind_spec.drafts_last_slot else 1)

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
    def for_target(cls, target: TransformerConfig, settings: DrafterConfig | None = None, **fields) -> DrafterConfig:
        """The drafter `settings` (a config section; else one of `fields`) describe, for `target`:
        its hidden size, vocabulary and RoPE (without partial rotation: the drafter's layers are
        Qwen3's) are the target's, and so, where the settings say 0 / (), its head layout, MLP
        width, target layers read (`num_context_layers` of them, default one per drafter layer,
        spread over the target) and the kind's sizes that follow the target. Other kinds' sizes
        go back to their defaults."""
        s = settings if settings is not None else cls(**fields)
        if s.mask_token_id < 0:
            raise ModelError("mask_token_id=-1 must be resolved from the target tokenizer first")
        if target.intermediate_size == 0 and not s.intermediate_size:
            raise ModelError("intermediate_size=0 copies the target's dense MLP width, and it has none: set it")
        kind = kinds.get(s.kind)
        own = {f.name for f in dataclasses.fields(kind.fields)} | set(kind.borrowed_fields)
        others = {f.name: f.default for f in dataclasses.fields(kinds.KindFields) if f.name not in own}
        context_layers = s.num_context_layers or s.num_layers
        return dataclasses.replace(
            s,
            hidden_size=target.hidden_size,
            intermediate_size=s.intermediate_size or target.intermediate_size,
            num_heads=s.num_heads or target.num_heads,
            num_kv_heads=s.num_kv_heads or target.num_kv_heads,
            head_dim=s.head_dim or target.head_dim,
            rope=dataclasses.replace(target.rope, partial_factor=1.0),
            vocab_size=target.vocab_size,
            num_target_layers=target.num_layers,
            target_layer_ids=tuple(s.target_layer_ids or default_target_layer_ids(target.num_layers, context_layers)),
            num_context_layers=0,
            rms_norm_eps=target.rms_norm_eps,
            max_position_embeddings=target.max_position_embeddings,
            # Another kind's sizes do not apply (a config may switch kinds and keep them set).
            **others,
            **kind.sized_for_target(s, target.hidden_size),
        )

    def to_hf(self) -> dict[str, Any]:
        """Its config.json (models/drafter_format.py)."""
        return drafter_format.write(self)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> DrafterConfig:
        """The drafter a config.json describes (models/drafter_format.py)."""
        return cls(**drafter_format.read(hf))
