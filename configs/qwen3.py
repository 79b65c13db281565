"""DFlash drafters for Qwen3 targets with the paper's recipe, on one host with 8 accelerators.

    python train.py --config=configs/qwen3.py:8b --config.target.path=/models/Qwen3-8B \
        --config.data.train=/data/train.jsonl --config.workdir=/ckpt/qwen3_8b_dflash

The variant string picks the target size and options, comma-separated (big_vision style):
  size      4b | 8b (default 8b): the drafter's depth and the context it reads (table below)
  block     b16 (default) | b10 | b8: the drafter's block size, with the paper's loss decay γ
  fsdp      split drafter weights and optimizer state over 4 devices (mesh data=2 x fsdp=4)
e.g. `--config=configs/qwen3.py:4b,b10,fsdp`. The target's own shape comes from its config.json.
"""

from dflash_jax.errors import ConfigError
from dflash_jax.training.config import base_config

# Drafter per target size. Both Qwen3-4B and -8B have 36 layers: 5 drafter layers read target
# layers [1, 9, 17, 25, 33] (docs/design.md §2).
SIZES = {
    "4b": dict(drafter_layers=5),
    "8b": dict(drafter_layers=5),
}
BLOCK_SIZES = {"b16": 16, "b10": 10, "b8": 8}
FSDP_DEVICES = 4


def get_config(variants: str = "8b"):
    chosen = [v for v in variants.split(",") if v]
    unknown = [v for v in chosen if v not in SIZES and v not in BLOCK_SIZES and v != "fsdp"]
    if unknown:
        raise ConfigError(
            f"unknown config variant(s) {unknown}: use a size {sorted(SIZES)}, a block "
            f"size {sorted(BLOCK_SIZES)} and/or 'fsdp'"
        )
    sizes = [v for v in chosen if v in SIZES] or ["8b"]
    blocks = [v for v in chosen if v in BLOCK_SIZES] or ["b16"]
    if len(sizes) > 1 or len(blocks) > 1:
        raise ConfigError(f"config variants {chosen}: give one size and one block size at most")

    c = base_config()  # the recipe: 6 epochs, lr 6e-4, 4% warmup, cosine, clip 1.0, 512 anchors
    c.drafter.num_layers = SIZES[sizes[0]]["drafter_layers"]
    c.drafter.block_size = BLOCK_SIZES[blocks[0]]
    c.drafter.mask_token_id = 151669  # <|MASK|>: an existing, unused row of the Qwen3 embedding
    c.data.seq_len = 3072
    c.data.global_batch_rows = 16
    c.data.read_threads = 4
    c.train.remat = True
    c.log.every_steps = 20
    if "fsdp" in chosen:
        c.mesh.fsdp = FSDP_DEVICES
    return c
