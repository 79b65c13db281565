"""Model configurations: the frozen target LM and the DFlash drafter.

Both are frozen dataclasses read from Hugging Face `config.json` dicts, so a checkpoint directory
fully determines the model that reads it: the drafter's round-trips through its own; the target's
is read by its family's module (models/families/).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp

from dflash_jax.errors import ModelError

# Dtype names accepted by configs and command-line flags.
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}

# Drafter kinds (docs/design.md "Drafter kinds"): DFlash; DFlash2 (z-lab: grouped dynamic
# convolutions and a candidate selector); DSpark (DeepSeek: a Markov head and a confidence head).
DRAFTER_KINDS = ("dflash", "dflash2", "dspark")
# The fields of `DrafterConfig` that size each kind's heads, which training configs set.
KIND_FIELDS = {
    "dflash": (),
    "dflash2": ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"),
    "dspark": ("markov_rank",),
}

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
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
    )


def default_target_layer_ids(num_target_layers: int, num_context_layers: int) -> tuple[int, ...]:
    """docs/design.md §2: one layer read is the middle one; k layers are spread from 1 to L-3."""
    if num_context_layers == 1:
        return (num_target_layers // 2,)
    k = num_context_layers
    return tuple(int(round(1 + i * (num_target_layers - 4) / (k - 1))) for i in range(k))


@dataclasses.dataclass(frozen=True, kw_only=True)
class DrafterHeads:
    """The drafter's kind and the sizes of its heads, defaulted once for the training config's
    drafter section and `DrafterConfig`, which both extend it."""

    # docs/design.md "Drafter kinds": 'dflash'; 'dflash2' (z-lab: grouped dynamic convolutions
    # around every sublayer and a candidate selector); 'dspark' (DeepSeek: a Markov head and a
    # confidence head; every slot of the block drafts the token after it).
    kind: str = "dflash"
    # 'dflash2': per layer two grouped dynamic convolutions of K taps over groups of g channels,
    # and a candidate selector of rank r over the top-k unary logits.
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16
    # 'dspark': rank of the Markov head (and the previous token's part of the confidence input).
    markov_rank: int = 256


@dataclasses.dataclass(frozen=True)
class DrafterConfig(DrafterHeads):
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
    # The attention of every layer: 'full_attention' or 'sliding_attention'; () = all full.
    layer_types: tuple[str, ...] = ()
    # Positions a sliding layer's query sees, its own included (SpecForge's DFlash mask); 0 = none.
    sliding_window: int = 0
    # Causal attention inside the block: None = sliding layers causal and full layers not (as in
    # SpecForge's and z-lab's drafters); True / False = every layer (config.json `is_causal`).
    is_causal: bool | None = None
    # 'dflash2': the unary logits scaled by output_multiplier and soft-capped at
    # final_logit_softcapping (0 = none), as z-lab's released drafters ask (training leaves both off).
    output_multiplier: float = 1.0
    final_logit_softcapping: float = 0.0

    LAYER_TYPES = ("full_attention", "sliding_attention")  # a class constant: no annotation, no field

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        object.__setattr__(self, "layer_types", tuple(self.layer_types) or ("full_attention",) * self.num_layers)
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for num_layers={self.num_layers}")
        unknown = sorted(set(self.layer_types) - set(self.LAYER_TYPES))
        if unknown:
            raise ValueError(
                f"drafter layer types {unknown} are not supported (supported: {', '.join(self.LAYER_TYPES)})"
            )
        if self.sliding_window < 0:
            raise ValueError(f"sliding_window must be >= 0 (0 = none), got {self.sliding_window}")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ValueError("sliding_attention layers need a sliding_window > 0")
        if self.is_causal is not None and not isinstance(self.is_causal, bool):
            raise ValueError(f"is_causal must be true, false or absent, got {self.is_causal!r}")
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
        for problem in self._kind_problems():
            raise ValueError(problem)

    def _kind_problems(self) -> list[str]:
        if self.kind not in DRAFTER_KINDS:
            return [f"kind={self.kind!r} is not one of {', '.join(DRAFTER_KINDS)}"]
        problems = []
        if self.kind == "dflash2":
            if self.conv_group_size < 1 or self.hidden_size % self.conv_group_size:
                problems.append(f"conv_group_size={self.conv_group_size} must divide hidden_size={self.hidden_size}")
            if not 1 <= self.conv_kernel_size <= self.block_size:
                problems.append(
                    f"conv_kernel_size={self.conv_kernel_size} must be in [1, block_size={self.block_size}]"
                )
            if not 1 <= self.selector_top_k <= self.vocab_size:
                problems.append(f"selector_top_k={self.selector_top_k} must be in [1, vocab_size={self.vocab_size}]")
            if self.selector_rank < 1:
                problems.append(f"selector_rank={self.selector_rank} must be at least 1")
        elif (self.output_multiplier, self.final_logit_softcapping) != (1.0, 0.0):
            problems.append(f"output_multiplier and final_logit_softcapping are 'dflash2' options, not {self.kind!r}")
        if self.kind == "dspark" and self.markov_rank < 1:
            problems.append(f"markov_rank={self.markov_rank} must be at least 1")
        return problems

    @property
    def num_context_features(self) -> int:
        return len(self.target_layer_ids)

    @property
    def first_draft_slot(self) -> int:
        """The first block slot that drafts: 1 (slot k predicts the token at anchor + k; slot 0
        holds the anchor) or, for 'dspark', 0 (slot k predicts the token after it)."""
        return 0 if self.kind == "dspark" else 1

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
        block_size: int = 16,
        target_layer_ids: tuple[int, ...] | None = None,
        intermediate_size: int | None = None,
        num_heads: int | None = None,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        num_context_layers: int | None = None,
        layer_types: tuple[str, ...] = (),
        sliding_window: int = 0,
        kind: str = "dflash",
        **head_fields,
    ) -> DrafterConfig:
        """The target's hidden size (the drafter shares its embedding and LM head) and, unless
        given, its head layout and MLP width (the paper's default). The default target layers
        read are `num_context_layers` (default: one per drafter layer) spread over the target.
        RoPE is the target's, without partial rotation (the drafter's layers are Qwen3's).
        `head_fields`: the kind's own fields (conv_kernel_size, selector_rank, markov_rank, ...)."""
        if target.intermediate_size == 0 and not intermediate_size:
            raise ValueError("the target has no dense MLP width to copy: set the drafter's intermediate_size")
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
            block_size=block_size,
            rms_norm_eps=target.rms_norm_eps,
            max_position_embeddings=target.max_position_embeddings,
            layer_types=layer_types,
            sliding_window=sliding_window,
            kind=kind,
            **head_fields,
        )

    def to_hf(self) -> dict[str, Any]:
        """The `config.json` of docs/design.md §5 (export format), in the layout the serving
        engines load for the kind: z-lab's `DFlashDraftModel` / `DFlash2DraftModel`, or the
        `Qwen3DSparkModel` of DeepSeek's DeepSpec and vLLM's `qwen3_dspark.py`."""
        dflash_config: dict[str, Any] = {
            "mask_token_id": self.mask_token_id,
            "target_layer_ids": list(self.target_layer_ids),
        }
        kind_fields: dict[str, Any] = {}
        if self.kind == "dflash2":
            dflash_config.update(
                block_size=self.block_size,
                conv_group_size=self.conv_group_size,
                conv_kernel_size=self.conv_kernel_size,
                selector_rank=self.selector_rank,
                selector_top_k=self.selector_top_k,
            )
            if self.output_multiplier != 1.0:
                dflash_config["output_multiplier"] = self.output_multiplier
            if self.final_logit_softcapping:
                dflash_config["final_logit_softcapping"] = self.final_logit_softcapping
        elif self.kind == "dspark":
            # vLLM reads these at the top level (DeepSpec writes them there too); the confidence
            # head always reads the Markov embedding of the previous token.
            kind_fields = {
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": list(self.target_layer_ids),
                "markov_rank": self.markov_rank,
                "markov_head_type": "vanilla",
                "enable_confidence_head": True,
                "confidence_head_with_markov": True,
                "draft_vocab_size": self.vocab_size,
            }
        return {
            "architectures": [_KIND_ARCHITECTURES[self.kind]],
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
            # As transformers' Qwen3Config writes them: it drops sliding_window unless
            # use_sliding_window, and SpecForge and SGLang read the per-layer kinds.
            "layer_types": list(self.layer_types),
            "use_sliding_window": self.sliding_window > 0,
            "sliding_window": self.sliding_window or None,
            **({} if self.is_causal is None else {"is_causal": self.is_causal}),
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            **kind_fields,
            "dflash_config": dflash_config,
        }

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> DrafterConfig:
        archs = hf.get("architectures") or []
        kinds = [_ARCHITECTURE_KINDS[a] for a in archs if a in _ARCHITECTURE_KINDS]
        if not kinds:
            raise ValueError(
                f"not a DFlash drafter config (architectures={archs!r}, expected one of {sorted(_ARCHITECTURE_KINDS)})"
            )
        kind = kinds[0]
        dflash = hf.get("dflash_config") or {}

        def field(name, default=None):  # dflash_config first, then the top level (DSpark's place)
            return dflash.get(name, hf.get(name, default))

        missing = [k for k in ("mask_token_id", "target_layer_ids") if field(k) is None]
        if missing:
            raise ValueError(f"drafter config.json lacks the fields {missing} (in dflash_config or at the top level)")
        num_layers = int(hf["num_hidden_layers"])
        # Read as transformers' Qwen3Config reads them (what SpecForge and SGLang load).
        window = int(hf.get("sliding_window") or 0) if hf.get("use_sliding_window") else 0
        layer_types = hf.get("layer_types") or [
            "sliding_attention" if window and i >= hf.get("max_window_layers", 28) else "full_attention"
            for i in range(num_layers)
        ]
        if "sliding_attention" in layer_types and not window:
            raise ValueError(
                "drafter config.json has sliding_attention layers but no window: "
                "set use_sliding_window=true and a positive sliding_window"
            )
        return cls(
            **decoder_fields(hf),
            num_layers=num_layers,
            num_target_layers=int(hf["num_target_layers"]),
            target_layer_ids=tuple(int(i) for i in field("target_layer_ids")),
            mask_token_id=int(field("mask_token_id")),
            # Ours and SGLang's at the top level; some released drafters only in dflash_config.
            block_size=int(field("block_size", 16)),
            layer_types=tuple(layer_types),
            sliding_window=window,
            is_causal=hf.get("is_causal"),
            kind=kind,
            **_kind_fields(kind, field),
        )


