"""Tokens/s of the MoE MLP against a dense SwiGLU with the same active parameters.

    python bench/moe_forward.py                          # CPU-sized, under a minute
    python bench/moe_forward.py --tokens=8192 --hidden=2048 --experts=128 --top_k=8 \
        --expert_intermediate=768 --dtype=bfloat16 --impls auto ragged_dot   # Qwen3-30B-A3B layer

The dense SwiGLU has intermediate size A*I, so both do the same useful FLOPs per token; the ratio
says what routing, sorting and the grouped matmul cost on top. Each MoE row is one grouped matmul
implementation (`models.moe.grouped_matmul`). Weights and inputs are random: only shapes matter,
and the router of random weights spreads tokens over experts about evenly. The runs are
interleaved and the median of each is printed, so a busy machine slows every row alike.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dflash_jax.models.architecture import MoeConfig
from dflash_jax.models.layers import SwiGLU
from dflash_jax.models.moe import MoE


def compiled_forward(module: nnx.Module, x: jax.Array):
    """The module's forward as a jitted pure function of its state, compiled for x."""
    graphdef, state = nnx.split(module)
    forward = jax.jit(lambda state, x: nnx.merge(graphdef, state)(x))
    forward(state, x).block_until_ready()
    return lambda: forward(state, x).block_until_ready()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top_k", type=int, default=4)
    p.add_argument("--expert_intermediate", type=int, default=256)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--impls", nargs="+", default=["auto", "ragged_dot"], choices=["auto", "tiled", "ragged_dot"])
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    dtype = jnp.dtype(a.dtype)
    kw = dict(param_dtype=dtype, compute_dtype=dtype, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (a.tokens, a.hidden), dtype)
    config = MoeConfig(
        num_experts=a.experts, num_experts_per_token=a.top_k, expert_intermediate_size=a.expert_intermediate
    )
    runs = {
        f"dense SwiGLU (I={a.top_k * a.expert_intermediate})": compiled_forward(
            SwiGLU(a.hidden, a.top_k * a.expert_intermediate, **kw), x
        )
    }
    for impl in a.impls:
        runs[f"MoE E={a.experts} A={a.top_k} I={a.expert_intermediate} ({impl})"] = compiled_forward(
            MoE(a.hidden, config, matmul=impl, **kw), x
        )
    times = {name: [] for name in runs}
    for _ in range(a.repeats):
        for name, run in runs.items():
            t0 = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t0)

    print(f"{jax.default_backend()}, {a.tokens} tokens, D={a.hidden}, {a.dtype}, median of {a.repeats}")
    dense = None
    for name, ts in times.items():
        seconds = float(np.median(ts))
        dense = dense or seconds
        print(f"  {name:48s} {seconds * 1e3:9.1f} ms  {a.tokens / seconds:12,.0f} tokens/s  x{seconds / dense:6.2f}")
    print("x = time relative to the dense SwiGLU of the same active parameters")


if __name__ == "__main__":
    main()
