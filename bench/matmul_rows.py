"""What verifying a block costs on a CPU, at its root: XLA's matmul of k rows against k = 1.

    python bench/matmul_rows.py                      # SmolLM2's MLP shape, 60 weights (212 MB)
    python bench/matmul_rows.py --rows 1 2 8 16 --shape 576 1536 --weights 60

A decode step multiplies one row by every weight matrix; verifying a block of k tokens, k rows.
Both read the same weights, so on a memory-bound machine they should cost the same; this times
one jitted function that multiplies a [k, D] input by --weights distinct [D, F] matrices (more
than the caches hold, so every call reads them from memory), for every k in one run, the k
interleaved call by call: the median wall ms and the ratio to k = 1 (docs/design.md §11).
"""

from __future__ import annotations

# First, so that the package's start-up (dflash_jax/startup.py) runs before jax loads.
import dflash_jax  # noqa: F401

# isort: split
import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np


def products(x, weights):
    return sum(jnp.sum(x @ w) for w in weights)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--shape", type=int, nargs=2, default=[576, 1536], metavar=("D", "F"))
    parser.add_argument("--weights", type=int, default=60)
    parser.add_argument("--calls", type=int, default=15)
    args = parser.parse_args()
    d, f = args.shape
    rng = np.random.default_rng(0)
    weights = [jnp.asarray(rng.standard_normal((d, f), np.float32)) for _ in range(args.weights)]
    fn = jax.jit(products)
    inputs = {k: jnp.ones((k, d), jnp.float32) for k in args.rows}
    for x in inputs.values():
        fn(x, weights).block_until_ready()  # compile outside the timed calls
    times = {k: [] for k in args.rows}
    for _ in range(args.calls):
        for k, x in inputs.items():
            start = time.perf_counter()
            fn(x, weights).block_until_ready()
            times[k].append(time.perf_counter() - start)
    mb = args.weights * d * f * 4 / 1e6
    print(
        f"{jax.devices()[0].device_kind}, {args.weights} weights of [{d}, {f}] fp32 ({mb:.0f} MB), median of {args.calls}"
    )
    base = np.median(times[args.rows[0]])
    print(f"{'rows':>5} {'wall ms':>9} {'÷ rows=' + str(args.rows[0]):>10}")
    for k in args.rows:
        median = np.median(times[k])
        print(f"{k:>5} {1000 * median:>9.2f} {median / base:>10.2f}")


if __name__ == "__main__":
    main()
