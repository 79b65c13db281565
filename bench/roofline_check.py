"""The roofline estimate against measured step times, on this machine's CPU.

    python bench/roofline_check.py                      # the default config and the "small" one
    python bench/roofline_check.py --configs=small --steps=5

For each config: the real train step is compiled and timed as bench/train_step.py does (the
fastest of `--steps` steps), and the roofline estimate of the same compiled program
(`dflash_jax/training/roofline.py`) is computed for this CPU, its matmul peak and memory
bandwidth measured before and after the steps (the best of each, as the step time is the
fastest step). Prints both side by side; the estimate aims at the measured time within 30%.
"""

from __future__ import annotations

import argparse

import train_step

from dflash_jax.training import roofline


def measured_cpu(rounds: int) -> roofline.Hardware:
    """This CPU at its best over `rounds` measurements."""
    flops, bandwidth = map(max, zip(*(roofline.measure_cpu() for _ in range(rounds))))
    return roofline.Hardware("cpu", flops, bandwidth, bandwidth)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="default,small")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per config (after one compiling step)")
    args = parser.parse_args()
    print(
        f"{'config':8s} {'measured':>9s} {'predicted':>9s} {'ratio':>6s}   "
        "(kernels: compute-bound + memory-bound; matmul peak, memory bandwidth)"
    )
    for name, setup in train_step.setups(args.configs.split(",")).items():
        before = measured_cpu(3)
        r = train_step.bench(setup, args.steps, hardware=before)
        after = measured_cpu(3)
        best = roofline.Hardware(
            "cpu",
            max(before.matmul_flops, after.matmul_flops),
            *[max(before.memory_bandwidth, after.memory_bandwidth)] * 2,
        )
        est = roofline.estimate(r["kernels"], r["collectives"], best)
        measured = 1 / r["steps_per_s"]
        print(
            f"{name:8s} {measured:8.3f}s {est.step_s:8.3f}s {est.step_s / measured:6.2f}   "
            f"({est.compute_bound_s:.3f} s + {est.kernels_s - est.compute_bound_s:.3f} s; "
            f"{best.matmul_flops / 1e9:.1f} GFLOP/s, {best.memory_bandwidth / 1e9:.1f} GB/s; "
            f"{est.matmul_flops / 1e9:.1f} GFLOP and {est.memory_bytes / 1e9:.2f} GB per step)"
        )


if __name__ == "__main__":
    main()
