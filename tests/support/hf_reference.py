"""Tiny random Hugging Face checkpoints written by `transformers` itself (needs torch).

Used by the parity tests and `bench/parity.py`: the reference implementation creates the
weights, so our loader is checked against the real format rather than against itself.
"""

from __future__ import annotations

import os

# The linear-attention and MoE sizes of the tiny hybrid and MoE checkpoints.
LINEAR = dict(
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
)
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
VISION = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64)  # never read

# arch -> (config class, model class, family-specific config fields); the Qwen3.5 classes are the
# multimodal ones the hub publishes (text weights under model.language_model.*).
FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(**MOE, norm_topk_prob=True)),
    "qwen3_5": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration", LINEAR),
    "qwen3_5_text": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", LINEAR),
    "qwen3_5_moe": (
        "Qwen3_5MoeConfig",
        "Qwen3_5MoeForConditionalGeneration",
        dict(**LINEAR, **MOE, shared_expert_intermediate_size=32),
    ),
    "qwen3_next": (
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        dict(**LINEAR, **MOE, shared_expert_intermediate_size=32),
    ),
    # A window shorter than the tests' rows; YaRN as published (factor 32 over 4096 positions).
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, sliding_window=16),
    ),
}


def write_hf_checkpoint(out_dir: str | os.PathLike, *, arch: str = "qwen3", seed: int = 0, **overrides) -> str:
    """A tiny random checkpoint (safetensors, fp32) of `arch` (qwen3, llama or one of FAMILIES) in
    `out_dir`, as `save_pretrained` writes it."""
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
    elif arch in FAMILIES:
        config_class, model_class, fields = FAMILIES[arch]
        text = {**common, **fields}
        if config_class in ("Qwen3_5Config", "Qwen3_5MoeConfig"):
            config = getattr(transformers, config_class)(text_config=text, vision_config=VISION)
        else:
            config = getattr(transformers, config_class)(**text)
        model = getattr(transformers, model_class)(config)
    else:
        raise ValueError(f"unknown reference architecture {arch!r} (qwen3, llama, {', '.join(FAMILIES)})")
    # Random init leaves norms at 1 (or 0 where they scale by 1 + w); perturb them so a wrong norm
    # mapping cannot pass. Linear attention's initial decays (A in [1, 16]) forget the state within
    # a token or two, which would hide state bugs: slow them down.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("sinks"):
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith("A_log"):
                p.copy_(torch.log(torch.empty_like(p).uniform_(0.02, 0.5)))
    model.save_pretrained(out_dir)
    return str(out_dir)
