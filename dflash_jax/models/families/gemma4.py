"""Gemma 4, dense and MoE (31B, 26B-A4B): Gemma's layer (models/layers/gemma.py: sandwich norms, layer
scalar, GELU-tanh MLP, on the MoE models 128 experts beside it), sliding layers (window 1024,
head 256, RoPE θ 10k) and every sixth a full layer (head 512, fewer kv heads whose values are
their keys, proportional RoPE θ 1M over a quarter of the head), embeddings times sqrt(D), tied LM
head, logits soft-capped at 30.

The hub publishes `Gemma4ForConditionalGeneration` (text weights under `model.language_model.`,
the vision and audio towers never read); transformers also writes `Gemma4ForCausalLM` (`model.`).
Experts are fused (`experts.gate_up_proj` [E, 2I, D], gate first, `experts.down_proj` [E, D, I]).
The router's and experts' input scales are folded into their weights at load: `router.scale` ·
D^-0.5 into the router, `pre_feedforward_layernorm_2` into the experts' gate and up projections,
`router.per_expert_scale` into each expert's down projection (models/layers/gemma.py says why).
Per-layer embeddings, shared kv layers and bidirectional attention (the small E2B / E4B models)
are not supported.
"""

from __future__ import annotations

import math

import numpy as np

from dflash_jax.errors import ModelError
from dflash_jax.models import hf_config
from dflash_jax.models.architecture import LayerAttention, MoeConfig, TransformerConfig
from dflash_jax.models.family import Family, decoder, reject
from dflash_jax.models.sharding import NORM
from dflash_jax.models.weight_maps import Tensor, Transform, split, transpose


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
        "gemma4",
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
        block="gemma4",
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
    "gemma4",
    {"Gemma4ForConditionalGeneration": "model.language_model.", "Gemma4ForCausalLM": "model."},
    config,
    TENSORS,
    # The output scale of a layer, and the norms of its two feed-forward outputs beside the experts.
    partition_rules=((r"layer_scalar", (NORM,)), (r"post_feedforward_layernorm_\d\.weight", (NORM,))),
)
