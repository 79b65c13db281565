"""Collectives per step of Muon under ZeRO against AdamW's, side by side, from the plan's compile.

    python bench/muon_collectives.py                              # configs/qwen3.py:8b, 8 devices
    python bench/muon_collectives.py --config=configs/qwen3.py:4b,fsdp

Compiles the config's train step three times on simulated CPU devices, as `python -m
dflash_jax.plan` does: with AdamW, with optax.contrib.muon as it was used before (Newton–Schulz
on matrices split by ZeRO: XLA gathers them for each iteration) and with this project's Muon
(`training/muon.py`: each matrix whole on one device). Prints each one's collective bytes per
step and device by kind, and Muon's total as a multiple of AdamW's.
"""

from __future__ import annotations

import argparse
import os
import sys

from dflash_jax.simulated_devices import plan_xla_flags

_DEVICES = 8
if "jax" not in sys.modules:  # XLA reads its flags once, at start-up
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ["XLA_FLAGS"] = plan_xla_flags(_DEVICES, os.environ.get("XLA_FLAGS", ""))

import dataclasses  # noqa: E402
from contextlib import nullcontext  # noqa: E402
from unittest import mock  # noqa: E402

import jax  # noqa: E402
import optax  # noqa: E402

from dflash_jax.training import muon, planning  # noqa: E402
from dflash_jax.training.hlo import COLLECTIVE_KINDS  # noqa: E402
from dflash_jax.training.run_config import load_config_file, resolve, target_for_plan  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def by_kind(plan: planning.Plan) -> dict[str, float]:
    totals = dict.fromkeys(COLLECTIVE_KINDS, 0.0)
    for c in plan.collectives:
        totals[c.kind] += c.bytes * c.count
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/qwen3.py:8b", help="file:variants (paths from the repo root)")
    args = parser.parse_args()
    path, _, variants = args.config.partition(":")
    config = load_config_file(os.path.join(REPO, path), variants)
    target, _ = target_for_plan(config)
    setup = resolve(config, num_devices=_DEVICES, target=target, check_files=False)
    runs = {}
    for label, optimizer in (("AdamW", "adamw"), ("optax Muon", "muon"), ("whole-matrix Muon", "muon")):
        chosen = dataclasses.replace(setup, optimizer=dataclasses.replace(setup.optimizer, optimizer=optimizer))
        # optax.contrib.muon takes the same arguments; ours replaced it in make_optimizer.
        before = mock.patch.object(muon, "muon", optax.contrib.muon) if label == "optax Muon" else nullcontext()
        print(f"compiling {args.config} with {label} on {_DEVICES} simulated devices ...", flush=True)
        with before:
            runs[label] = by_kind(planning.plan_train_step(chosen, devices=jax.devices()[:_DEVICES]))
    print(f"\ncollectives per step and device, GB (whole buffers), {args.config}:")
    print(f"{'':20s}" + "".join(f"{kind:>20s}" for kind in COLLECTIVE_KINDS) + f"{'total':>10s}{'x AdamW':>9s}")
    adamw = sum(runs["AdamW"].values())
    for label, kinds in runs.items():
        total = sum(kinds.values())
        print(
            f"{label:20s}"
            + "".join(f"{b / 1e9:20.2f}" for b in kinds.values())
            + f"{total / 1e9:10.2f}{total / adamw:9.2f}"
        )


if __name__ == "__main__":
    main()
