"""Forward-pass throughput: the frozen target's packed forward per family, and one MoE layer.

    python bench/forward.py families                               # tiny shapes, CPU
    python bench/forward.py families --hidden=1024 --layers=8 --seq_len=2048
    python bench/forward.py moe                                    # CPU-sized, under a minute
    python bench/forward.py moe --tokens=8192 --hidden=2048 --experts=128 --top_k=8 \
        --expert_intermediate=768 --dtype=bfloat16 --impls auto ragged_dot   # Qwen3-30B-A3B layer

`families`: each family (bench/families.py: dense Qwen3, Qwen3-MoE of the same active
parameters, Qwen3.5 hybrid, Qwen3.5-MoE) runs the same packed rows (what every train step runs)
through a jitted forward to its last layer's hidden states; the rounds interleave the families
so a noisy machine disturbs them alike, and the fastest round counts. Ratios are against dense.

`moe`: the MoE MLP against a dense SwiGLU of intermediate size A*I, so both do the same useful
FLOPs per token; the ratio says what routing, sorting and the grouped matmul cost on top. Each
MoE row is one grouped matmul implementation (`models.moe.grouped_matmul`). Random weights and
inputs: only shapes matter, and a random router spreads tokens over experts about evenly. The
runs are interleaved and the median of each is printed.
"""

from __future__ import annotations

# First, so that the package's start-up (dflash_jax/startup.py) runs before jax loads.
import dflash_jax  # noqa: F401

# isort: split
import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from families import FAMILIES, add_size_flags, config_from_flags  # bench/families.py
from flax import nnx

from dflash_jax.data.synthetic import packed_batch
from dflash_jax.models.architecture import MoeConfig
from dflash_jax.models.layers.basic import SwiGLU
from dflash_jax.models.layers.moe import MoE
from dflash_jax.models.transformer import Transformer


def families(p: argparse.ArgumentParser, argv: list[str]) -> None:
    p.add_argument("--families", nargs="+", default=list(FAMILIES))
    add_size_flags(p)
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--seq_len", type=int, default=512)
    p.add_argument("--rounds", type=int, default=10)
    a = p.parse_args(argv)
    batch = packed_batch(np.random.default_rng(0), a.rows, a.seq_len, a.vocab - 1, doc_len=(64, a.seq_len // 2))
    args = tuple(jnp.asarray(batch[k]) for k in ("tokens", "segment_ids", "positions"))
    real = float((batch["segment_ids"] != 0).sum())
    forwards = {}
    for family in a.families:
        graphdef, state = nnx.split(Transformer(config_from_flags(family, a), rngs=nnx.Rngs(0)))

        @jax.jit
        def forward(state, tokens, segment_ids, positions, graphdef=graphdef):
            model = nnx.merge(graphdef, state)
            return model(tokens, segment_ids, positions, hidden_layers=(a.layers - 1,), return_logits=False)[1]

        jax.block_until_ready(forward(state, *args))  # compile
        forwards[family] = (forward, state)
    best = {family: float("inf") for family in forwards}
    for _ in range(a.rounds):
        for family, (forward, state) in forwards.items():
            start = time.perf_counter()
            jax.block_until_ready(forward(state, *args))
            best[family] = min(best[family], time.perf_counter() - start)
    print(f"{jax.devices()[0].device_kind}: {a.rows} x {a.seq_len} packed tokens, {a.layers} layers, hidden {a.hidden}")
    for family, seconds in best.items():
        ratio = f"  {seconds / best['dense']:.2f}x dense's time" if "dense" in best else ""
        print(f"{family:>11}: {1000 * seconds:8.2f} ms  {real / seconds:9.0f} tokens/s{ratio}")


def compiled_forward(module: nnx.Module, x: jax.Array):
    """The module's forward as a jitted pure function of its state, compiled for x."""
    graphdef, state = nnx.split(module)
    forward = jax.jit(lambda state, x: nnx.merge(graphdef, state)(x))
    forward(state, x).block_until_ready()
    return lambda: forward(state, x).block_until_ready()


def moe_layer(p: argparse.ArgumentParser, argv: list[str]) -> None:
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top_k", type=int, default=4)
    p.add_argument("--expert_intermediate", type=int, default=256)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--impls", nargs="+", default=["auto", "ragged_dot"], choices=["auto", "tiled", "ragged_dot"])
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args(argv)
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


PARTS = {"families": families, "moe": moe_layer}


def main():
    if len(sys.argv) < 2 or sys.argv[1] not in PARTS:
        raise SystemExit(
            f"usage: python bench/forward.py {{{','.join(PARTS)}}} [flags]; --help after one lists its flags"
        )
    part = sys.argv[1]
    parser = argparse.ArgumentParser(
        prog=f"bench/forward.py {part}", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    PARTS[part](parser, sys.argv[2:])


if __name__ == "__main__":
    main()
