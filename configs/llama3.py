"""DFlash drafters for Llama-3.1-8B-Instruct with the paper's recipe, on one host with 8 accelerators.

    python train.py --config=configs/llama3.py:8b --config.target.path=meta-llama/Llama-3.1-8B-Instruct \
        --config.data.train=/data/train.jsonl --config.workdir=/ckpt/llama3_8b_dflash
    python -m dflash_jax.plan --config=configs/llama3.py:8b    # will it fit? (no weights needed)

Variants, comma-separated:
  size      8b (default): the public config.json the memory plan reads (configs/targets/)
  block     b10 (default, as z-lab's Llama-3.1 drafter drafts 9 tokens after the anchor) | b16 |
            b8: the drafter's block size, with the paper's loss decay γ
  fsdp      split the frozen target's weights over 4 devices (mesh data=2 x fsdp=4)
The drafter has 5 layers in the target's head layout (32 query heads over 8 kv heads of 128) and
reads target layers [1, 8, 15, 22, 29] of the 32. Llama-3's tokenizer has no <|MASK|>: the mask is
<|reserved_special_token_0|> (128002), a reserved row of the 128,256-token embedding that no text
produces.
"""

import os

from dflash_jax.training.config.presets import Variants, hub_target_config

TARGETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "targets")
SIZES = {"8b": dict(plan_config="Llama-3.1-8B-Instruct.json")}
FSDP_DEVICES = 4
RESERVED_MASK_TOKEN = 128002  # <|reserved_special_token_0|>

VARIANTS = Variants(tuple(SIZES), default_size="8b", flags=("fsdp",), default_block="b10")


def get_config(variants: str = ""):
    size_name, block_size, flags = VARIANTS.choose(variants)
    c = hub_target_config(
        os.path.join(TARGETS, SIZES[size_name]["plan_config"]),
        block_size=block_size,
        mask_token_id=RESERVED_MASK_TOKEN,
    )
    if "fsdp" in flags:
        c.mesh.fsdp = FSDP_DEVICES
    return c
