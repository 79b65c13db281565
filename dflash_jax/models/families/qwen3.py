"""Dense Qwen3 (Qwen3-0.6B to 32B): grouped-query attention with a per-head RMSNorm on q and k,
SwiGLU MLPs, no biases. Every tensor is named as its parameter (the generic weight map)."""

from __future__ import annotations

from dflash_jax.models.architecture import TransformerConfig
from dflash_jax.models.family import Family, GgufArchitecture, decoder, reject


def config(hf: dict) -> TransformerConfig:
    reject(hf, "qwen3", "attention_bias", "mlp_bias")
    return TransformerConfig(**decoder(hf))


FAMILY = Family(
    "qwen3",
    {"Qwen3ForCausalLM": "model."},
    config,
    # NeoX RoPE: llama.cpp keeps the q/k rows in the Hugging Face order.
    gguf={"qwen3": GgufArchitecture("Qwen3ForCausalLM", "qwen3", interleaved_qk=False)},
)
