"""The frozen target LM's configuration (the drafter's is models/drafter_config.py): plain frozen
dataclasses, which a target's family module (models/families/) fills from its config.json
(models/hf_config.py reads the fields families share), so a checkpoint directory fully
determines the model that reads it.
"""

from __future__ import annotations

import dataclasses

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


@dataclasses.dataclass(frozen=True)
class LinearAttentionConfig:
    """Gated DeltaNet layers (Qwen3.5 / Qwen3-Next): K key heads of H, K·G value heads of U."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel_size: int = 4


@dataclasses.dataclass(frozen=True)
class LatentAttentionConfig:
    """Multi-head latent attention (DeepSeek-V3, Kimi-K2; models/layers/latent_attention.py): queries
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


# `TransformerConfig.block` of the shared decoder layer (layers.DecoderBlock: pre-norm mixer and MLP).
PRE_NORM = "pre_norm"


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
    # The decoder layer of every layer: PRE_NORM, or the name of the family whose own layer it is
    # (its `Family.layer`, models/family.py).
    block: str = PRE_NORM
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
        if self.latent_attention is not None and set(self.layer_types) - {"full_attention"}:
            raise ModelError("latent attention layers are full attention: no sliding or linear layers with them")


def layer_attention(cfg: TransformerConfig, layer_type: str) -> LayerAttention:
    """The head size, kv heads and RoPE of a `layer_type` attention layer of `cfg`."""
    if layer_type == "full_attention" and cfg.full_attention is not None:
        return cfg.full_attention
    return LayerAttention(cfg.head_dim, cfg.num_kv_heads, cfg.rope)


def layer_window(cfg: TransformerConfig, layer_type: str) -> int:
    """The keys a query of a `layer_type` layer sees: the sliding window on sliding layers, else 0 (all)."""
    return cfg.sliding_window if layer_type == "sliding_attention" else 0
