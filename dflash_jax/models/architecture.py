"""The frozen target LM's configuration (the drafter's is models/drafter_config.py).

Frozen dataclasses read from a Hugging Face `config.json` by the target's family module
(models/families/), so a checkpoint directory fully determines the model that reads it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp

from dflash_jax.errors import ModelError

# Dtype names accepted by configs and command-line flags.
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}

# Token mixers a target layer can have (`TransformerConfig.layer_types`).
LAYER_TYPES = ("full_attention", "sliding_attention", "linear_attention")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    theta: float
    # "default", "llama3" or "yarn"; the other fields are read by the kinds that use them.
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192  # llama3, yarn
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    truncate: bool = True  # yarn: round the correction range to whole dimensions
    attention_factor: float = 1.0  # yarn: cos and sin are scaled by it
    partial_factor: float = 1.0  # the share of each head's dimensions that rotates (Qwen3.5: 0.25)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> RopeConfig:
        # transformers >= 5 writes `rope_parameters`; older checkpoints use rope_theta + rope_scaling.
        params = dict(hf.get("rope_parameters") or {})
        scaling = hf.get("rope_scaling") or {}
        theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
        merged = {**scaling, **params}
        kind = merged.get("rope_type", merged.get("type", "default"))
        partial = float(merged.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
        if kind in ("default", "proportional"):  # proportional: Gemma 4's full layers (layers.rope_inv_freq)
            return cls(theta=float(theta), kind=kind, partial_factor=partial)
        if kind == "llama3":
            return cls(
                theta=float(theta),
                kind="llama3",
                factor=float(merged["factor"]),
                low_freq_factor=float(merged["low_freq_factor"]),
                high_freq_factor=float(merged["high_freq_factor"]),
                original_max_position_embeddings=int(merged["original_max_position_embeddings"]),
                partial_factor=partial,
            )
        if kind == "yarn":
            original = int(merged.get("original_max_position_embeddings") or hf["max_position_embeddings"])
            factor = merged.get("factor") or hf["max_position_embeddings"] / original
            attention_factor = merged.get("attention_factor")
            if attention_factor is None:  # as the YaRN paper (and transformers) infer it
                mscale, mscale_all_dim = merged.get("mscale"), merged.get("mscale_all_dim")
                if mscale and mscale_all_dim:
                    attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
                else:
                    attention_factor = _yarn_mscale(factor)
            return cls(
                theta=float(theta),
                kind="yarn",
                factor=float(factor),
                original_max_position_embeddings=original,
                beta_fast=float(merged.get("beta_fast") or 32.0),
                beta_slow=float(merged.get("beta_slow") or 1.0),
                truncate=bool(merged.get("truncate", True)),
                attention_factor=float(attention_factor),
                partial_factor=partial,
            )
        raise ModelError(f"unsupported rope type {kind!r} (supported: default, proportional, llama3, yarn)")

    def to_hf(self) -> dict[str, Any]:
        """The `rope_theta` / `rope_scaling` fields as serving engines read them."""
        out: dict[str, Any] = {"rope_theta": self.theta}
        if self.partial_factor != 1.0:
            out["partial_rotary_factor"] = self.partial_factor
        if self.kind in _SCALING_FIELDS:
            out["rope_scaling"] = {"rope_type": self.kind, **{k: getattr(self, k) for k in _SCALING_FIELDS[self.kind]}}
        return out


# The fields of each rope scaling that `rope_scaling` spells out (with its rope_type).
_SCALING_FIELDS = {
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "truncate", "attention_factor"),
}


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclasses.dataclass(frozen=True)
class LinearAttentionConfig:
    """Gated DeltaNet layers (Qwen3.5 / Qwen3-Next): K key heads of H, K·G value heads of U."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel_size: int = 4

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> LinearAttentionConfig:
        return cls(
            num_k_heads=int(hf["linear_num_key_heads"]),
            num_v_heads=int(hf["linear_num_value_heads"]),
            head_k_dim=int(hf["linear_key_head_dim"]),
            head_v_dim=int(hf["linear_value_head_dim"]),
            conv_kernel_size=int(hf.get("linear_conv_kernel_dim", 4)),
        )


