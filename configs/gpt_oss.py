"""DFlash drafters for gpt-oss targets (sinks, alternating sliding/full attention, YaRN, MoE with
MXFP4 weights dequantized at load), with the paper's recipe, on one host with 8 accelerators.

    python train.py --config=configs/gpt_oss.py:20b --config.target.path=openai/gpt-oss-20b \
        --config.data.train=/data/train.jsonl --config.workdir=/ckpt/gpt_oss_20b_dflash
    python -m dflash_jax.plan --config=configs/gpt_oss.py:20b    # will it fit? (no weights needed)

Variants, comma-separated:
  size      20b (default) | 120b: the public config.json the plan reads (configs/targets/).
            20b splits its experts over mesh.fsdp=4 (42 GiB of bf16 weights once dequantized);
            120b (234 GiB) over every device (mesh.data=1, mesh.fsdp=-1: 8 on a host of 8
            GPUs, 16 on a TPU v6e-16, whose 32 GiB chips it does not fit split over 8), and
            drafts blocks of 10 as z-lab's released gpt-oss-120b drafter does
  block     b16 | b10 | b8: override the block size, with the paper's loss decay γ
The drafter keeps the target's head layout (64 query heads over 8 kv heads of 64) and reads 5
target layers spread over the target's depth; gpt-oss has no <|MASK|> token, so the mask is an
unused reserved row (200017, <|reserved_200017|>; check it against your tokenizer).
"""

import os

from dflash_jax.training.config.presets import Variants, hub_target_config

TARGETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "targets")
SIZES = {
    "20b": dict(plan_config="gpt-oss-20b.json", mesh=dict(fsdp=4), block_size=16),
    "120b": dict(plan_config="gpt-oss-120b.json", mesh=dict(data=1, fsdp=-1), block_size=10),
}
RESERVED_MASK_TOKEN = 200017

VARIANTS = Variants(tuple(SIZES), default_size="20b", default_block=None)


def get_config(variants: str = ""):
    size_name, block_size, _ = VARIANTS.choose(variants)
    size = SIZES[size_name]
    block_size = block_size or size["block_size"]
    c = hub_target_config(
        os.path.join(TARGETS, size["plan_config"]), block_size=block_size, mask_token_id=RESERVED_MASK_TOKEN
    )
    c.mesh.update(size["mesh"])
    return c
