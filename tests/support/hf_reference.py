"""Tiny random Hugging Face checkpoints written by `transformers` itself (needs torch).

Used by the parity tests and `bench/parity.py`: the reference implementation creates the
weights, so our loader is checked against the real format rather than against itself.
"""

from __future__ import annotations

import os


def write_hf_checkpoint(out_dir: str | os.PathLike, *, arch: str = "qwen3", seed: int = 0, **overrides) -> str:
    """A tiny random Qwen3 or Llama-3 checkpoint (safetensors, fp32) in `out_dir`."""
    import torch
    import transformers

    common = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    common.update(overrides)
    torch.manual_seed(seed)
    if arch == "qwen3":
        config = transformers.Qwen3Config(rope_theta=10000.0, **common)
        model = transformers.Qwen3ForCausalLM(config)
    elif arch == "llama":
        config = transformers.LlamaConfig(
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            **common,
        )
        model = transformers.LlamaForCausalLM(config)
    else:
        raise ValueError(f"unknown reference architecture {arch!r} (qwen3 or llama)")
    # Random init leaves norms at 1; perturb them so a wrong norm mapping cannot pass.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(out_dir)
    return str(out_dir)
