"""DFlash drafters for DeepSeek-V3-architecture targets: Kimi-K2.5 (1T-A32B) and DeepSeek-V3 / V3.1
(671B-A37B), with the paper's recipe, on many hosts of 8 accelerators.

    python train.py --config=configs/deepseek_v3.py:kimi-k2.5 --config.target.path=/models/Kimi-K2.5 \
        --config.data.train=/data/train.jsonl --config.workdir=/ckpt/kimi_k25_dflash
    python -m dflash_jax.plan --config=configs/deepseek_v3.py:kimi-k2.5    # 8 x 80 GB: no; how many hosts
    python -m dflash_jax.plan --config=configs/deepseek_v3.py:kimi-k2.5 --num_devices=64

Variants, comma-separated:
  size      kimi-k2.5 (default) | v3: the public config.json the plan reads (configs/targets/).
            The frozen target alone is 2.06 TB in bf16 (Kimi-K2.5, its INT4 experts dequantized)
            or 1.34 TB (DeepSeek-V3, its FP8 blocks dequantized): no host of 8 x 80 GB holds it.
            The mesh splits it over every device: experts over fsdp x tensor (expert-parallel
            weights), heads over tensor=8 (one host a tensor group), fsdp the hosts; the plan
            says whether the devices it is given fit and, when they do not, the smallest number
            of hosts that does
  block     b16 (default) | b10 | b8: the drafter's block size, with the paper's loss decay γ
The drafter is Qwen3-style: 5 layers of 64 query heads over 8 kv heads of 128 (the target's own
heads are latent attention), reading 5 target layers spread over its 61. Neither tokenizer has a
mask token: the mask is a row of the embedding past the tokenizer's last token (Kimi-K2.5:
163838 of 163840 rows, DeepSeek-V3: 129279 of 129280); check it against your tokenizer.
"""

import os

from dflash_jax.training.config.presets import Variants, hub_target_config

TARGETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "targets")
SIZES = {
    "kimi-k2.5": dict(plan_config="Kimi-K2.5.json", mask_token_id=163838),
    "v3": dict(plan_config="DeepSeek-V3.json", mask_token_id=129279),
}
DEVICES_PER_HOST = 8

VARIANTS = Variants(tuple(SIZES), default_size="kimi-k2.5")


def get_config(variants: str = ""):
    size_name, block_size, _ = VARIANTS.choose(variants)
    size = SIZES[size_name]
    c = hub_target_config(
        os.path.join(TARGETS, size["plan_config"]),
        block_size=block_size,
        mask_token_id=size["mask_token_id"],
    )
    c.drafter.num_heads = 64
    c.drafter.num_kv_heads = 8
    c.drafter.head_dim = 128
    c.mesh.data = 1
    c.mesh.fsdp = -1
    c.mesh.tensor = DEVICES_PER_HOST
    return c
