"""XPress's refinement, pass by pass: one export decoded with 0 (the backbone's own drafts), 1, ... Jacobi
passes, greedy, on the study's held-out prompts.

    python bench/xpress_passes.py --drafter=RUN/export [--passes=0,1,2,6,7] [--max_new_tokens=64]

Each count is the export's config.json with `xpress_num_passes` changed (B - 1 passes are the
sequential walk's drafts exactly); the rest is bench/study.py's decode.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import sys
import tempfile

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
    config, target, chat, prompts = study.study_target(args)
    with open(os.path.join(args.drafter, "config.json")) as f:
        exported = json.load(f)
    print(f"{len(prompts)} held-out prompts, greedy, {args.max_new_tokens} new tokens\npasses  tau")
    for passes in (int(p) for p in args.passes.split(",")):
        with tempfile.TemporaryDirectory() as edited:
            for name in os.listdir(args.drafter):
                shutil.copy(os.path.join(args.drafter, name), edited)
            with open(os.path.join(edited, "config.json"), "w") as f:
                json.dump({**exported, "xpress_num_passes": max(passes, 1)}, f)
            drafter = load_drafter(edited, param_dtype=jnp.float32, compute_dtype=jnp.float32)
        if passes == 0:  # a config asks for at least one pass; the walk runs as many as it says
            cfg = copy.copy(drafter.cfg)
            object.__setattr__(cfg, "xpress_num_passes", 0)
            drafter.cfg = cfg
        tau, _ = study.decode(target, drafter, prompts, chat.stop_tokens, args.max_new_tokens)
        print(f"{passes:6d}  {tau:.3f}", flush=True)


if __name__ == "__main__":
    main()
