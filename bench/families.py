"""Target configs of each family at one size, for benchmarks that compare families side by side.

Every family keeps the dense model's attention and hidden size; the MoE families give each token
as many active MLP parameters as the dense MLP (A experts of I = dense intermediate / A), so a
ratio against `dense` is the cost of the family's structure, not of a bigger model.
"""

from __future__ import annotations

import argparse

from dflash_jax.models.architecture import LinearAttentionConfig, MoeConfig, RopeConfig, TransformerConfig

FAMILIES = ("dense", "moe", "hybrid", "hybrid_moe")
# The size flags every family benchmark takes (the bundled tiny target's by default).
SIZE_FLAGS = dict(vocab=4096, hidden=256, intermediate=768, layers=4, heads=4, kv_heads=2, head_dim=64)


def add_size_flags(parser: argparse.ArgumentParser) -> None:
    for name, default in SIZE_FLAGS.items():
        parser.add_argument(f"--{name}", type=int, default=default)


def config_from_flags(family: str, args: argparse.Namespace) -> TransformerConfig:
    return target_config(family, **{name: getattr(args, name) for name in SIZE_FLAGS})


def target_config(family: str, *, vocab, hidden, intermediate, layers, heads, kv_heads, head_dim) -> TransformerConfig:
    """`family`'s config: dense Qwen3, Qwen3-MoE (8 experts, top 2), Qwen3.5 (3 Gated DeltaNet
    layers per gated attention layer) or Qwen3.5-MoE (with a shared expert)."""
    if family not in FAMILIES:
        raise SystemExit(f"unknown family {family!r} ({', '.join(FAMILIES)})")
    moe = "moe" in family
    hybrid = family.startswith("hybrid")
    experts, active = 8, 2
    return TransformerConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rope=RopeConfig(theta=1e6, partial_factor=0.25 if hybrid else 1.0),
        zero_centered_norm=hybrid,
        attention_output_gate=hybrid,
        layer_types=tuple(
            "full_attention" if (i + 1) % 4 == 0 or not hybrid else "linear_attention" for i in range(layers)
        ),
        linear_attention=LinearAttentionConfig(
            num_k_heads=kv_heads, num_v_heads=heads, head_k_dim=head_dim, head_v_dim=head_dim
        )
        if hybrid
        else None,
        moe=MoeConfig(
            num_experts=experts,
            num_experts_per_token=active,
            expert_intermediate_size=intermediate // active,
            shared_expert_intermediate_size=intermediate // active if family == "hybrid_moe" else 0,
        )
        if moe
        else None,
        moe_layers=tuple(range(layers)) if moe else (),
    )
