"""Hugging Face config.json fields read into the model configs of models/architecture.py: RoPE
and its scalings, Gated DeltaNet and latent attention, and the fields every decoder shares. The
family modules (models/families/) read a target's config.json with them, models/drafter_format.py
the drafter's, which `rope_fields` also writes.
"""

from __future__ import annotations

import math
from typing import Any

from dflash_jax.errors import ModelError
from dflash_jax.models.architecture import LatentAttentionConfig, LinearAttentionConfig, RopeConfig, TransformerConfig


def rope(hf: dict[str, Any]) -> RopeConfig:
    """The RoPE of a config.json: its theta, scaling and rotated share."""
    # transformers >= 5 writes `rope_parameters`; older checkpoints use rope_theta + rope_scaling.
    params = dict(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling") or {}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    merged = {**scaling, **params}
    kind = merged.get("rope_type", merged.get("type", "default"))
    partial = float(merged.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    if kind in ("default", "proportional"):  # proportional: Gemma 4's full layers (layers.rope_inv_freq)
        return RopeConfig(theta=float(theta), kind=kind, partial_factor=partial)
    if kind == "llama3":
        return RopeConfig(
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
        return RopeConfig(
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


def rope_fields(rope: RopeConfig) -> dict[str, Any]:
    """The `rope_theta` / `rope_scaling` fields as serving engines read them."""
    out: dict[str, Any] = {"rope_theta": rope.theta}
    if rope.partial_factor != 1.0:
        out["partial_rotary_factor"] = rope.partial_factor
    if rope.kind in _SCALING_FIELDS:
        out["rope_scaling"] = {"rope_type": rope.kind, **{k: getattr(rope, k) for k in _SCALING_FIELDS[rope.kind]}}
    return out


# The fields of each rope scaling that `rope_scaling` spells out (with its rope_type).
_SCALING_FIELDS = {
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "truncate", "attention_factor"),
}


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def linear_attention(hf: dict[str, Any]) -> LinearAttentionConfig:
    """The Gated DeltaNet fields of a Qwen3.5 / Qwen3-Next config.json."""
    return LinearAttentionConfig(
        num_k_heads=int(hf["linear_num_key_heads"]),
        num_v_heads=int(hf["linear_num_value_heads"]),
        head_k_dim=int(hf["linear_key_head_dim"]),
        head_v_dim=int(hf["linear_value_head_dim"]),
        conv_kernel_size=int(hf.get("linear_conv_kernel_dim", 4)),
    )


def latent_attention(hf: dict[str, Any]) -> LatentAttentionConfig:
    """The MLA fields of a DeepSeek-V3 config.json. The softmax scale is (N + R)^-0.5, times
    YaRN's mscale(factor, mscale_all_dim)² where the RoPE is scaled and sets mscale_all_dim."""
    nope, rope = int(hf["qk_nope_head_dim"]), int(hf["qk_rope_head_dim"])
    scaling = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    scale = (nope + rope) ** -0.5
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind != "default" and scaling.get("mscale_all_dim"):
        scale *= _yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"])) ** 2
    return LatentAttentionConfig(
        q_lora_rank=int(hf.get("q_lora_rank") or 0),
        kv_lora_rank=int(hf["kv_lora_rank"]),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=int(hf["v_head_dim"]),
        softmax_scale=scale,
        rope_interleaved=bool(hf.get("rope_interleave", True)),
    )


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
        rope=rope(hf),
        rms_norm_eps=float(hf.get("rms_norm_eps", TransformerConfig.rms_norm_eps)),
        max_position_embeddings=int(hf.get("max_position_embeddings", TransformerConfig.max_position_embeddings)),
    )
