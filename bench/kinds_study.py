"""Which drafter kind drafts best on the default job? DFlash, DFlash2 and DSpark (docs/design.md
§12), trained for the same steps on configs/default.py, then measured on the held-out prompts.

    python bench/kinds_study.py                                  # the study: seeds 0 and 1
    python bench/kinds_study.py --seeds=0 --max_steps=20 --num_prompts=4 --max_new_tokens=16,32

Per (kind, seed): τ by real greedy speculative decoding at every --max_new_tokens, the train
step time (the median of the logged intervals after the first, which holds the compilation) and
the decode step time (one drafter pass, the walk and one target verification: decoding seconds
per speculative step, after compiling). Every kind drafts 7 tokens a step, so the target
verifies 8 tokens for each: DFlash and DFlash2 on the default's blocks of 8, DSpark on blocks of
7 (every slot of its block drafts). DSpark trains with its own loss (DeepSpec's; `loss=dflash`
selects its slot weights), the others with the default's. Runs live in --root/<kind>_s<seed>;
a finished run is measured again without retraining (anchor_study's runner).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from anchor_study import DEFAULT_CONFIG, study_target, train_one

from dflash_jax.decoding.acceptance import acceptance_stats
from dflash_jax.decoding.speculative import SpeculativeDecoder
from dflash_jax.models.hf import load_drafter

# The variant of each kind, as anchor_study's runner reads it.
KINDS = {
    "dflash": "drafter.kind=dflash",
    "dflash2": "drafter.kind=dflash2",
    "dspark": "drafter.kind=dspark+drafter.block_size=7+loss=dflash",
}


def train_step_seconds(workdir: str) -> float:
    """The median logged seconds per train step, the first interval (compilation) left out."""
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    rates = [r["steps_per_sec"] for r in rows if r["kind"] == "train"][1:]
    return float(np.median([1 / r for r in rates])) if rates else float("nan")


def decode(target, drafter, prompts, stop_tokens, max_new_tokens: int) -> tuple[float, float]:
    """(τ, seconds per speculative step) of greedy decoding, one prompt at a time, compiled first."""
    decoder = SpeculativeDecoder(
        target, drafter, max_prompt_len=max(map(len, prompts)), max_new_tokens=max_new_tokens, stop_tokens=stop_tokens
    )
    decoder.warmup([len(p) for p in prompts])
    start = time.perf_counter()
    generations = decoder.generate(prompts)
    seconds = time.perf_counter() - start
    steps = sum(len(g.step_lengths) for g in generations)
    return acceptance_stats(generations, drafter.cfg.verify_size)["tau"], seconds / max(steps, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="the config file each kind trains on")
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--max_new_tokens", default="64,256")
    parser.add_argument("--num_prompts", type=int, default=32)
    parser.add_argument("--num_epochs", type=int, default=0, help="0: the default config's")
    parser.add_argument("--max_steps", type=int, default=0, help="0: every step of the epochs")
    parser.add_argument("--root", default=os.path.join("runs", "kinds_study"))
    args = parser.parse_args()
    args.base = ""  # anchor_study's runner: the default config as it is, then the kind's fields
    kinds = args.kinds.split(",")
    seeds = [int(s) for s in args.seeds.split(",")]
    lengths = [int(n) for n in args.max_new_tokens.split(",")]

    _, target, chat, prompts = study_target(args)

    rows = []
    for seed in seeds:  # a seed of every kind first: a study cut short still compares them
        for kind in kinds:
            export, seconds, steps = train_one(KINDS[kind], seed, args)
            drafter = load_drafter(export, param_dtype=jnp.float32, compute_dtype=jnp.float32)
            measured = [decode(target, drafter, prompts, chat.stop_tokens, n) for n in lengths]
            step_seconds = train_step_seconds(os.path.dirname(export))
            rows.append((kind, seed, steps, step_seconds, [t for t, _ in measured], measured[-1][1]))
            print(f"{kind} seed {seed}: {steps} steps, {step_seconds * 1e3:.0f} ms/step, tau {rows[-1][4]}", flush=True)

    taus_header = "".join(f"  tau@{n:<4d}" for n in lengths)
    print(
        f"\n{len(prompts)} held-out prompts (heldout_prompts), greedy, 7 drafts a step; {jax.devices()[0].device_kind}"
    )
    print(f"{'kind':8s} {'seed':>4s} {'steps':>6s} {'train ms':>9s} {'decode ms':>9s}{taus_header}")
    for kind, seed, steps, step_seconds, taus, decode_seconds in rows:
        print(
            f"{kind:8s} {seed:4d} {steps:6d} {step_seconds * 1e3:9.1f} {decode_seconds * 1e3:9.2f}"
            + "".join(f"  {t:8.3f}" for t in taus)
        )
    print("mean per kind (and against DFlash's tau):")
    means = {k: np.mean([r[4] for r in rows if r[0] == k], axis=0) for k in kinds}
    for kind in kinds:
        ratio = "".join(f"  x{m / d:.3f}" for m, d in zip(means[kind], means["dflash"])) if "dflash" in means else ""
        print(f"{kind:8s}" + "".join(f"  {t:8.3f}" for t in means[kind]) + ratio)


if __name__ == "__main__":
    main()