# The architecture each kind is exported as, and every name that loads as a kind: DeepSpec's
# training-time name `DSparkDraftModel` (model_type qwen3) is vLLM's `Qwen3DSparkModel`.
_KIND_ARCHITECTURES = {"dflash": "DFlashDraftModel", "dflash2": "DFlash2DraftModel", "dspark": "Qwen3DSparkModel"}
_ARCHITECTURE_KINDS = {**{a: k for k, a in _KIND_ARCHITECTURES.items()}, "DSparkDraftModel": "dspark"}


_DEFAULT_HEADS = DrafterHeads()


def _kind_fields(kind: str, field) -> dict[str, Any]:
    """A released drafter's head fields (`field(name, default)` reads its config.json)."""
    sizes = {name: int(field(name, getattr(_DEFAULT_HEADS, name))) for name in KIND_FIELDS[kind]}
    if kind == "dflash2":
        return dict(
            **sizes,
            output_multiplier=float(field("output_multiplier", 1.0)),
            final_logit_softcapping=float(field("final_logit_softcapping") or 0.0),
        )
    if kind == "dspark":
        # The layout vLLM's qwen3_dspark.py and ours share: the vanilla Markov head and a
        # confidence head on [h; W1 x]; the other variants are not ours to load.
        wanted = {"markov_head_type": "vanilla", "enable_confidence_head": True, "confidence_head_with_markov": True}
        for name, value in wanted.items():
            if field(name, value) != value:
                raise ValueError(f"DSpark drafter with {name}={field(name)!r}: only {name}={value!r} is supported")
        if int(field("draft_vocab_size") or field("vocab_size")) != int(field("vocab_size")):
            raise ValueError("DSpark drafters with a reduced draft vocabulary (draft_vocab_size) are not supported")
    return sizes
