"""Model configurations: the frozen target LM and the DFlash drafter.

Both are frozen dataclasses that round-trip through Hugging Face `config.json` dicts, so a
checkpoint directory fully determines the model that reads it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

# Dtype names accepted by configs and command-line flags.
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}

# Token mixers a target layer can have (`TransformerConfig.layer_types`).
LAYER_TYPES = ("full_attention",)

# Architectures the target loader understands, mapped to whether they use per-head q/k RMSNorm.
SUPPORTED_TARGET_ARCHITECTURES = {
    "Qwen3ForCausalLM": True,
    "LlamaForCausalLM": False,
}


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    theta: float
    # "default" or "llama3"; the llama3 fields are only read for that type.
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> RopeConfig:
        # transformers >= 5 writes `rope_parameters`; older checkpoints use rope_theta + rope_scaling.
        params = dict(hf.get("rope_parameters") or {})
        scaling = hf.get("rope_scaling") or {}
        theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
        merged = {**scaling, **params}
        kind = merged.get("rope_type", merged.get("type", "default"))
        if kind not in ("default", "llama3"):
            raise ValueError(f"unsupported rope type {kind!r} (supported: default, llama3)")
        if kind == "default":
            return cls(theta=float(theta))
        return cls(
            theta=float(theta),
            kind="llama3",
            factor=float(merged["factor"]),
            low_freq_factor=float(merged["low_freq_factor"]),
            high_freq_factor=float(merged["high_freq_factor"]),
            original_max_position_embeddings=int(merged["original_max_position_embeddings"]),
        )

    def to_hf(self) -> dict[str, Any]:
        """The `rope_theta` / `rope_scaling` fields as serving engines read them."""
        out: dict[str, Any] = {"rope_theta": self.theta}
        if self.kind == "llama3":
            out["rope_scaling"] = {
                "rope_type": "llama3",
                "factor": self.factor,
                "low_freq_factor": self.low_freq_factor,
                "high_freq_factor": self.high_freq_factor,
                "original_max_position_embeddings": self.original_max_position_embeddings,
            }
        return out


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """A dense decoder-only LM of the Qwen3 or Llama-3 family."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope: RopeConfig
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qk_norm: bool = True
    max_position_embeddings: int = 32768
    architecture: str = "Qwen3ForCausalLM"
    # The token mixer of every layer, as Hugging Face configs spell it; () = all full attention.
    layer_types: tuple[str, ...] = ()

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if not self.layer_types:
            object.__setattr__(self, "layer_types", ("full_attention",) * self.num_layers)
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"layer types {unknown} are not supported (supported: {', '.join(LAYER_TYPES)})")

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> TransformerConfig:
        archs = hf.get("architectures") or []
        known = [a for a in archs if a in SUPPORTED_TARGET_ARCHITECTURES]
        if not known:
            raise ValueError(
                f"unsupported target architecture {archs or hf.get('model_type')!r}; "
                f"supported: {sorted(SUPPORTED_TARGET_ARCHITECTURES)}"
            )
        if hf.get("attention_bias") or hf.get("mlp_bias"):
            raise ValueError("attention/MLP biases are not supported (Qwen3 and Llama-3 have none)")
        arch = known[0]
        return cls(
            **_decoder_fields(hf),
            num_layers=int(hf["num_hidden_layers"]),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qk_norm=SUPPORTED_TARGET_ARCHITECTURES[arch],
            architecture=arch,
            layer_types=tuple(hf.get("layer_types") or ()),
        )


def _decoder_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """The fields target and drafter configs read alike from a Hugging Face config.json."""
    heads = int(hf["num_attention_heads"])
    return dict(
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]),
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or hf["hidden_size"] // heads),
        rope=RopeConfig.from_hf(hf),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
    )


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """docs/design.md §2: one drafter layer reads the middle layer; k layers are spread from 1 to L-3."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    k = num_draft_layers
    return tuple(int(round(1 + i * (num_target_layers - 4) / (k - 1))) for i in range(k))


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
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
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
        if bad or not self.target_layer_ids:
            raise ValueError(
                f"target_layer_ids {list(self.target_layer_ids)} must be non-empty and within "
                f"[0, {self.num_target_layers}) (the target has {self.num_target_layers} layers)"
            )
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"mask_token_id={self.mask_token_id} is not a row of the target embedding "
                f"(vocab_size={self.vocab_size}); pick an existing reserved token"
            )
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")

    @property
    def num_context_features(self) -> int:
        return len(self.target_layer_ids)

    @classmethod
    def for_target(
        cls,
        target: TransformerConfig,
        *,
        num_layers: int,
        mask_token_id: int,
        block_size: int = 16,
        target_layer_ids: tuple[int, ...] | None = None,
        intermediate_size: int | None = None,
    ) -> DrafterConfig:
        """The paper's default: the target's hidden size and head layout."""
        return cls(
            hidden_size=target.hidden_size,
            intermediate_size=intermediate_size or target.intermediate_size,
            num_layers=num_layers,
            num_heads=target.num_heads,
            num_kv_heads=target.num_kv_heads,
            head_dim=target.head_dim,
            rope=target.rope,
            vocab_size=target.vocab_size,
            num_target_layers=target.num_layers,
            target_layer_ids=tuple(target_layer_ids or default_target_layer_ids(target.num_layers, num_layers)),
            mask_token_id=mask_token_id,
            block_size=block_size,
            rms_norm_eps=target.rms_norm_eps,
            max_position_embeddings=target.max_position_embeddings,
        )

    def to_hf(self) -> dict[str, Any]:
        """The `config.json` of docs/design.md §5 (export format)."""
        return {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            **self.rope.to_hf(),
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": False,
            "attention_bias": False,
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "dflash_config": {
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": list(self.target_layer_ids),
            },
        }

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> DrafterConfig:
        if "DFlashDraftModel" not in (hf.get("architectures") or []):
            raise ValueError(
                f"not a DFlash drafter config (architectures={hf.get('architectures')!r}, "
                "expected ['DFlashDraftModel'])"
            )
        dflash = hf.get("dflash_config") or {}
        missing = [k for k in ("mask_token_id", "target_layer_ids") if k not in dflash]
        if missing:
            raise ValueError(f"drafter config.json lacks dflash_config fields {missing}")
        return cls(
            **_decoder_fields(hf),
            num_layers=int(hf["num_hidden_layers"]),
            num_target_layers=int(hf["num_target_layers"]),
            target_layer_ids=tuple(int(i) for i in dflash["target_layer_ids"]),
            mask_token_id=int(dflash["mask_token_id"]),
            block_size=int(hf.get("block_size", 16)),
        )
