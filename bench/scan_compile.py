"""Compile time and memory plan of a config's train step with its layers unrolled and scanned,
side by side.

    python bench/scan_compile.py                                   # qwen3_5.py:27b and gpt_oss.py:120b
    python bench/scan_compile.py --config=configs/qwen3.py:8b --config=configs/deepseek_v3.py:v3

Plans each config's step as `python -m dflash_jax.plan` does (simulated CPU devices, abstract
weights, the plan's scheduler) twice: `train.scan_layers=False` (every layer of the target and
the drafter in the program) and `True` (each run of a repeating layer pattern under one scan,
models/layer_stack.py). Prints for each: the segments the target's layers are cut into, tracing
and lowering time, compile time (wall and CPU seconds: on a shared machine the CPU time is the
steadier figure), the plan's peak memory per device and its temporaries, and scanned over
unrolled.
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

import jax  # noqa: E402

from dflash_jax.models import layer_stack  # noqa: E402
from dflash_jax.models.layer_stack import Segment  # noqa: E402
from dflash_jax.models.transformer import layer_kind  # noqa: E402
from dflash_jax.training import planning  # noqa: E402
from dflash_jax.training.run_config import load_config_file, resolve, target_for_plan  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = ("configs/qwen3_5.py:27b", "configs/gpt_oss.py:120b")


def describe(segments: tuple[Segment, ...]) -> str:
    """'0-63: 16 x 4' for a scanned segment, '0' for a layer alone."""
    parts = []
    for s in segments:
        parts.append(f"{s.start}-{s.stop - 1}: {s.repeats} x {s.period}" if s.scanned else str(s.start))
    return ", ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", action="append", help="file:variants (paths from the repo root); repeatable")
    args = parser.parse_args()
    rows = []
    for name in args.config or CONFIGS:
        path, _, variants = name.partition(":")
        config = load_config_file(os.path.join(REPO, path), variants)
        target, _ = target_for_plan(config)
        if config.drafter.mask_token_id == -1:
            config.drafter.mask_token_id = target.vocab_size - 1  # no tokenizer to look it up in
        setup = resolve(config, num_devices=_DEVICES, target=target, check_files=False)
        kinds = [layer_kind(target, i) for i in range(target.num_layers)]
        print(f"{name}: {target.num_layers} target layers, scanned as {describe(layer_stack.segments(kinds))}")
        plans = {}
        for scan in (False, True):
            chosen = dataclasses.replace(setup, run=dataclasses.replace(setup.run, scan_layers=scan))
            print(f"  compiling with train.scan_layers={scan} on {_DEVICES} simulated devices ...", flush=True)
            plans[scan] = planning.plan_train_step(chosen, devices=jax.devices()[:_DEVICES])
        rows.append((name, plans))
    print(f"\n{'':28s}{'lowered s':>10s}{'compile s':>10s}{'compile CPU s':>14s}{'peak GiB':>10s}{'temps GiB':>10s}")
    for name, plans in rows:
        for scan, plan in plans.items():
            print(
                f"{name + (' scanned' if scan else ' unrolled'):28s}{plan.lower_seconds:10.1f}"
                f"{plan.compile_seconds:10.1f}{plan.compile_cpu_seconds:14.1f}"
                f"{plan.peak / planning.GIB:10.2f}{plan.temporaries / planning.GIB:10.2f}"
            )
        off, on = plans[False], plans[True]
        print(
            f"{'  scanned / unrolled':28s}{on.lower_seconds / off.lower_seconds:10.2f}"
            f"{on.compile_seconds / off.compile_seconds:10.2f}{on.compile_cpu_seconds / off.compile_cpu_seconds:14.2f}"
            f"{on.peak / off.peak:10.3f}{on.temporaries / off.temporaries:10.3f}"
        )


if __name__ == "__main__":
    main()