@dataclasses.dataclass(frozen=True)
class LatentAttentionConfig:
    """Multi-head latent attention (DeepSeek-V3, Kimi-K2; models/latent_attention.py): queries
    through a rank-`q_lora_rank` bottleneck (0: one q_proj), keys and values expanded from a
    rank-`kv_lora_rank` latent, per head N unrotated and R rotated query/key dims and U value dims."""

    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int  # N
    qk_rope_head_dim: int  # R
    v_head_dim: int  # U
    softmax_scale: float
    # The checkpoint rotates interleaved pairs of the rotary dims: their rows are reordered at load.
    rope_interleaved: bool = True

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> LatentAttentionConfig:
        """The MLA fields of a DeepSeek-V3 config.json. The softmax scale is (N + R)^-0.5, times
        YaRN's mscale(factor, mscale_all_dim)² where the RoPE is scaled and sets mscale_all_dim."""
        nope, rope = int(hf["qk_nope_head_dim"]), int(hf["qk_rope_head_dim"])
        scaling = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
        scale = (nope + rope) ** -0.5
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind != "default" and scaling.get("mscale_all_dim"):
            scale *= _yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"])) ** 2
        return cls(
            q_lora_rank=int(hf.get("q_lora_rank") or 0),
            kv_lora_rank=int(hf["kv_lora_rank"]),
            qk_nope_head_dim=nope,
            qk_rope_head_dim=rope,
            v_head_dim=int(hf["v_head_dim"]),
            softmax_scale=scale,
            rope_interleaved=bool(hf.get("rope_interleave", True)),
        )


# 'sigmoid_grouped' (DeepSeek-V3, MiniMax-M2): `moe.grouped_sigmoid_routing`.
ROUTERS = ("softmax_topk", "topk_softmax", "sigmoid_grouped")
ACTIVATIONS = ("swiglu", "clamped_swiglu", "geglu")


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """The MoE settings of a layer. Letters as in shape comments: E experts, A chosen per token,
    I expert intermediate size."""

    num_experts: int  # E
    num_experts_per_token: int  # A
    expert_intermediate_size: int  # I
    # 'softmax_topk' (Qwen): softmax over all experts, top-k, renormalized when norm_topk_prob;
    # 'topk_softmax' (gpt-oss): top-k of the logits, softmax over the chosen.
    router: str = "softmax_topk"
    norm_topk_prob: bool = True
    router_bias: bool = False
    expert_bias: bool = False
    # or 'clamped_swiglu' (gpt-oss), with the two settings below, or 'geglu' (Gemma 4: GELU-tanh gate)
    activation: str = "swiglu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    shared_expert_gate: bool = True  # Qwen: the shared expert scaled by sigmoid(shared_expert_gate(x)); DeepSeek: not
    # 'sigmoid_grouped': groups of experts, groups kept per token, the routing weights' factor.
    num_groups: int = 1
    groups_kept: int = 1
    routed_scaling_factor: float = 1.0

    def __post_init__(self):
        for name, value, allowed in (
            ("router", self.router, ROUTERS),
            ("activation", self.activation, ACTIVATIONS),
        ):
            if value not in allowed:
                raise ModelError(f"MoE {name} {value!r} is not supported (supported: {', '.join(allowed)})")
        if not 1 <= self.num_experts_per_token <= self.num_experts:
            raise ModelError(
                f"num_experts_per_token={self.num_experts_per_token} must be between 1 and "
                f"num_experts={self.num_experts}"
            )
        if self.num_experts % self.num_groups or not 1 <= self.groups_kept <= self.num_groups:
            raise ModelError(
                f"{self.num_experts} experts do not split into {self.num_groups} groups with {self.groups_kept} kept"
            )
        if self.expert_intermediate_size < 1 or self.shared_expert_intermediate_size < 0:
            raise ModelError(
                f"expert_intermediate_size={self.expert_intermediate_size} must be positive and "
                f"shared_expert_intermediate_size={self.shared_expert_intermediate_size} not negative"
            )


@dataclasses.dataclass(frozen=True)
class LayerAttention:
    """The attention of one kind of layer: head size, kv heads and RoPE; `values_from_keys` (Gemma
    4's full layers): no v_proj, k_proj's output serves as values."""

    head_dim: int
    num_kv_heads: int
    rope: RopeConfig
    values_from_keys: bool = False


