"""Tokens/s of the frozen target's packed forward (what every train step runs), per family.

    python bench/target_forward.py                                  # tiny shapes, CPU
    python bench/target_forward.py --hidden=1024 --layers=8 --seq_len=2048

Each family (bench/families.py: dense Qwen3, Qwen3-MoE of the same active parameters, Qwen3.5
hybrid, Qwen3.5-MoE) runs the same packed rows through a jitted forward to its last layer's
hidden states; the rounds interleave the families so a noisy machine disturbs them alike, and the
fastest round counts. Ratios are against dense in the same run.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from families import FAMILIES, add_size_flags, config_from_flags  # bench/families.py
from flax import nnx

from dflash_jax.data.synthetic import packed_batch
from dflash_jax.models.transformer import Transformer


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", nargs="+", default=list(FAMILIES))
    add_size_flags(p)
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--seq_len", type=int, default=512)
    p.add_argument("--rounds", type=int, default=10)
    a = p.parse_args()
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


if __name__ == "__main__":
    main()
