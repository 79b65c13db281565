"""DFlash drafter for Qwen3-4B with the paper's recipe, on one host with 8 accelerators.

    python train.py --config=configs/qwen3_4b.py --config.target.path=/models/Qwen3-4B \
        --config.data.train=/data/train.jsonl --config.workdir=/ckpt/qwen3_4b_dflash

Variants after a colon, as for qwen3_8b.py: `b16` (default), `b10`, `b8`, `fsdp`.
"""

from dflash_jax.training.config import apply_variants, base_config


def get_config(variants: str = ""):
    c = base_config()  # the recipe: 6 epochs, lr 6e-4, 4% warmup, cosine, clip 1.0, 512 anchors
    c.drafter.num_layers = 5  # Qwen3-4B also has 36 layers: reads [1, 9, 17, 25, 33]
    c.drafter.mask_token_id = 151669  # <|MASK|>: an existing, unused row of the Qwen3 embedding
    c.data.seq_len = 3072
    c.data.global_batch_rows = 16
    c.data.read_threads = 4
    c.train.remat = True
    c.log.every_steps = 20
    return apply_variants(c, variants)
