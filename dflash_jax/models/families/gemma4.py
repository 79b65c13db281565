"""Gemma 4, dense and MoE (31B, 26B-A4B): its own decoder layer (sandwich norms, layer scalar,
GELU-tanh MLP, on the MoE models 128 experts beside it), sliding layers (window 1024, head 256,
RoPE θ 10k) and every sixth a full layer (head 512, fewer kv heads whose values are their keys,
proportional RoPE θ 1M over a quarter of the head), embeddings times sqrt(D), tied LM head, logits
soft-capped at 30. transformers' Gemma4TextDecoderLayer and Gemma4TextAttention are the reference.

The layer normalizes around both halves ("sandwich" norms) and scales its output:

    h   = x + post_attention_layernorm(self_attn(input_layernorm(x)))
    f   = mlp(pre_feedforward_layernorm(h))                       GELU-tanh gated MLP
    MoE layers add experts beside the dense MLP:
    f   = post_feedforward_layernorm_1(f) + post_feedforward_layernorm_2(moe(rms(h)))
    out = (h + post_feedforward_layernorm(f)) · layer_scalar

where rms(h) is h divided by its root mean square, without scale: the router's input. Gemma's
router scales it by `router.scale` · D^-0.5 and its experts read it through
pre_feedforward_layernorm_2; both scales are folded into the router's and experts' input weights
at load (`TENSORS`), and `router.per_expert_scale` into each expert's output weight, so the
experts are the shared `moe.MoE` (softmax, top-k, renormalized).

Attention: per-head q and k RMSNorms (scaled), values RMS-normalized without scale, scores not
scaled by H^-0.5; on the full layers of the large models, keys and values both come from k_proj
(`attention_k_eq_v`: no v_proj). Sliding and full layers have their own head size, kv heads and
RoPE (`TransformerConfig.full_attention`; the model passes each layer its tables).

The hub publishes `Gemma4ForConditionalGeneration` (text weights under `model.language_model.`,
the vision and audio towers never read); transformers also writes `Gemma4ForCausalLM` (`model.`).
Experts are fused (`experts.gate_up_proj` [E, 2I, D], gate first, `experts.down_proj` [E, D, I]).
Per-layer embeddings, shared kv layers and bidirectional attention (the small E2B / E4B models)
are not supported.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dflash_jax.errors import ModelError
from dflash_jax.models import hf_config
from dflash_jax.models.architecture import LayerAttention, MoeConfig, TransformerConfig, layer_attention, layer_window
from dflash_jax.models.family import DecoderLayer, Family, decoder, reject
from dflash_jax.models.layers.basic import RMSNorm, Rotary, SwiGLU, apply_rope, rms_normalized, swiglu_macs
from dflash_jax.models.layers.mixers import SelfAttention, attention_macs
from dflash_jax.models.layers.moe import MoE, moe_macs
from dflash_jax.models.sharding import BATCH, KV_HEADS, NORM, constrain
from dflash_jax.models.weight_maps import Tensor, Transform, split, transpose

FAMILY_NAME = "gemma4"


class Gemma4Attention(SelfAttention):
    """SelfAttention with Gemma 4's normalizations; `values_from_keys`: no v_proj, values are
    k_proj's output (normalized as values)."""

    def __init__(self, *, values_from_keys: bool = False, **attention):
        super().__init__(qk_norm=True, **attention)
        self.eps = attention["eps"]
        if values_from_keys:
            self.v_proj = None

    def queries(self, x: jax.Array, tables: Rotary) -> tuple[jax.Array, jax.Array | None]:
        q, gate = super().queries(x, tables)
        return q * jnp.asarray(math.sqrt(self.head_dim), q.dtype), gate  # scores unscaled: cancel H^-0.5

    def keys_values(self, x: jax.Array, tables: Rotary) -> tuple[jax.Array, jax.Array]:
        shape = (*x.shape[:-1], self.num_kv_heads, self.head_dim)
        k = self.k_proj(x).reshape(shape)
        v = k if self.v_proj is None else self.v_proj(x).reshape(shape)
        k = constrain(apply_rope(self.k_norm(k), tables), (BATCH, ..., KV_HEADS, None))
        v = constrain(rms_normalized(v, self.eps).astype(self.compute_dtype), (BATCH, ..., KV_HEADS, None))
        return k, v


