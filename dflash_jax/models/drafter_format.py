"""The drafter's config.json (docs/design.md §5, export format): the layout the serving engines
load for its kind (`Kind.architectures`, `Kind.export`), written by the export
(models/formats/hf.py) and read back from an export, a training checkpoint or a released drafter.

The fields every kind shares are a Qwen3 config as transformers writes it; the kind's own come
from its module (`Kind.export`, `Kind.read_fields`).
"""

from __future__ import annotations

from typing import Any

from dflash_jax.errors import ModelError
from dflash_jax.models import kinds
from dflash_jax.models.hf_config import decoder_fields, rope_fields


def write(cfg) -> dict[str, Any]:
    """The config.json of the `DrafterConfig` cfg."""
    kind = kinds.get(cfg.kind)
    kind_config, kind_fields = kind.export(cfg)
    return {
        "architectures": [kind.architecture],
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        **rope_fields(cfg.rope),
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": False,
        "attention_bias": False,
        # As transformers' Qwen3Config writes them: it drops sliding_window unless
        # use_sliding_window, and SpecForge and SGLang read the per-layer kinds.
        "layer_types": list(cfg.layer_types),
        "use_sliding_window": cfg.sliding_window > 0,
        "sliding_window": cfg.sliding_window or None,
        **({} if cfg.is_causal is None else {"is_causal": cfg.is_causal}),
        "block_size": cfg.block_size,
        "num_target_layers": cfg.num_target_layers,
        # After the fields every kind writes: a kind with variants names its own architecture here.
        **kind_fields,
        "dflash_config": {
            "mask_token_id": cfg.mask_token_id,
            "target_layer_ids": list(cfg.target_layer_ids),
            **kind_config,
        },
    }


def kind_of(hf: dict[str, Any]) -> kinds.Kind:
    """The kind of a drafter's config.json: its architecture's, or the one its dflash_config's
    `projector_type` names under the backbone's architecture."""
    archs = hf.get("architectures") or []
    found = [kinds.ARCHITECTURES[a] for a in archs if a in kinds.ARCHITECTURES]
    if not found:
        raise ModelError(
            f"not a DFlash drafter config (architectures={archs!r}, expected one of {sorted(kinds.ARCHITECTURES)})"
        )
    return _projected(found[0], (hf.get("dflash_config") or {}).get("projector_type"))


def read(hf: dict[str, Any]) -> dict[str, Any]:
    """The `DrafterConfig` fields of a drafter's config.json (absent ones keep their defaults)."""
    kind = kind_of(hf)
    dflash = hf.get("dflash_config") or {}

    def field(name, default=None):  # dflash_config first, then the top level (some kinds' place)
        return dflash.get(name, hf.get(name, default))

    missing = [k for k in ("mask_token_id", "target_layer_ids") if field(k) is None]
    if missing:
        raise ModelError(f"drafter config.json lacks the fields {missing} (in dflash_config or at the top level)")
    for problem in kind.unsupported(field):
        raise ModelError(problem)
    # Every kind drafts over the target's whole vocabulary (an EAGLE-style draft vocabulary maps
    # its own LM head's rows back to the target's, which no kind here has).
    draft_vocab = field("draft_vocab_size")
    if draft_vocab is not None and int(draft_vocab) != int(hf["vocab_size"]):
        raise ModelError(
            f"drafter config.json has draft_vocab_size={draft_vocab} and vocab_size={hf['vocab_size']}: "
            "drafters with a reduced draft vocabulary are not supported"
        )
    num_layers = int(hf["num_hidden_layers"])
    # Read as transformers' Qwen3Config reads them (what SpecForge and SGLang load).
    window = int(hf.get("sliding_window") or 0) if hf.get("use_sliding_window") else 0
    layer_types = hf.get("layer_types") or [
        "sliding_attention" if window and i >= hf.get("max_window_layers", 28) else "full_attention"
        for i in range(num_layers)
    ]
    if "sliding_attention" in layer_types and not window:
        raise ModelError(
            "drafter config.json has sliding_attention layers but no window: "
            "set use_sliding_window=true and a positive sliding_window"
        )
    # Ours and SGLang's at the top level; some released drafters only in dflash_config.
    block_size = field("block_size")
    return dict(
        **decoder_fields(hf),
        num_layers=num_layers,
        num_target_layers=int(hf["num_target_layers"]),
        target_layer_ids=tuple(int(i) for i in field("target_layer_ids")),
        mask_token_id=int(field("mask_token_id")),
        **({} if block_size is None else {"block_size": int(block_size)}),
        layer_types=tuple(layer_types),
        sliding_window=window,
        is_causal=hf.get("is_causal"),
        kind=kind.name,
        **kind.read_fields(field),
    )


def _projected(kind, projector_type):
    """The kind a config of architecture `kind` is, given its dflash_config `projector_type`:
    SpecForge trains some kinds as `DFlashDraftModel` with their projector_type. A projector this
    project does not know is refused, not dropped (its heads would be lost)."""
    if projector_type is None or projector_type == kind.projector_type:
        return kind
    if projector_type not in kinds.PROJECTOR_TYPES:
        raise ModelError(
            f"drafter config.json has projector_type={projector_type!r}: only "
            f"{', '.join(repr(p) for p in kinds.PROJECTOR_TYPES)} load (as their kinds), or none"
        )
    if kind.name != kinds.DEFAULT:
        raise ModelError(
            f"drafter config.json says {kind.architecture} with projector_type={projector_type!r}: "
            f"that projector belongs to kind {kinds.PROJECTOR_TYPES[projector_type].name!r}"
        )
    return kinds.PROJECTOR_TYPES[projector_type]
