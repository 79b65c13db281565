"""Qwen3.5 / Qwen3.6, dense and MoE (Qwen3.5-4B to 27B, Qwen3.5-35B-A3B, 397B-A17B): three Gated
DeltaNet layers (`linear_attention`) per gated attention layer (`full_attention`: q_proj twice as
wide, its second half a sigmoid output gate; q/k norm; partial RoPE), RMSNorms that scale by 1 + w.
The MoE models give every layer experts (softmax, top-k, always renormalized) plus a shared expert
scaled by sigmoid(shared_expert_gate).

The hub publishes the multimodal `...ForConditionalGeneration` checkpoints: the text weights under
`model.language_model.` (`model.visual.*` and `mtp.*` are never read), experts fused.
"""

from __future__ import annotations

from dflash_jax.models import hf_config
from dflash_jax.models.architecture import TransformerConfig
from dflash_jax.models.families import qwen3_moe
from dflash_jax.models.family import Family, decoder, reject


def hybrid(hf: dict, num_layers: int) -> dict:
    """The fields a Qwen hybrid (Qwen3.5, Qwen3-Next) adds to the decoder's: its layer pattern
    (`layer_types`, or every `full_attention_interval`-th layer full attention when a release leaves
    them out), the Gated DeltaNet sizes and its attention and norm style."""
    interval = int(hf.get("full_attention_interval") or 4)
    pattern = ("linear_attention",) * (interval - 1) + ("full_attention",)
    return dict(
        layer_types=tuple(hf.get("layer_types") or (pattern[i % interval] for i in range(num_layers))),
        linear_attention=hf_config.linear_attention(hf),
        zero_centered_norm=True,
        attention_output_gate=True,
    )


def config(hf: dict) -> TransformerConfig:
    reject(hf, "qwen3_5", "attention_bias", "mlp_bias")
    fields = decoder(hf)
    fields.update(hybrid(hf, fields["num_layers"]))
    if hf.get("num_experts"):
        # Qwen3.5-MoE always renormalizes: its config has no norm_topk_prob.
        fields.update(moe=qwen3_moe.moe_config(hf, norm_topk_prob=True), moe_layers=tuple(range(fields["num_layers"])))
    return TransformerConfig(**fields)


FAMILY = Family(
    "qwen3_5",
    {
        "Qwen3_5ForConditionalGeneration": "model.language_model.",
        "Qwen3_5MoeForConditionalGeneration": "model.language_model.",
        "Qwen3_5ForCausalLM": "model.",
        "Qwen3_5MoeForCausalLM": "model.",
    },
    config,
    qwen3_moe.EXPERT_TENSORS,
)