# The decoder layer of every layer: 'pre_norm' (layers.DecoderBlock) or 'gemma4' (models/gemma.py:
# sandwich norms, Gemma's attention, experts beside the dense MLP, a layer scalar).
BLOCKS = ("pre_norm", "gemma4")
# The blocks whose MoE layers keep their dense MLP, the experts beside it (the others replace it).
EXPERTS_BESIDE_MLP = ("gemma4",)


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """A decoder-only LM built from per-layer specs. A family module (models/families/) reads one
    from a checkpoint's config.json; the defaults of the last fields are dense Qwen3's."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int  # the dense MLP's (layers without experts)
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope: RopeConfig
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    # The token mixer of every layer, as Hugging Face configs spell it; () = all full attention.
    layer_types: tuple[str, ...] = ()
    sliding_window: int = 0  # keys a 'sliding_attention' query sees (itself included)
    linear_attention: LinearAttentionConfig | None = None  # for the 'linear_attention' layers
    moe: MoeConfig | None = None
    moe_layers: tuple[int, ...] = ()  # the layers whose MLP is `moe`
    qk_norm: bool = True  # per-head RMSNorm on q and k before RoPE
    zero_centered_norm: bool = False  # every RMSNorm but the linear-attention one scales by 1 + w
    attention_output_gate: bool = False  # q_proj twice as wide: per head, q then a sigmoid output gate
    attention_bias: bool = False  # biases on q/k/v/o
    attention_sinks: bool = False  # a learned logit per head joins every softmax (its weight dropped)
    qk_norm_across_heads: bool = False  # q and k normalized over all their heads at once (MiniMax-M2)
    # Attention layers are multi-head latent attention (DeepSeek-V3); head_dim is then its R.
    latent_attention: LatentAttentionConfig | None = None
    block: str = "pre_norm"  # one of BLOCKS
    mlp_activation: str = "silu"  # the dense MLPs' gate: 'silu' (SwiGLU) or 'gelu_tanh' (Gemma)
    embedding_scale: float = 1.0  # embeddings times this, rounded to the parameter dtype (Gemma: sqrt(D))
    final_logit_softcap: float = 0.0  # > 0: logits = c · tanh(logits / c) (Gemma)
    full_attention: LayerAttention | None = None  # where the full layers' attention differs (Gemma 4)

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ModelError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if not self.layer_types:
            object.__setattr__(self, "layer_types", ("full_attention",) * self.num_layers)
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if len(self.layer_types) != self.num_layers:
            raise ModelError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown:
            raise ModelError(f"layer types {unknown} are not supported (supported: {', '.join(LAYER_TYPES)})")
        if "sliding_attention" in self.layer_types and self.sliding_window < 1:
            raise ModelError("sliding_attention layers need sliding_window >= 1")
        if "linear_attention" in self.layer_types and self.linear_attention is None:
            raise ModelError("linear_attention layers need the linear_* fields of the config")
        if self.moe_layers and self.moe is None:
            raise ModelError("moe_layers need the MoE fields of the config")
        if self.block not in BLOCKS:
            raise ModelError(f"block {self.block!r} is not supported (supported: {', '.join(BLOCKS)})")
        if self.latent_attention is not None and set(self.layer_types) - {"full_attention"}:
            raise ModelError("latent attention layers are full attention: no sliding or linear layers with them")


def has_dense_mlp(cfg: TransformerConfig, index: int) -> bool:
    """Whether layer `index` runs the dense MLP: a layer without experts, or one of a block that
    keeps it beside them."""
    return index not in cfg.moe_layers or cfg.block in EXPERTS_BESIDE_MLP


def layer_attention(cfg: TransformerConfig, layer_type: str) -> LayerAttention:
    """The head size, kv heads and RoPE of a `layer_type` attention layer of `cfg`."""
    if layer_type == "full_attention" and cfg.full_attention is not None:
        return cfg.full_attention
    return LayerAttention(cfg.head_dim, cfg.num_kv_heads, cfg.rope)


def layer_window(cfg: TransformerConfig, layer_type: str) -> int:
    """The keys a query of a `layer_type` layer sees: the sliding window on sliding layers, else 0 (all)."""
    return cfg.sliding_window if layer_type == "sliding_attention" else 0


def decoder_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """The fields target and drafter configs read alike from a Hugging Face config.json."""
    heads = int(hf["num_attention_heads"])
    return dict(
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf.get("intermediate_size") or 0),
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or hf["hidden_size"] // heads),
        rope=RopeConfig.from_hf(hf),
        rms_norm_eps=float(hf.get("rms_norm_eps", TransformerConfig.rms_norm_eps)),
        max_position_embeddings=int(hf.get("max_position_embeddings", TransformerConfig.max_position_embeddings)),
    )
