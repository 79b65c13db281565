"""MiniMax-M2 / M2.1 / M2.5 (230B-A10B): grouped-query attention whose q and k are RMS-normalized
over all heads at once (`qk_norm_type: per_layer`), partial RoPE (`rotary_dim` of each head); every
layer a mixture of experts routed as DeepSeek-V3's with one group (sigmoid scores, top-k chosen
with the load-balancing `e_score_correction_bias`, renormalized), no shared expert, experts as
wide as `intermediate_size`.

The hub keeps the experts under `block_sparse_moe` as Mixtral does (`w1` gate, `w3` up, `w2`
down, one tensor per expert), the bias beside the router, and the Linears (not the router or the
LM head) in FP8 128 x 128 blocks; transformers writes the same names unquantized.
"""

from __future__ import annotations

import dataclasses

from dflash_jax.models.architecture import MoeConfig, TransformerConfig
from dflash_jax.models.family import Family, decoder, reject
from dflash_jax.models.quantized.fp8 import FP8_LINEAR, fp8_rows
from dflash_jax.models.weight_maps import Tensor, transpose

MOE = "block_sparse_moe"
TENSORS = (
    *(
        row
        for hub, ours in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))
        for row in fp8_rows(f"{MOE}.experts.{{expert}}.{hub}", f"mlp.experts.{ours}")
    ),
    Tensor(f"{MOE}.gate.weight", "mlp.router.kernel", transpose),
    Tensor(f"{MOE}.e_score_correction_bias", "mlp.e_score_correction_bias"),
    FP8_LINEAR,
)


def config(hf: dict) -> TransformerConfig:
    reject(hf, "minimax_m2", "attention_bias", "mlp_bias", "shared_intermediate_size")
    fields = decoder(hf)
    if hf.get("rotary_dim") and "partial_rotary_factor" not in (hf.get("rope_parameters") or {}):
        rope = dataclasses.replace(fields["rope"], partial_factor=int(hf["rotary_dim"]) / fields["head_dim"])
        fields["rope"] = rope
    moe = MoeConfig(
        num_experts=int(hf["num_local_experts"]),
        num_experts_per_token=int(hf["num_experts_per_tok"]),
        expert_intermediate_size=int(hf["intermediate_size"]),
        router="sigmoid_grouped",
    )
    return TransformerConfig(
        **fields,
        qk_norm=bool(hf.get("use_qk_norm", True)),
        qk_norm_across_heads=True,
        moe=moe,
        moe_layers=tuple(range(fields["num_layers"])),
    )


FAMILY = Family("minimax_m2", {"MiniMaxM2ForCausalLM": "model."}, config, TENSORS)
