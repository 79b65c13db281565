"""Test support for training: a tiny target with a chat tokenizer and corpus, and a runner for
`train.py` in a subprocess with a hard timeout."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # tests/support/ -> repository root
VOCAB = 512  # the test tokenizer uses 400 ids; the embedding rows above stay unused
MASK_TOKEN_ID = VOCAB - 1
SEQ_LEN = 128


def write_tiny_run(root: Path) -> types.SimpleNamespace:
    """Target dir (tokenizer + random weights), train / prompt JSONL and a built tokenized cache."""
    from dflash_jax.data.build import ensure_cache
    from support.chat_data import chat, data_config, write_jsonl, write_tiny_target
    from support.hf_reference import write_hf_checkpoint

    target = write_tiny_target(root / "target")
    write_hf_checkpoint(
        target,
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=512,
    )
    rng = random.Random(0)
    pairs = [(rng.randint(0, 99), rng.randint(0, 99)) for _ in range(96)]
    records = [chat(f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}.") for a, b in pairs]
    train = write_jsonl(root / "train.jsonl", records)
    prompts = write_jsonl(root / "prompts.jsonl", records[:2])
    cache = root / "cache"
    ensure_cache(data_config(train, cache, seq_len=SEQ_LEN), str(target))
    return types.SimpleNamespace(
        target=str(target), train=str(train), prompts=str(prompts), cache=str(cache), root=root
    )


def overrides(run: types.SimpleNamespace, workdir, **fields) -> dict:
    """Config fields on top of configs/default.py for a seconds-long run on `run`."""
    return {
        "workdir": str(workdir),
        "target.path": run.target,
        "data.train": run.train,
        "data.cache_dir": run.cache,
        "data.seq_len": SEQ_LEN,
        "data.global_batch_rows": 4,
        "data.tokenize_processes": 1,
        "drafter.mask_token_id": MASK_TOKEN_ID,
        "drafter.block_size": 8,
        # configs/default.py names the bundled 4-layer target's layers; this target has 2.
        "drafter.target_layer_ids": (),
        "train.num_anchors": 16,
        "train.num_epochs": 2,
        "train.attention_chunk_blocks": 8,
        "train.lm_head_chunk_blocks": 8,
        "checkpoint.every_steps": 4,
        "log.every_steps": 1,
        "log.progress_bars": False,
        "eval.prompts": "",
        **fields,
    }


def subprocess_env(compilation_cache: Path, *, devices: int = 1) -> dict:
    """Environment for training subprocesses: CPU, `devices` simulated devices, and a persistent
    compilation cache so repeated runs of one configuration compile once."""
    env = dict(os.environ)
    env.update(
        JAX_PLATFORMS="cpu",
        # Compiling without LLVM optimization halves the time; tiny test models do not care.
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} --xla_backend_optimization_level=0",
        JAX_COMPILATION_CACHE_DIR=str(compilation_cache),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
        PYTHONUNBUFFERED="1",
    )
    return env


def start_training(fields: dict, env: dict, log_path: Path) -> subprocess.Popen:
    """`python train.py --config.k=v ...` in its own process group, output to `log_path`."""
    args = [f"--config.{k}={v}" for k, v in fields.items()]
    with open(log_path, "w") as log:
        return subprocess.Popen(
            [sys.executable, str(REPO / "train.py"), *args],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def kill(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def finish(proc: subprocess.Popen, log_path: Path, timeout: float = 240) -> str:
    """Waits for `proc` (SIGKILL on timeout, then fails) and returns its output."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill(proc)
        raise AssertionError(f"training did not finish in {timeout}s:\n{log_path.read_text()[-4000:]}") from None
    return log_path.read_text()


def wait_for(condition, proc: subprocess.Popen, log_path: Path, timeout: float = 240) -> None:
    """Polls `condition()` while `proc` runs; fails if it exits first or time runs out."""
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            raise AssertionError(f"training exited (rc={proc.returncode}) early:\n{log_path.read_text()[-4000:]}")
        if time.monotonic() > deadline:
            kill(proc)
            raise AssertionError(f"condition not reached in {timeout}s:\n{log_path.read_text()[-4000:]}")
        time.sleep(0.05)