class Gemma4Block(nnx.Module):
    """One Gemma 4 layer: the block interface of `layers.DecoderBlock` (`__call__`, `decode`,
    `mixer`) with Gemma's norms, optional experts and layer scalar."""

    mixer_name = "self_attn"

    def __init__(
        self,
        attention: Gemma4Attention,
        mlp: nnx.Module,
        moe: nnx.Module | None,
        *,
        hidden_size: int,
        eps: float,
        param_dtype,
        compute_dtype,
    ):
        norm_kw = dict(eps=eps, param_dtype=param_dtype, compute_dtype=compute_dtype)
        self.input_layernorm = RMSNorm(hidden_size, **norm_kw)
        self.self_attn = attention
        self.post_attention_layernorm = RMSNorm(hidden_size, **norm_kw)
        self.pre_feedforward_layernorm = RMSNorm(hidden_size, **norm_kw)
        self.mlp = mlp
        self.post_feedforward_layernorm = RMSNorm(hidden_size, **norm_kw)
        self.moe = moe
        if moe is not None:
            self.post_feedforward_layernorm_1 = RMSNorm(hidden_size, **norm_kw)
            self.post_feedforward_layernorm_2 = RMSNorm(hidden_size, **norm_kw)
        self.layer_scalar = nnx.Param(jnp.ones((1,), param_dtype))
        self.eps = eps
        self.compute_dtype = compute_dtype

    @property
    def mixer(self) -> nnx.Module:
        return self.self_attn

    def _feed_forward(self, h: jax.Array) -> jax.Array:
        out = self.mlp(self.pre_feedforward_layernorm(h))
        if self.moe is not None:
            experts = self.moe(rms_normalized(h, self.eps).astype(self.compute_dtype))
            out = self.post_feedforward_layernorm_1(out) + self.post_feedforward_layernorm_2(experts)
        return (h + self.post_feedforward_layernorm(out)) * self.layer_scalar[...].astype(self.compute_dtype)

    def __call__(self, x: jax.Array, inputs) -> jax.Array:
        """x [..., D] -> [..., D] (packed forward)."""
        return self._feed_forward(x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), inputs)))

    def decode(self, x: jax.Array, inputs, cache):
        """x [B, T, D] against the attention's cache slice -> ([B, T, D], updated slice)."""
        out, cache = self.self_attn.decode(self.input_layernorm(x), inputs, cache)
        return self._feed_forward(x + self.post_attention_layernorm(out)), cache


def layer(cfg: TransformerConfig, index: int, *, attention_kw: dict, dtypes: dict, rngs) -> Gemma4Block:
    """Layer `index` of a Gemma 4 target: its kind's attention, the dense MLP, experts on MoE layers."""
    layer_type = cfg.layer_types[index]
    own = layer_attention(cfg, layer_type)
    mixer = Gemma4Attention(
        num_kv_heads=own.num_kv_heads,
        head_dim=own.head_dim,
        values_from_keys=own.values_from_keys,
        eps=cfg.rms_norm_eps,
        sliding_window=layer_window(cfg, layer_type),
        **attention_kw,
    )
    moe = MoE(cfg.hidden_size, cfg.moe, rngs=rngs, **dtypes) if index in cfg.moe_layers else None
    mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, activation=cfg.mlp_activation, rngs=rngs, **dtypes)
    return Gemma4Block(mixer, mlp, moe, hidden_size=cfg.hidden_size, eps=cfg.rms_norm_eps, **dtypes)


def layer_macs(cfg: TransformerConfig, index: int, rows: int, seq_len: int) -> int:
    """Multiply-adds of `layer`'s forward over [rows, seq_len] packed rows: its attention, the
    dense MLP, and on MoE layers the experts beside it."""
    experts = moe_macs(cfg.hidden_size, cfg.moe) if index in cfg.moe_layers else 0
    feed_forward = swiglu_macs(cfg.hidden_size, cfg.intermediate_size) + experts
    return attention_macs(cfg, cfg.layer_types[index], rows, seq_len) + rows * seq_len * feed_forward


def _folded_router(tensors, cfg, dtype) -> np.ndarray:
    """router.proj [E, D] and router.scale [D] -> our router kernel [D, E] over rms(x)."""
    proj, scale = tensors
    return proj.T * (scale * cfg.hidden_size**-0.5)[:, None]


