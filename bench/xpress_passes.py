"""XPress's refinement, pass by pass: one export decoded with 0 (the backbone's own drafts), 1, ... Jacobi
passes, greedy, on the study's held-out prompts.

    python bench/xpress_passes.py --drafter=RUN/export [--passes=0,1,2,6,7] [--max_new_tokens=64]

The export loads once; each count is its config with `xpress_num_passes` changed (B - 1 passes are
the sequential walk's drafts exactly); the rest is bench/study.py's decode.
"""

from __future__ import annotations

# First, so that the package's start-up (dflash_jax/startup.py) runs before jax loads.
import dflash_jax  # noqa: F401

# isort: split
import argparse
import copy
import os
import sys

import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import study  # noqa: E402  (bench/study.py: the study's target, prompts and decode)

from dflash_jax.models.formats.hf import load_drafter  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", required=True, help="an XPress export directory")
    parser.add_argument("--passes", default="0,1,2,6,7")
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--num_prompts", type=int, default=32)
    parser.add_argument("--config", default=study.DEFAULT_CONFIG)
    args = parser.parse_args()
    _, target, chat, prompts = study.study_target(args)
    drafter = load_drafter(args.drafter, param_dtype=jnp.float32, compute_dtype=jnp.float32)
    exported = drafter.cfg
    print(f"{len(prompts)} held-out prompts, greedy, {args.max_new_tokens} new tokens\npasses  tau")
    for passes in (int(p) for p in args.passes.split(",")):
        # The walk runs as many passes as the config says; a config refuses 0, hence set in place.
        cfg = copy.copy(exported)
        object.__setattr__(cfg, "xpress_num_passes", passes)
        drafter.cfg = cfg
        tau, _ = study.decode(target, drafter, prompts, chat.stop_tokens, args.max_new_tokens)
        print(f"{passes:6d}  {tau:.3f}", flush=True)


if __name__ == "__main__":
    main()
