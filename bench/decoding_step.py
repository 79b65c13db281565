"""Time one decoding step: target alone (1 token) vs DFlash (draft a block + verify it).

    python bench/decoding_step.py                        # tiny random model, CPU-sized
    python bench/decoding_step.py --hidden=4096 --layers=36 --heads=32 --kv_heads=8 \
        --intermediate=12288 --vocab=151936 --context=2048 --dtype=bfloat16   # Qwen3-8B shape
    python bench/decoding_step.py --family=hybrid    # Qwen3.5 layout (bench/families.py)

With c = DFlash step time / target step time, DFlash's speed-up is about τ / c, so this says
which τ a drafter must reach to pay off on this machine. Weights are random: only shapes matter.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from families import FAMILIES, add_size_flags, config_from_flags  # bench/families.py
from flax import nnx

from dflash_jax.decoding.generate import TargetDecoder, pad_batch
from dflash_jax.decoding.speculative import SpeculativeDecoder
from dflash_jax.models.drafter import DFlashDrafter
from dflash_jax.models.drafter_config import DrafterConfig
from dflash_jax.models.transformer import Transformer


def step_ms(decoder, prompt: np.ndarray, steps: int) -> float:
    """Median time of `steps` decoding steps after the prompt (no stop tokens, so none ends)."""
    st = decoder._prefill(*pad_batch([prompt] * decoder.batch_size, decoder.batch_size, len(prompt)), jax.random.key(0))
    st, _ = decoder._step(st)  # compile
    times = []
    for _ in range(steps):
        jax.block_until_ready(st)
        t0 = time.perf_counter()
        st, _ = decoder._step(st)
        jax.block_until_ready(st)
        times.append(time.perf_counter() - t0)
    return 1000 * float(np.median(times))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", choices=FAMILIES, default="dense")
    add_size_flags(p)
    p.add_argument("--drafter_layers", type=int, default=1)
    p.add_argument("--block_sizes", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--batch_size", type=int, default=1)
    p.add_argument("--context", type=int, default=256, help="prompt tokens before the timed steps")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    a = p.parse_args()
    dtype = jnp.dtype(a.dtype)
    cfg = config_from_flags(a.family, a)
    target = Transformer(cfg, param_dtype=dtype, compute_dtype=dtype, rngs=nnx.Rngs(0))
    prompt = np.random.default_rng(0).integers(0, a.vocab - 1, a.context).astype(np.int32)
    kw = dict(max_prompt_len=a.context, max_new_tokens=a.steps * max(a.block_sizes) + 8, batch_size=a.batch_size)
    base = step_ms(TargetDecoder(target, **kw), prompt, a.steps)
    print(f"{jax.devices()[0].device_kind}, {a.family} target, {a.dtype}, batch {a.batch_size}, context {a.context}")
    print(f"target alone: {base:.3f} ms/step")
    for block in a.block_sizes:
        dcfg = DrafterConfig.for_target(cfg, num_layers=a.drafter_layers, mask_token_id=a.vocab - 1, block_size=block)
        drafter = DFlashDrafter(dcfg, param_dtype=dtype, compute_dtype=dtype, rngs=nnx.Rngs(1))
        ms = step_ms(SpeculativeDecoder(target, drafter, **kw), prompt, a.steps)
        print(
            f"DFlash block {block:>2}: {ms:.3f} ms/step, c = {ms / base:.2f} (faster than the target alone when τ > c)"
        )


if __name__ == "__main__":
    main()
