"""DFlash drafters for Qwen3-Next-80B-A3B (Instruct, Thinking; Qwen3-Coder-Next shares its shapes)
with the paper's recipe, on one host with 8 accelerators.

    python train.py --config=configs/qwen3_next.py:80b-a3b --config.target.path=Qwen/Qwen3-Next-80B-A3B-Instruct \
        --config.data.train=/data/train.jsonl --config.workdir=/ckpt/qwen3_next_dflash
    python -m dflash_jax.plan --config=configs/qwen3_next.py:80b-a3b    # will it fit? (no weights needed)

Variants, comma-separated:
  size      80b-a3b (default): the public config.json the memory plan reads (configs/targets/);
            48 layers (three Gated DeltaNet layers per gated attention layer), 512 experts of 512,
            top-10, and a shared expert: 148 GiB of bf16 weights, 144 of them experts, split over
            every device (mesh.fsdp=8)
  block     b16 (default) | b10 | b8: the drafter's block size, with the paper's loss decay γ
The drafter is shaped as configs/qwen3_5.py's for the Qwen3.5-MoE target of the same width (2048):
5 Qwen3-style layers of 32 query heads over 8 kv heads of 128, MLP 6144, the first four sliding
over 2048 positions. The mask is <|MASK|>'s row of Qwen3's embedding (151669), as configs/qwen3.py.
"""

import os

from dflash_jax.training.config.presets import Variants, hub_target_config

TARGETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "targets")
SIZES = {"80b-a3b": dict(plan_config="Qwen3-Next-80B-A3B-Instruct.json", fsdp=8)}
MASK_TOKEN = 151669  # <|MASK|>: an existing, unused row of the Qwen3 embedding

VARIANTS = Variants(tuple(SIZES), default_size="80b-a3b")


def get_config(variants: str = ""):
    size_name, block_size, _ = VARIANTS.choose(variants)
    size = SIZES[size_name]
    c = hub_target_config(os.path.join(TARGETS, size["plan_config"]), block_size=block_size, mask_token_id=MASK_TOKEN)
    c.drafter.num_heads, c.drafter.num_kv_heads, c.drafter.head_dim = 32, 8, 128
    c.drafter.intermediate_size = 6144
    c.drafter.layer_types = ("sliding_attention",) * 4 + ("full_attention",)
    c.drafter.sliding_window = 2048
    c.mesh.fsdp = size["fsdp"]
    return c
