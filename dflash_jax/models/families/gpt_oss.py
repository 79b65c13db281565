"""gpt-oss (20b, 120b): q/k/v/o biases, a learned sink logit per head, sliding (128) and full
layers alternating, YaRN RoPE, no q/k norm; every layer a mixture of experts with a biased router
(top-k of the logits, then softmax), expert biases and a clamped SwiGLU ((up + 1) · gate ·
sigmoid(α · gate), gate <= limit, |up| <= limit).

The hub publishes the experts in MXFP4 (`*_blocks` / `*_scales`, rows = output features,
dequantized at load); transformers writes them dense and already [in, out]: `gate_up_proj`
[E, D, 2I] with gate's and up's columns interleaved, `down_proj` [E, I, D].
"""

from __future__ import annotations

from dflash_jax.models.architecture import MoeConfig, TransformerConfig
from dflash_jax.models.family import Family, decoder, reject
from dflash_jax.models.quantized.mxfp4 import mxfp4_expert_weight
from dflash_jax.models.sharding import HEADS
from dflash_jax.models.weight_maps import Tensor, Transform, as_is, split


def _dequantized(rows: Transform = as_is) -> Transform:
    """MXFP4 blocks and scales -> [E, in, out]; `rows` (output features) picked first, which
    halves the work for gate or up."""

    def dequantize(tensors, cfg, dtype):
        blocks, scales = (rows([t], cfg, dtype) for t in tensors)
        return mxfp4_expert_weight(blocks, scales, dtype)

    return dequantize


def _quantized(name: str) -> tuple[str, str]:
    return f"experts.{name}_blocks", f"experts.{name}_scales"


GATE_ROWS, UP_ROWS = split(0, 2, axis=1, interleaved=True), split(1, 2, axis=1, interleaved=True)
GATE_COLUMNS, UP_COLUMNS = split(0, 2, axis=-1, interleaved=True), split(1, 2, axis=-1, interleaved=True)
TENSORS = (
    Tensor(_quantized("gate_up_proj"), "experts.gate_proj", _dequantized(GATE_ROWS)),
    Tensor(_quantized("gate_up_proj"), "experts.up_proj", _dequantized(UP_ROWS)),
    Tensor(_quantized("down_proj"), "experts.down_proj", _dequantized()),
    Tensor("experts.gate_up_proj", "experts.gate_proj", GATE_COLUMNS),
    Tensor("experts.gate_up_proj", "experts.up_proj", UP_COLUMNS),
    Tensor("experts.gate_up_proj_bias", "experts.gate_proj_bias", GATE_COLUMNS),
    Tensor("experts.gate_up_proj_bias", "experts.up_proj_bias", UP_COLUMNS),
)


def moe_config(hf: dict) -> MoeConfig:
    return MoeConfig(
        num_experts=int(hf["num_local_experts"]),
        num_experts_per_token=int(hf.get("num_experts_per_tok") or hf["experts_per_token"]),
        expert_intermediate_size=int(hf["intermediate_size"]),
        router="topk_softmax",
        router_bias=True,
        expert_bias=True,
        activation="clamped_swiglu",
        swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
    )


def config(hf: dict) -> TransformerConfig:
    reject(hf, "gpt_oss", "mlp_bias")
    fields = decoder(hf)
    return TransformerConfig(
        **fields,
        moe=moe_config(hf),
        moe_layers=tuple(range(fields["num_layers"])),
        qk_norm=False,
        attention_bias=True,
        attention_sinks=True,
    )


FAMILY = Family(
    "gpt_oss",
    {"GptOssForCausalLM": "model."},
    config,
    TENSORS,
    partition_rules=((r"self_attn\.sinks", (HEADS,)),),  # a sink logit per head, split like the heads
)
