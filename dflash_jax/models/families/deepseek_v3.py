"""The DeepSeek-V3 architecture: DeepSeek-V3 / V3.1 / R1 (671B-A37B) and Kimi-K2 / K2.5 (1T-A32B).

Multi-head latent attention (models/layers/latent_attention.py: q and kv low-rank projections, each head's
rope / no-rope split, interleaved rotary pairs, YaRN with its softmax scale); the first
`first_k_dense_replace` layers a dense SwiGLU, every later one experts: sigmoid scores, experts in
`n_group` groups of which `topk_group` are kept (noaux_tc, the load-balancing
`e_score_correction_bias`), top-k renormalized and times `routed_scaling_factor`, plus
`n_shared_experts` shared experts (one SwiGLU of that many times the expert width), unscaled.

As published: DeepSeek-V3 in FP8 128 x 128 blocks (`weight` float8_e4m3fn + `weight_scale_inv`;
norms, embeddings, routers and the LM head unquantized; MTP layers past num_hidden_layers never
read); Kimi-K2.5 as `KimiK25ForConditionalGeneration` with the text model under
`language_model.model.` (its `lm_head` under `language_model.`; `vision_tower.*`, `mm_projector.*`
never read) and the routed experts in INT4 groups of 32 (models/quantized/int4.py). Transformers writes the
same names unquantized, one tensor per expert.
"""

from __future__ import annotations

import numpy as np

from dflash_jax.errors import ModelError
from dflash_jax.models import hf_config
from dflash_jax.models.architecture import MoeConfig, TransformerConfig
from dflash_jax.models.family import Family, decoder, reject
from dflash_jax.models.layers.latent_attention import rope_rows_deinterleaved
from dflash_jax.models.quantized.fp8 import FP8_LINEAR, fp8_rows
from dflash_jax.models.quantized.int4 import dequantize_int4_groups
from dflash_jax.models.weight_maps import Tensor, Transform, chain, transpose


def int4_experts(tensors, cfg, dtype) -> np.ndarray:
    """Stacked `weight_packed`, `weight_scale`, `weight_shape` -> [E, out, in], expert by expert."""
    packed, scales, shapes = tensors
    out = np.empty((len(packed), *(int(n) for n in shapes[0])), dtype)
    for e, (p, s, shape) in enumerate(zip(packed, scales, shapes)):
        out[e] = dequantize_int4_groups(p, s, shape, dtype)
    return out


def _rope_rows(projection: str) -> Transform:
    """The rotary rows of `projection` (torch layout) reordered evens-then-odds, where the
    checkpoint rotates interleaved pairs."""

    def reorder(tensors, cfg, dtype):
        latent = cfg.latent_attention
        if not latent.rope_interleaved:
            return tensors[0]
        if projection == "kv_a_proj_with_mqa":
            head_width = latent.kv_lora_rank + latent.qk_rope_head_dim
        else:
            head_width = latent.qk_nope_head_dim + latent.qk_rope_head_dim
        return rope_rows_deinterleaved(tensors[0], head_width, latent.qk_rope_head_dim)

    return reorder


PROJ = "{proj:gate_proj|up_proj|down_proj}"
EXPERT = f"mlp.experts.{{expert}}.{PROJ}"
TENSORS = (
    *(
        row
        for projection in ("q_proj", "q_b_proj", "kv_a_proj_with_mqa")
        for row in fp8_rows(f"self_attn.{projection}", f"self_attn.{projection}.kernel", _rope_rows(projection))
    ),
    Tensor(
        (f"{EXPERT}.weight_packed", f"{EXPERT}.weight_scale", f"{EXPERT}.weight_shape"),
        f"mlp.experts.{PROJ}",
        chain(int4_experts, transpose),
    ),
    *fp8_rows(EXPERT, f"mlp.experts.{PROJ}"),
    *fp8_rows(f"mlp.shared_experts.{PROJ}", f"mlp.shared_expert.{PROJ}.kernel"),
    Tensor("mlp.gate.weight", "mlp.router.kernel", transpose),
    Tensor("mlp.gate.e_score_correction_bias", "mlp.e_score_correction_bias"),
    FP8_LINEAR,  # o_proj, q_a_proj, kv_b_proj, the dense MLPs
)


def moe_config(hf: dict) -> MoeConfig:
    """DeepSeek-V3's routed and shared experts."""
    if (hf.get("scoring_func") or "sigmoid") != "sigmoid" or (hf.get("topk_method") or "noaux_tc") != "noaux_tc":
        raise ModelError(
            f"deepseek_v3: routing scoring_func={hf.get('scoring_func')!r}, topk_method={hf.get('topk_method')!r} "
            "is not supported (sigmoid, noaux_tc)"
        )
    return MoeConfig(
        num_experts=int(hf["n_routed_experts"]),
        num_experts_per_token=int(hf["num_experts_per_tok"]),
        expert_intermediate_size=int(hf["moe_intermediate_size"]),
        router="sigmoid_grouped",
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        num_groups=int(hf.get("n_group") or 1),
        groups_kept=int(hf.get("topk_group") or 1),
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        shared_expert_intermediate_size=int(hf.get("n_shared_experts") or 0) * int(hf["moe_intermediate_size"]),
        shared_expert_gate=False,
    )


def config(hf: dict) -> TransformerConfig:
    reject(hf, "deepseek_v3", "attention_bias", "mlp_bias")
    if int(hf.get("moe_layer_freq") or 1) != 1:
        raise ModelError(f"deepseek_v3: moe_layer_freq={hf['moe_layer_freq']} is not supported (1)")
    latent = hf_config.latent_attention(hf)
    fields = {**decoder(hf), "head_dim": latent.qk_rope_head_dim}  # RoPE's width, as transformers says
    first_moe = int(hf.get("first_k_dense_replace") or 0)
    return TransformerConfig(
        **fields,
        qk_norm=False,
        latent_attention=latent,
        moe=moe_config(hf),
        moe_layers=tuple(range(first_moe, fields["num_layers"])),
    )


FAMILY = Family(
    "deepseek_v3",
    {
        "DeepseekV3ForCausalLM": "model.",
        "KimiK25ForConditionalGeneration": ("language_model.model.", "language_model."),
        "Kimi_K25ForConditionalGeneration": ("language_model.model.", "language_model."),  # transformers' name
    },
    config,
    TENSORS,
)
