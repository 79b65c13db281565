"""Which anchor scheme trains the better drafter? Held-out acceptance length decides, not the loss.

    python bench/anchor_study.py                                  # every scheme, seeds 0 and 1
    python bench/anchor_study.py --schemes=document,document:16,row --seeds=0 --num_epochs=1

A scheme is one of `train.anchor_scheme`'s values, `document:N` meaning 'document' with
`train.anchors_per_document=N`. Trains `configs/default.py` once per (scheme, seed), the same
number of steps each (the
seed sets the drafter init, the anchors and the data order), then measures τ by real greedy
speculative decoding on the bundled held-out prompts for every `--max_new_tokens`, and prints
one row per run and the mean per scheme, side by side. Runs live in `--root/<scheme>_s<seed>`;
a finished run is evaluated again without retraining, so an interrupted study resumes.
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.decoding.acceptance import measure_acceptance
from dflash_jax.decoding.chat import ChatTokenizer, load_prompts
from dflash_jax.models.hf import load_drafter, load_target
from dflash_jax.training.config import load_config_file, resolve
from dflash_jax.training.loop import train
from dflash_jax.training.objective import ANCHOR_SCHEMES

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", "default.py")


def train_one(scheme: str, seed: int, args) -> tuple[str, float, int]:
    """(export directory, training seconds, steps) of one run."""
    config = load_config_file(DEFAULT_CONFIG)
    config.workdir = os.path.join(args.root, f"{scheme.replace(':', '_cap')}_s{seed}")
    name, _, cap = scheme.partition(":")
    config.train.anchor_scheme = name
    config.train.anchors_per_document = int(cap or 0)
    config.seed = config.data.seed = seed
    config.train.max_steps = args.max_steps
    config.train.num_epochs = args.num_epochs or config.train.num_epochs
    config.eval.every_steps = 0  # measured below, the same way for every run
    config.log.progress_bars = False
    setup = resolve(config, num_devices=jax.device_count())
    start = time.perf_counter()
    outcome = train(setup)
    return setup.workdir.export, time.perf_counter() - start, outcome.step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schemes", default=",".join([*ANCHOR_SCHEMES, "document:16"]))
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--max_new_tokens", default="64,256")
    parser.add_argument("--num_prompts", type=int, default=32)
    parser.add_argument("--num_epochs", type=int, default=0, help="0: the default config's")
    parser.add_argument("--max_steps", type=int, default=0, help="0: every step of the epochs")
    parser.add_argument("--root", default="runs/anchor_study")
    args = parser.parse_args()
    schemes, seeds = args.schemes.split(","), [int(s) for s in args.seeds.split(",")]
    lengths = [int(n) for n in args.max_new_tokens.split(",")]

    config = load_config_file(DEFAULT_CONFIG)
    target = load_target(config.target.path, param_dtype=jnp.float32, compute_dtype=jnp.float32)
    chat = ChatTokenizer(config.target.path)
    _, prompts = load_prompts("heldout_prompts", chat, limit=args.num_prompts)

    rows = []
    for scheme in schemes:
        for seed in seeds:
            export, seconds, steps = train_one(scheme, seed, args)
            drafter = load_drafter(export, param_dtype=jnp.float32, compute_dtype=jnp.float32)
            taus = [
                measure_acceptance(target, drafter, prompts, max_new_tokens=n, stop_tokens=chat.stop_tokens)["tau"]
                for n in lengths
            ]
            rows.append((scheme, seed, steps, seconds, taus))
            print(f"{scheme} seed {seed}: {steps} steps in {seconds:.0f} s, tau {taus}", flush=True)

    taus_header = "".join(f"  tau@{n:<4d}" for n in lengths)
    print(f"\n{len(prompts)} held-out prompts (heldout_prompts), greedy; {config.drafter.block_size=}")
    print(f"{'scheme':12s} {'seed':>4s} {'steps':>6s} {'train_s':>8s}{taus_header}")
    for scheme, seed, steps, seconds, taus in rows:
        print(f"{scheme:12s} {seed:4d} {steps:6d} {seconds:8.0f}" + "".join(f"  {t:8.3f}" for t in taus))
    print("mean per scheme:")
    for scheme in schemes:
        mean = np.mean([taus for s, _, _, _, taus in rows if s == scheme], axis=0)
        print(f"{scheme:12s} {'':4s} {'':6s} {'':8s}" + "".join(f"  {t:8.3f}" for t in mean))


if __name__ == "__main__":
    main()
