"""DFlash drafters for Qwen3.5 / Qwen3.6 targets (hybrid Gated DeltaNet + gated attention, dense and
MoE), with the paper's recipe, on one host with 8 accelerators.

    python train.py --config=configs/qwen3_5.py:27b --config.target.path=Qwen/Qwen3.5-27B \
        --config.data.train=hf://datasets/org/name/*.jsonl --config.workdir=/ckpt/qwen3_5_27b_dflash
    python -m dflash_jax.plan --config=configs/qwen3_5.py:27b    # will it fit? (no weights needed)

The variant string picks the target size and options, comma-separated (big_vision style):
  size      4b | 9b | 27b (default) | 35b-a3b: the public config.json the memory plan reads
            (configs/targets/Qwen3.5-*.json); Qwen3.6-27B and Qwen3.6-35B-A3B share these shapes.
            27b splits the frozen target over mesh.fsdp=4, 35b-a3b its experts over mesh.fsdp=4.
  block     b16 (default) | b10 | b8: the drafter's block size, with the paper's loss decay γ
  fsdp      split the frozen target's weights over 4 devices (mesh data=2 x fsdp=4)
The drafter is shaped like the released ones for these targets: 5 Qwen3-style layers of 32 query
heads over 8 kv heads of 128 (not the target's 24 x 256 gated heads), the first four with a
sliding window of 2048, reading 5 target layers spread over the target's depth. A run reads the
target's shape from its own config.json.
"""

import os

from dflash_jax.training.config.presets import Variants, hub_target_config

TARGETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "targets")
SIZES = {
    "4b": dict(plan_config="Qwen3.5-4B.json", drafter_mlp=9216),
    "9b": dict(plan_config="Qwen3.5-9B.json", drafter_mlp=12288),
    "27b": dict(plan_config="Qwen3.5-27B.json", drafter_mlp=17408, fsdp=4),
    # 256 experts of 512 in 40 layers: 65 GiB of bf16 weights, experts split over fsdp=4.
    "35b-a3b": dict(plan_config="Qwen3.5-35B-A3B.json", drafter_mlp=6144, fsdp=4),
}
FSDP_DEVICES = 4

VARIANTS = Variants(tuple(SIZES), default_size="27b", flags=("fsdp",))


def get_config(variants: str = ""):
    size_name, block_size, flags = VARIANTS.choose(variants)
    size = SIZES[size_name]
    c = hub_target_config(os.path.join(TARGETS, size["plan_config"]), block_size=block_size)
    c.drafter.num_heads, c.drafter.num_kv_heads, c.drafter.head_dim = 32, 8, 128
    c.drafter.intermediate_size = size["drafter_mlp"]
    # Four sliding-window layers and a full one, window 2048, as the released drafters for these
    # targets (SpecForge's DFlash mask for the sliding layers, docs/design.md §3.2).
    c.drafter.layer_types = ("sliding_attention",) * 4 + ("full_attention",)
    c.drafter.sliding_window = 2048
    fsdp = size.get("fsdp", FSDP_DEVICES if "fsdp" in flags else 1)
    c.mesh.fsdp = fsdp
    return c
