"""DFlash drafters for Qwen3 targets with the paper's recipe, on one host with 8 accelerators.

    python train.py --config=configs/qwen3.py:8b --config.target.path=/models/Qwen3-8B \
        --config.data.train=/data/train.jsonl --config.workdir=/ckpt/qwen3_8b_dflash
    python -m dflash_jax.plan --config=configs/qwen3.py:8b    # will it fit? (no weights needed)

The variant string picks the target size and options, comma-separated (big_vision style):
  size      4b | 8b (default) | 32b | 30b-a3b: the drafter's depth, and the public config.json the
            memory plan reads (configs/targets/); 32b also splits the target over mesh.tensor=4
            (data=2 x tensor=4; with fsdp: fsdp=2 x tensor=4) and accumulates 4 micro-batches;
            30b-a3b (Qwen3-30B-A3B and Qwen3-Coder-30B-A3B: 48 layers, 128 experts, top-8) splits
            its experts over mesh.fsdp=4 (expert-parallel weights)
  block     b16 (default) | b10 | b8: the drafter's block size, with the paper's loss decay γ
  fsdp      split the frozen target's weights over 4 devices (mesh data=2 x fsdp=4); the
            drafter's weights and optimizer state are split over every device in any case
e.g. `--config=configs/qwen3.py:4b,b10,fsdp`. A run reads the target's shape from its own
config.json (target.path).
"""

import os

from dflash_jax.training.config.presets import Variants, hub_target_config

# Drafter per target size. Both Qwen3-4B and -8B have 36 layers: 5 drafter layers read target
# layers [1, 9, 17, 25, 33]; Qwen3-32B has 64: [1, 16, 31, 46, 61] (docs/design.md §2).
TARGETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "targets")
SIZES = {
    "4b": dict(plan_config="Qwen3-4B.json"),
    "8b": dict(plan_config="Qwen3-8B.json"),
    # 64 GiB of bf16 weights: heads, kv heads and MLP split over 4 devices (8 kv heads allow 8).
    # Rows are split over data x fsdp only, so 4 micro-batches keep 2 rows per device at a time.
    "32b": dict(plan_config="Qwen3-32B.json", tensor=4, fsdp=2, grad_accum_steps=4),
    # 57 GiB of bf16 weights, 54 of them experts: split over fsdp=4 (each device holds 32 experts
    # of every layer); the drafter reads layers [1, 12, 24, 35, 46] of the 48.
    "30b-a3b": dict(plan_config="Qwen3-30B-A3B.json", fsdp=4, always_fsdp=True),
}
FSDP_DEVICES = 4

VARIANTS = Variants(tuple(SIZES), default_size="8b", flags=("fsdp",))


def get_config(variants: str = ""):
    size_name, block_size, flags = VARIANTS.choose(variants)
    size = SIZES[size_name]
    c = hub_target_config(
        os.path.join(TARGETS, size["plan_config"]),
        block_size=block_size,
        mask_token_id=151669,  # <|MASK|>: an existing, unused row of the Qwen3 embedding
    )
    c.mesh.tensor = size.get("tensor", 1)
    c.train.grad_accum_steps = size.get("grad_accum_steps", 1)
    if "fsdp" in flags or size.get("always_fsdp"):
        c.mesh.fsdp = size.get("fsdp", FSDP_DEVICES)
    return c
