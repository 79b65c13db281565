"""Qwen3-Next / Qwen3-Coder-Next (80B-A3B): Qwen3.5-MoE's layers (512 experts, top-10, a shared
expert), with a flat config.json whose release leaves `layer_types` out (every fourth layer full
attention) and experts on `decoder_sparse_step` / `mlp_only_layers` as Qwen3-MoE's.

Its Gated DeltaNet projections are fused on the hub, `in_proj_qkvz` and `in_proj_ba`, grouped per
key head; at load they become Qwen3.5's four (`unfuse_in_proj`). Experts: one tensor each.
"""

from __future__ import annotations

import numpy as np

from dflash_jax.models.architecture import TransformerConfig
from dflash_jax.models.families import qwen3_5, qwen3_moe
from dflash_jax.models.family import Family, decoder, reject
from dflash_jax.models.weight_maps import Tensor, Transform, chain, transpose


def unfuse_in_proj(
    w_qkvz: np.ndarray, w_ba: np.ndarray, *, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int
) -> dict[str, np.ndarray]:
    """Qwen3-Next's fused `in_proj_qkvz` [K·(2H + 2·G·U), D] and `in_proj_ba` [2·K·G, D] (torch
    layout, grouped per key head: q, k, v, z then b, a) -> the torch-layout weights of
    `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`.

    After ungrouping, q, k and v are concatenated in the order Qwen3-Next feeds its conv, so its
    `conv1d.weight` loads unchanged.
    """
    if num_v_heads % num_k_heads:
        raise ValueError(
            f"Qwen3-Next linear attention: {num_v_heads} value heads do not group over {num_k_heads} key heads"
        )
    g = num_v_heads // num_k_heads
    per_head = 2 * head_k_dim + 2 * g * head_v_dim
    if w_qkvz.ndim != 2 or w_qkvz.shape[0] != num_k_heads * per_head:
        raise ValueError(
            f"Qwen3-Next in_proj_qkvz has shape {w_qkvz.shape}, expected ({num_k_heads * per_head}, hidden)"
        )
    d = w_qkvz.shape[1]
    if w_ba.shape != (2 * num_v_heads, d):
        raise ValueError(f"Qwen3-Next in_proj_ba has shape {w_ba.shape}, expected ({2 * num_v_heads}, {d})")
    q, k, v, z = np.split(
        w_qkvz.reshape(num_k_heads, per_head, d), np.cumsum([head_k_dim, head_k_dim, g * head_v_dim]), axis=1
    )
    b, a = np.split(w_ba.reshape(num_k_heads, 2 * g, d), [g], axis=1)

    def flat(w):  # [K, X, D] -> [K·X, D], key head major as the unfused projections
        return w.reshape(-1, d)

    return {
        "in_proj_qkv": np.concatenate([flat(q), flat(k), flat(v)]),
        "in_proj_z": flat(z),
        "in_proj_b": flat(b),
        "in_proj_a": flat(a),
    }


def _unfused(name: str) -> Transform:
    def take(tensors, cfg, dtype):
        lin = cfg.linear_attention
        sizes = dict(
            num_k_heads=lin.num_k_heads,
            num_v_heads=lin.num_v_heads,
            head_k_dim=lin.head_k_dim,
            head_v_dim=lin.head_v_dim,
        )
        return unfuse_in_proj(*tensors, **sizes)[name]

    return take


FUSED = ("linear_attn.in_proj_qkvz.weight", "linear_attn.in_proj_ba.weight")
TENSORS = (
    *(
        Tensor(FUSED, f"linear_attn.{name}.kernel", chain(_unfused(name), transpose))
        for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
    ),
    *qwen3_moe.EXPERT_TENSORS,
)


def config(hf: dict) -> TransformerConfig:
    reject(hf, "qwen3_next", "attention_bias", "mlp_bias")
    fields = decoder(hf)
    return TransformerConfig(
        **{**fields, **qwen3_5.hybrid(hf, fields["num_layers"])},
        # transformers' default where a config leaves the field out
        moe=qwen3_moe.moe_config(hf, norm_topk_prob=bool(hf.get("norm_topk_prob", True))),
        moe_layers=qwen3_moe.moe_layers(hf, fields["num_layers"]),
    )


FAMILY = Family("qwen3_next", {"Qwen3NextForCausalLM": "model."}, config, TENSORS)
