"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-Coder-30B-A3B, Qwen3-235B-A22B): Qwen3's attention; every
`decoder_sparse_step`-th layer not in `mlp_only_layers` is a mixture of experts (softmax over the
experts, top-k, renormalized if `norm_topk_prob`), without a shared expert.

The expert rows serve every Qwen MoE family: the hub holds one tensor per expert; transformers'
modules (and Qwen3.5-MoE on the hub) hold them fused, `gate_up_proj` [E, 2I, D] with gate's rows
first and `down_proj` [E, D, I]. The router is `mlp.gate` there, `mlp.router` here.
"""

from __future__ import annotations

from dflash_jax.errors import ModelError
from dflash_jax.models.architecture import MoeConfig, TransformerConfig
from dflash_jax.models.family import Family, decoder, reject
from dflash_jax.models.weight_maps import Tensor, chain, split, transpose

EXPERT_TENSORS = (
    Tensor("experts.{expert}.{proj}.weight", "experts.{proj:gate_proj|up_proj|down_proj}", transpose),
    Tensor("experts.gate_up_proj", "experts.gate_proj", chain(split(0, 2, axis=1), transpose)),
    Tensor("experts.gate_up_proj", "experts.up_proj", chain(split(1, 2, axis=1), transpose)),
    Tensor("experts.down_proj", "experts.down_proj", transpose),
    Tensor("gate.weight", "router.kernel", transpose),
)


def moe_config(hf: dict, *, norm_topk_prob: bool) -> MoeConfig:
    """The experts of a Qwen MoE config.json (qwen3_moe, qwen3_next, qwen3_5_moe)."""
    if hf.get("hidden_act", "silu") != "silu":
        raise ModelError(f"MoE hidden_act {hf['hidden_act']!r} is not supported (silu)")
    return MoeConfig(
        # Hub configs say num_experts; transformers 5 writes num_local_experts for qwen3_moe.
        num_experts=int(hf.get("num_experts") or hf["num_local_experts"]),
        num_experts_per_token=int(hf["num_experts_per_tok"]),
        expert_intermediate_size=int(hf["moe_intermediate_size"]),
        norm_topk_prob=norm_topk_prob,
        shared_expert_intermediate_size=int(hf.get("shared_expert_intermediate_size") or 0),
    )


def moe_layers(hf: dict, num_layers: int) -> tuple[int, ...]:
    """Every `decoder_sparse_step`-th layer not in `mlp_only_layers` (1 and [] when absent)."""
    step = int(hf.get("decoder_sparse_step") or 1)
    dense = set(hf.get("mlp_only_layers") or ())
    return tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)


def config(hf: dict) -> TransformerConfig:
    reject(hf, "qwen3_moe", "attention_bias", "mlp_bias")
    fields = decoder(hf)
    return TransformerConfig(
        **fields,
        # transformers' default where a config leaves the field out
        moe=moe_config(hf, norm_topk_prob=bool(hf.get("norm_topk_prob", False))),
        moe_layers=moe_layers(hf, fields["num_layers"]),
    )


FAMILY = Family("qwen3_moe", {"Qwen3MoeForCausalLM": "model."}, config, EXPERT_TENSORS)
