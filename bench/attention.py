"""The drafter's block attention for one device of a preset, XLA's code against the Pallas kernel,
compiled by the hardware's own compiler without the hardware (libtpu or deviceless XLA:GPU).

    python bench/attention.py                          # Qwen3-30B-A3B's drafter on a TPU v5p
    python bench/attention.py --hardware=tpu-v6e --rows=2 --kv_heads=8   # Qwen3-8B's on a v6e-8
    python bench/attention.py --hardware=h200

One drafter layer's attention, forward and backward (what a train step runs per layer), at the
per-device shapes of a preset: `--rows` rows of `--seq_len` context positions, `--blocks` blocks of
`--block_len` per row. For each implementation: the compile time, the matmul TFLOP and GB the
plan's roofline reads from the optimized program (training/planning/hlo.py; a TPU kernel states its own
cost, for rows that are one document each: rows packed with several visit fewer context tiles),
the roofline time on that hardware, and the temporaries the compiler planned; then the kernel's
time against XLA's. The defaults are Qwen3-30B-A3B's preset on a v5p-8 (16 rows of 3,072 over 4
devices, 512 blocks of 16, 32 query heads over 4 kv heads of 128).
"""

from __future__ import annotations

# First, so that the package's start-up (dflash_jax/startup.py) runs before jax loads.
import dflash_jax  # noqa: F401

# isort: split
import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import SingleDeviceSharding  # noqa: E402

from dflash_jax.models import kernels  # noqa: E402
from dflash_jax.models.layers import block_attention
from dflash_jax.models.layers.chunking import BLOCKS_PER_CHUNK  # noqa: E402
from dflash_jax.training.planning import compilers, hardware, hlo, roofline  # noqa: E402


def compile_layer(args, implementation: str, device) -> tuple[float, str, float]:
    """(compile seconds, optimized HLO, temporaries bytes) of one layer's attention gradients."""
    placed = SingleDeviceSharding(device)
    heads, kv, h = args.heads, args.kv_heads, args.head_dim

    def sds(shape, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=placed)

    blocks = (args.rows, args.blocks, args.block_len)
    shapes = (
        sds((*blocks, heads, h)),
        sds((args.rows, args.seq_len, kv, h)),
        sds((args.rows, args.seq_len, kv, h)),
        sds((*blocks, kv, h)),
        sds((*blocks, kv, h)),
        sds((args.rows, args.blocks, args.seq_len), bool),
    )

    def grads(q, k_ctx, v_ctx, k_blk, v_blk, mask):
        def loss(*qkv):
            out = block_attention.block_attention(
                *qkv, mask, blocks_per_chunk=args.blocks_per_chunk, implementation=implementation
            )
            return out.astype(jnp.float32).sum()

        return jax.grad(loss, argnums=(0, 1, 2, 3, 4))(q, k_ctx, v_ctx, k_blk, v_blk)

    backend = "gpu" if device.platform in ("gpu", "cuda") else "tpu"
    with kernels.compiled_for(backend):
        start = time.perf_counter()
        compiled = jax.jit(grads).lower(*shapes).compile()
        seconds = time.perf_counter() - start
    return seconds, compiled.as_text(), compiled.memory_analysis().temp_size_in_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hardware", default="tpu-v5p", choices=hardware.ACCELERATORS, help="the part compiled for")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--seq_len", type=int, default=3072)
    parser.add_argument("--blocks", type=int, default=512)
    parser.add_argument("--block_len", type=int, default=16)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv_heads", type=int, default=4)
    parser.add_argument("--head_dim", type=int, default=128)
    parser.add_argument("--blocks_per_chunk", type=int, default=BLOCKS_PER_CHUNK, help="XLA's chunk of blocks")
    args = parser.parse_args()

    accelerator = hardware.ACCELERATORS[args.hardware]
    if not compilers.installed(accelerator):
        raise SystemExit(compilers.missing(accelerator))
    device = compilers.devices(accelerator, 4)[0]
    hw = roofline.hardware(args.hardware)
    print(
        f"{args.hardware}: {args.rows} rows x {args.seq_len}, {args.blocks} blocks of {args.block_len}, "
        f"{args.heads} heads over {args.kv_heads} kv heads of {args.head_dim}; forward and backward of one layer"
    )
    print(f"{'implementation':<15}{'compile s':>10}{'TFLOP':>9}{'GB':>9}{'roofline ms':>13}{'temporaries GiB':>17}")
    times = {}
    for implementation in ("xla", "fused"):
        seconds, text, temporaries = compile_layer(args, implementation, device)
        est = roofline.estimate(hlo.kernels(text), hlo.collectives(text), hw)
        times[implementation] = est.step_s
        print(
            f"{implementation:<15}{seconds:>10.1f}{est.matmul_flops / 1e12:>9.2f}{est.memory_bytes / 1e9:>9.2f}"
            f"{est.step_s * 1e3:>13.2f}{temporaries / 2**30:>17.2f}"
        )
    print(f"fused / xla: {times['fused'] / times['xla']:.2f}x the time")


if __name__ == "__main__":
    main()
