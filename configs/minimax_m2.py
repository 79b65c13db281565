"""DFlash drafters for MiniMax-M2 / M2.1 / M2.5 targets (230B-A10B: 62 layers of 256 experts, top-8),
with the paper's recipe.

    python train.py --config=configs/minimax_m2.py --config.target.path=/models/MiniMax-M2.5 \
        --config.data.train=/data/train.jsonl --config.workdir=/ckpt/minimax_m2_dflash
    python -m dflash_jax.plan --config=configs/minimax_m2.py --hbm_gb=141     # 8 x H200

Variants, comma-separated:
  block     b16 (default) | b10 | b8: the drafter's block size, with the paper's loss decay γ
The frozen target is 460 GB in bf16 (its FP8 blocks dequantized at load): the mesh splits it over
every device, experts over fsdp x tensor (expert-parallel weights), heads over tensor=8 (one host
a tensor group; its 48 query and 8 kv heads divide by 8), fsdp the hosts. The plan prints whether
a mesh fits and, when it does not, the smallest that does.
The drafter keeps the target's head layout (48 query heads over 8 kv heads of 128); the target has
no dense MLP to copy, so its MLP is 8192 wide. Its 5 layers read 5 target layers spread over the
62. The tokenizer has no mask token: the mask is the embedding's last row (200063), past the
tokenizer's tokens; check it against your tokenizer.
"""

import os

from dflash_jax.training.config.presets import Variants, hub_target_config

TARGETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "targets")
SIZES = {"230b-a10b": dict(plan_config="MiniMax-M2.json")}
DEVICES_PER_HOST = 8

VARIANTS = Variants(tuple(SIZES), default_size="230b-a10b")


def get_config(variants: str = ""):
    size_name, block_size, _ = VARIANTS.choose(variants)
    c = hub_target_config(
        os.path.join(TARGETS, SIZES[size_name]["plan_config"]),
        block_size=block_size,
        mask_token_id=200063,
    )
    c.drafter.intermediate_size = 8192
    c.mesh.data = 1
    c.mesh.fsdp = -1
    c.mesh.tensor = DEVICES_PER_HOST
    return c
