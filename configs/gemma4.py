"""DFlash drafters for Gemma 4 targets (31B dense, 26B-A4B MoE) with the paper's recipe, on one host
with 8 accelerators.

    python train.py --config=configs/gemma4.py:31b --config.target.path=google/gemma-4-31B-it \
        --config.data.train=/data/train.jsonl --config.workdir=/ckpt/gemma4_31b_dflash
    python -m dflash_jax.plan --config=configs/gemma4.py:31b    # will it fit? (no weights needed)

Variants, comma-separated:
  size      31b (default) | 26b-a4b: the public config.json the plan reads (configs/targets/).
            31b: 60 layers, 62 GB of bf16 weights, split over mesh.fsdp=8 (its full layers' 4 kv
            heads do not split over a tensor axis of 8); 26b-a4b: 30 layers of 128 experts (top-8)
            beside a dense MLP, 52 GB, experts over mesh.fsdp=4 (expert-parallel weights)
  block     b16 (default) | b10 | b8: the drafter's block size, with the paper's loss decay γ
The drafter keeps the target's sliding layers' head layout (heads of 256) and reads 5 target
layers spread over its depth; 26b-a4b's dense MLP is narrow (2112), so its drafter's MLP is 8192
wide. The mask is <mask> (id 4 in Gemma's tokenizer); check it against your tokenizer.
"""

import os

from dflash_jax.training.config.presets import Variants, hub_target_config

TARGETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "targets")
SIZES = {
    "31b": dict(plan_config="gemma-4-31B-it.json", fsdp=8),
    "26b-a4b": dict(plan_config="gemma-4-26B-A4B-it.json", fsdp=4, intermediate_size=8192),
}
MASK_TOKEN = 4  # <mask>

VARIANTS = Variants(tuple(SIZES), default_size="31b")


def get_config(variants: str = ""):
    size_name, block_size, _ = VARIANTS.choose(variants)
    size = SIZES[size_name]
    c = hub_target_config(os.path.join(TARGETS, size["plan_config"]), block_size=block_size, mask_token_id=MASK_TOKEN)
    c.drafter.intermediate_size = size.get("intermediate_size", 0)  # 0: the target's
    c.mesh.fsdp = size["fsdp"]
    return c
