"""Tiny CPU run: the bundled tiny Qwen3 target and stdlib demo corpus, a few minutes on 2 cores.

    python train.py
    python train.py --config=configs/default.py --config.workdir=/tmp/dflash_run --config.train.max_steps=50
"""

import os

from dflash_jax.training.config import base_config

ASSETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets")


def get_config():
    c = base_config()
    c.workdir = "runs/default"
    c.target.path = os.path.join(ASSETS, "tiny-qwen3")
    c.target.dtype = "float32"  # CPU: bf16 matmuls are emulated and slower than fp32
    c.train.compute_dtype = "float32"

    c.drafter.num_layers = 1
    c.drafter.block_size = 8

    c.data.train = os.path.join(ASSETS, "data", "stdlib_train.jsonl")
    c.data.seq_len = 512
    c.data.global_batch_rows = 4
    c.data.tokenize_processes = 2
    c.data.read_threads = 0

    c.train.num_epochs = 1
    c.train.num_anchors = 64
    c.train.learning_rate = 3e-3
    c.train.attention_chunk_blocks = 16
    c.train.lm_head_chunk_blocks = 16

    c.checkpoint.every_steps = 100
    c.log.every_steps = 10
    c.eval.prompts = os.path.join(ASSETS, "data", "heldout_prompts.jsonl")
    c.eval.every_steps = 200
    c.eval.num_prompts = 8
    c.eval.max_new_tokens = 64
    return c