def _folded_input(part: int) -> Transform:
    """Gate (0) or up (1) of experts.gate_up_proj [E, 2I, D], times pre_feedforward_layernorm_2 [D]
    -> [E, D, I]."""
    rows = split(part, 2, axis=1)

    def fold(tensors, cfg, dtype):
        return transpose([rows(tensors[:1], cfg, dtype)], cfg, dtype) * tensors[1][None, :, None]

    return fold


def _folded_output(tensors, cfg, dtype) -> np.ndarray:
    """experts.down_proj [E, D, I] times router.per_expert_scale [E] -> [E, I, D]."""
    down, per_expert = tensors
    return transpose([down], cfg, dtype) * per_expert[:, None, None]


TENSORS = (
    Tensor(("router.proj.weight", "router.scale"), "moe.router.kernel", _folded_router),
    Tensor(("experts.gate_up_proj", "pre_feedforward_layernorm_2.weight"), "moe.experts.gate_proj", _folded_input(0)),
    Tensor(("experts.gate_up_proj", "pre_feedforward_layernorm_2.weight"), "moe.experts.up_proj", _folded_input(1)),
    Tensor(("experts.down_proj", "router.per_expert_scale"), "moe.experts.down_proj", _folded_output),
)


def config(hf: dict) -> TransformerConfig:
    reject(
        hf,
        FAMILY_NAME,
        "attention_bias",
        "hidden_size_per_layer_input",
        "num_kv_shared_layers",
        "use_double_wide_mlp",
        "use_bidirectional_attention",
    )
    if hf.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise ModelError(f"gemma4: hidden_activation {hf['hidden_activation']!r} is not supported (gelu_pytorch_tanh)")
    fields = decoder(hf)
    ropes = hf["rope_parameters"]
    sliding, full = (
        hf_config.rope({"rope_parameters": ropes[kind]}) for kind in ("sliding_attention", "full_attention")
    )
    values_from_keys = bool(hf.get("attention_k_eq_v"))
    full_layer = _full_layer_overrides(hf, fields["layer_types"])
    full_attention = LayerAttention(
        head_dim=int(full_layer.get("head_dim") or hf.get("global_head_dim") or fields["head_dim"]),
        num_kv_heads=int(
            full_layer.get("num_key_value_heads")
            or (values_from_keys and hf.get("num_global_key_value_heads"))
            or fields["num_kv_heads"]
        ),
        rope=full,
        values_from_keys=values_from_keys,
    )
    moe = None
    if hf.get("enable_moe_block"):
        moe = MoeConfig(
            num_experts=int(hf["num_experts"]),
            num_experts_per_token=int(hf["top_k_experts"]),
            expert_intermediate_size=int(hf["moe_intermediate_size"]),
            activation="geglu",
        )
    return TransformerConfig(
        **{**fields, "rope": sliding},
        qk_norm=True,
        block=FAMILY_NAME,
        mlp_activation="gelu_tanh",
        embedding_scale=math.sqrt(fields["hidden_size"]),
        final_logit_softcap=float(hf.get("final_logit_softcapping") or 0.0),
        full_attention=full_attention,
        moe=moe,
        moe_layers=tuple(range(fields["num_layers"])) if moe else (),
    )


def _full_layer_overrides(hf: dict, layer_types: tuple[str, ...]) -> dict:
    """The head size and kv heads of the full layers as transformers writes them (`per_layer_config`,
    by layer index, in place of the hub's global_head_dim and num_global_key_value_heads)."""
    written = {int(i): o for i, o in (hf.get("per_layer_config") or {}).items()}
    kinds = {layer_types[i] for i in written}
    distinct = {tuple(sorted(o.items())) for o in written.values()}
    if kinds - {"full_attention"} or len(distinct) > 1:
        raise ModelError("gemma4: per_layer_config other than one override for every full layer is not supported")
    return next(iter(written.values()), {})


FAMILY = Family(
    FAMILY_NAME,
    {"Gemma4ForConditionalGeneration": "model.language_model.", "Gemma4ForCausalLM": "model."},
    config,
    TENSORS,
    # The output scale of a layer, and the norms of its two feed-forward outputs beside the experts.
    partition_rules=((r"layer_scalar", (NORM,)), (r"post_feedforward_layernorm_\d\.weight", (NORM,))),
    layer=DecoderLayer(layer, layer_macs),
)
