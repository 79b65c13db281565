"""A config's train step compiled under variants, side by side, as `dflash-jax plan` compiles it.

    python bench/compile.py --compare=scan            # qwen3_5.py:27b and gpt_oss.py:120b
    python bench/compile.py --compare=scan --config=configs/qwen3.py:8b --config=configs/deepseek_v3.py:v3
    python bench/compile.py --compare=muon            # configs/qwen3.py:8b
    python bench/compile.py --compare=muon --config=configs/qwen3.py:4b,fsdp

Each variant is planned on 8 simulated CPU devices with abstract weights and the plan's scheduler.
`scan`: `train.scan_layers=False` (every layer of the target and the drafter in the program)
against `True` (each run of a repeating layer pattern under one scan, models/layers/layer_stack.py).
`muon`: AdamW, optax.contrib.muon as it was used before (Newton–Schulz on matrices split by
ZeRO: XLA gathers them for each iteration) and this project's Muon (`training/optim/muon.py`: each
matrix whole on one device). For each: tracing and lowering time, compile time (wall and CPU
seconds: on a shared machine the CPU time is the steadier figure), the peak memory per device and
its temporaries, the collective bytes per step and device by kind, and each against the first.
"""

from __future__ import annotations

import argparse
import os
import sys

from dflash_jax.simulated_devices import plan_xla_flags

_DEVICES = 8
if "jax" not in sys.modules:  # XLA reads its flags once, at start-up
    os.environ["JAX_PLATFORMS"] = "cpu"  # the plan's simulated devices, whatever importing dflash_jax chose
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ["XLA_FLAGS"] = plan_xla_flags(_DEVICES, os.environ.get("XLA_FLAGS", ""))

from contextlib import nullcontext  # noqa: E402
from unittest import mock  # noqa: E402

import jax  # noqa: E402
import optax  # noqa: E402

from dflash_jax.models.layers import layer_stack  # noqa: E402
from dflash_jax.models.transformer import layer_kind  # noqa: E402
from dflash_jax.training import planning  # noqa: E402
from dflash_jax.training.config.presets import load_config_file  # noqa: E402
from dflash_jax.training.config.run_config import resolve  # noqa: E402
from dflash_jax.training.config.targets import target_for_plan  # noqa: E402
from dflash_jax.training.optim import muon  # noqa: E402
from dflash_jax.training.planning.hlo import COLLECTIVE_KINDS  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CONFIGS = {"scan": ("configs/qwen3_5.py:27b", "configs/gpt_oss.py:120b"), "muon": ("configs/qwen3.py:8b",)}


def variants(compare: str, setup) -> dict:
    """label -> (setup, context to compile it in)."""
    if compare == "scan":
        return {f"scan_layers={scan}": (setup.with_run(scan_layers=scan), nullcontext()) for scan in (False, True)}
    # optax.contrib.muon takes the same arguments; ours replaced it in make_optimizer.
    return {
        "AdamW": (setup.with_optimizer("adamw"), nullcontext()),
        "optax Muon": (setup.with_optimizer("muon"), mock.patch.object(muon, "muon", optax.contrib.muon)),
        "whole-matrix Muon": (setup.with_optimizer("muon"), nullcontext()),
    }


def describe_layers(target) -> str:
    """'0-63: 16 x 4' for a scanned segment, '0' for a layer alone."""
    segments = layer_stack.segments([layer_kind(target, i) for i in range(target.num_layers)])
    return ", ".join(
        f"{s.start}-{s.stop - 1}: {s.repeats} x {s.period}" if s.scanned else str(s.start) for s in segments
    )


def figures(plan: planning.Plan) -> list[float]:
    """lowering s, compile s, compile CPU s, peak GiB, temporaries GiB, then GB per collective kind."""
    collective = dict.fromkeys(COLLECTIVE_KINDS, 0.0)
    for c in plan.collectives:
        collective[c.kind] += c.bytes * c.count
    timing = [plan.lower_seconds, plan.compile_seconds, plan.compile_cpu_seconds]
    memory = [plan.peak / planning.GIB, plan.temporaries / planning.GIB]
    return timing + memory + [b / 1e9 for b in collective.values()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compare", choices=sorted(DEFAULT_CONFIGS), required=True)
    parser.add_argument("--config", action="append", help="file:variants (paths from the repo root); repeatable")
    args = parser.parse_args()
    columns = ["lower s", "compile s", "CPU s", "peak GiB", "temps GiB", *(f"{k} GB" for k in COLLECTIVE_KINDS)]
    rows = []
    for name in args.config or DEFAULT_CONFIGS[args.compare]:
        path, _, chosen = name.partition(":")
        config = load_config_file(os.path.join(REPO, path), chosen)
        target, _ = target_for_plan(config)
        if config.drafter.mask_token_id == -1:
            config.drafter.mask_token_id = target.vocab_size - 1  # no tokenizer to look it up in
        setup = resolve(config, num_devices=_DEVICES, target=target, check_files=False)
        print(f"{name}: {target.num_layers} target layers, scanned as {describe_layers(target)}")
        for label, (variant, context) in variants(args.compare, setup).items():
            print(f"  compiling {label} on {_DEVICES} simulated devices ...", flush=True)
            with context:
                rows.append((name, label, figures(planning.plan_train_step(variant, devices=jax.devices()[:_DEVICES]))))
    width, cell = max(len(f"{n} {label}") for n, label, _ in rows) + 2, max(map(len, columns)) + 2
    print(f"\n{'':{width}s}" + "".join(f"{c:>{cell}s}" for c in columns))
    first = {}
    for name, label, values in rows:
        first.setdefault(name, values)
        print(f"{name + ' ' + label:{width}s}" + "".join(f"{v:{cell}.2f}" for v in values))
        if values is not first[name]:
            ratios = [v / f if f else float("nan") for v, f in zip(values, first[name])]
            print(f"{'  ÷ the first':{width}s}" + "".join(f"{r:{cell}.2f}" for r in ratios))


if __name__ == "__main__":
    main()
