"""Llama 2 / 3 / 3.1 / 3.2 / 3.3: Qwen3's layers without the q/k norm, RoPE with the llama3
frequency scaling where the config says so. Every tensor is named as its parameter."""

from __future__ import annotations

from dflash_jax.models.architecture import TransformerConfig
from dflash_jax.models.family import Family, GgufArchitecture, decoder, reject


def config(hf: dict) -> TransformerConfig:
    reject(hf, "llama", "attention_bias", "mlp_bias")
    return TransformerConfig(**decoder(hf), qk_norm=False)


FAMILY = Family(
    "llama",
    {"LlamaForCausalLM": "model."},
    config,
    gguf={"llama": GgufArchitecture("LlamaForCausalLM", "llama", interleaved_qk=True)},
)
