"""The roofline estimate against measured step times, on this machine's CPU.

    python bench/roofline_check.py                      # the default config and the "small" one
    python bench/roofline_check.py --configs=small --steps=5

For each config: the real train step is compiled and timed as bench/train_step.py does (the
fastest of `--steps` steps), and the roofline estimate of the same compiled program
(`dflash_jax/training/roofline.py`) is computed for this CPU, its matmul peak and bandwidths
measured before and after the steps (the best of each, as the step time is the fastest step).
Prints both side by side; the estimate aims at the measured time within 30%.
"""

from __future__ import annotations

import argparse
import dataclasses

import train_step

from dflash_jax.training import roofline

RATES = ("matmul_flops", "memory_bandwidth", "link_bandwidth", "cache_bandwidth")


def best_of(*measured: roofline.Hardware) -> roofline.Hardware:
    return dataclasses.replace(measured[0], **{f: max(getattr(m, f) for m in measured) for f in RATES})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="default,small")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per config (after one compiling step)")
    args = parser.parse_args()
    print(
        f"{'config':8s} {'measured':>9s} {'predicted':>9s} {'ratio':>6s}   "
        "(kernels compute-bound + memory-bound; this CPU; the step's matmuls and memory traffic)"
    )
    for name, setup in train_step.setups(args.configs.split(",")).items():
        before = best_of(*(roofline.measure_cpu() for _ in range(3)))
        r = train_step.bench(setup, args.steps, hardware=before)
        cpu = best_of(before, *(roofline.measure_cpu() for _ in range(3)))
        est = roofline.estimate(r["kernels"], r["collectives"], cpu)
        measured = 1 / r["steps_per_s"]
        print(
            f"{name:8s} {measured:8.3f}s {est.step_s:8.3f}s {est.step_s / measured:6.2f}   "
            f"({est.compute_bound_s:.3f} s + {est.kernels_s - est.compute_bound_s:.3f} s; "
            f"{cpu.matmul_flops / 1e9:.1f} GFLOP/s, {cpu.memory_bandwidth / 1e9:.1f} GB/s, "
            f"{cpu.cache_bandwidth / 1e9:.0f} GB/s in cache; "
            f"{est.matmul_flops / 1e9:.1f} GFLOP and {est.memory_bytes / 1e9:.2f} GB per step)"
        )


if __name__ == "__main__":
    main()
