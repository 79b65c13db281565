"""Tiny random Hugging Face checkpoints written by `transformers` itself (needs torch).

Used by the parity tests: the reference implementation creates the
weights, so our loader is checked against the real format rather than against itself.
"""

from __future__ import annotations

import os
import shutil

from dflash_jax.bundled import ASSETS

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
# DeepSeek-V3's latent attention (value heads narrower than key heads) and experts: 4 groups of 2,
# 2 groups kept, a shared expert, the first layer dense; YaRN as published (mscale = mscale_all_dim).
LATENT = dict(
    num_key_value_heads=4,
    head_dim=8,  # transformers' rotary width for MLA: qk_rope_head_dim
    q_lora_rank=24,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=4,
    topk_group=2,
    first_k_dense_replace=1,
    moe_intermediate_size=32,
    n_shared_experts=1,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "beta_fast": 32,
        "beta_slow": 1,
    },
)
# Gemma 4: two sliding (window 16) and two full layers (a wider head, one kv head whose values are
# its keys), logits soft-capped where the cap matters; 8 experts beside every MLP in the MoE one.
GEMMA4 = dict(
    global_head_dim=32,
    num_global_key_value_heads=1,
    attention_k_eq_v=True,
    sliding_window=16,
    layer_types=["sliding_attention", "full_attention"] * 2,
    hidden_size_per_layer_input=0,
    final_logit_softcapping=2.0,
)
GEMMA4_MOE = dict(enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=32)
GEMMA4_VISION = dict(num_hidden_layers=1, hidden_size=32, intermediate_size=32, num_attention_heads=2, head_dim=16)
KIMI_VISION = dict(num_hidden_layers=1, hidden_size=32, intermediate_size=32, num_attention_heads=2)  # never read

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
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", LATENT),
    # Kimi-K2.5 as the hub holds it: the DeepSeek-V3 text model under language_model.model.
    "kimi_k25": ("Kimi_K25Config", "Kimi_K25ForConditionalGeneration", LATENT),
    # The MoE model as the hub publishes it, and the dense one as transformers also writes it.
    "gemma4": ("Gemma4Config", "Gemma4ForConditionalGeneration", dict(**GEMMA4, **GEMMA4_MOE)),
    "gemma4_text": ("Gemma4TextConfig", "Gemma4ForCausalLM", GEMMA4),
    # Partial rotary (rotary_dim) and q/k norms over all heads at once.
    "minimax_m2": (
        "MiniMaxM2Config",
        "MiniMaxM2ForCausalLM",
        dict(rotary_dim=8, num_local_experts=8, num_experts_per_tok=2, intermediate_size=32),
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
        llama3_rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        config = transformers.LlamaConfig(**{"rope_parameters": llama3_rope, **common})
        model = transformers.LlamaForCausalLM(config)
    elif arch in FAMILIES:
        config_class, model_class, fields = FAMILIES[arch]
        text = {**common, **fields}
        if config_class in ("Qwen3_5Config", "Qwen3_5MoeConfig"):
            config = getattr(transformers, config_class)(text_config=text, vision_config=VISION)
        elif config_class == "Gemma4Config":
            config = transformers.Gemma4Config(text_config=text, vision_config=GEMMA4_VISION, audio_config=None)
        elif config_class == "Kimi_K25Config":
            text.pop("tie_word_embeddings")
            config = transformers.Kimi_K25Config(
                text_config={"model_type": "deepseek_v3", **text}, vision_config=KIMI_VISION, tie_word_embeddings=False
            )
        else:
            config = getattr(transformers, config_class)(**text)
        model = getattr(transformers, model_class)(config)
    else:
        raise ValueError(f"unknown reference architecture {arch!r} (qwen3, llama, {', '.join(FAMILIES)})")
    # Random init leaves norms at 1 (or 0 where they scale by 1 + w); perturb them so a wrong norm
    # mapping cannot pass. Linear attention's initial decays (A in [1, 16]) forget the state within
    # a token or two, which would hide state bugs: slow them down.
    # Load-balancing biases start at 0, Gemma's scales at 1: perturb them too, so they must be read.
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if "norm" in name or name.endswith(("sinks", "e_score_correction_bias", "layer_scalar", "scale")):
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith("A_log"):
                p.copy_(torch.log(torch.empty_like(p).uniform_(0.02, 0.5)))
    model.save_pretrained(out_dir)
    if arch == "kimi_k25":
        _rename_tensors(out_dir, "language_model.model.blocks.", "language_model.model.layers.")
    return str(out_dir)


def with_tiny_qwen3_tokenizer(model_dir: str | os.PathLike) -> str:
    """`model_dir` with the bundled tiny-qwen3's tokenizer and chat template (4,096 tokens: write
    the checkpoint with vocab_size=4096)."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(ASSETS, "tiny-qwen3", name), os.path.join(model_dir, name))
    return str(model_dir)


def _rename_tensors(out_dir, old: str, new: str) -> None:
    """transformers 5.24 saves Kimi-K2.5's decoder layers as `blocks` (its rename of the vision
    tower's blocks, undone on the text model too); the hub's checkpoints, which it also loads, say
    `layers`."""
    from safetensors.numpy import load_file, save_file

    path = os.path.join(out_dir, "model.safetensors")
    tensors = load_file(path)
    save_file({k.replace(old, new): v for k, v in tensors.items()}, path, metadata={"format": "pt"})
