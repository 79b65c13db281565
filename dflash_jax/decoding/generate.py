"""Target-only generation (greedy or sampled), batched, with static shapes.

This is the baseline that speculative decoding must reproduce exactly in greedy mode, the
"target alone" speed in `evaluate`, and the built-in back-end of `regenerate`. The pieces that
speculative decoding shares live here too: prompt batching, the prefill and the host loop.

Static shapes: a decoder fixes (batch size, cache length) when it is built; prompts are
right-padded to power-of-two buckets, and each step's attention reads only a bucketed prefix
of the caches (`attended_slots`: the host loop reads the lengths back before every step anyway
and passes the bucket as a static argument), so a few prefill functions and a few step
functions are compiled, whatever the prompts.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dflash_jax.decoding import outputs as outputs_lib
from dflash_jax.decoding.sampling import GREEDY, SamplingConfig, choose
from dflash_jax.models.layers.cache import KVCache
from dflash_jax.models.transformer import Transformer

MIN_PROMPT_BUCKET = 16
# Attention reads the used cache slots rounded up to a multiple of this, or of a quarter of
# their power of two where that is larger (at most 4 buckets per doubling of the context).
SLOT_BUCKET = 128


@dataclasses.dataclass(frozen=True)
class Generation:
    """One prompt's output: the new tokens (stop token included) and, per decoding step, how
    many tokens that step added (the first token comes from the prefill and is in no step).
    `first_token_s`: the seconds its batch took to the first token (the prefill; serving's
    time to first token), so that the decoding after it can be timed apart."""

    tokens: np.ndarray
    step_lengths: np.ndarray
    first_token_s: float = 0.0


def prompt_bucket(length: int) -> int:
    """Prompts are padded to a power of two (at least MIN_PROMPT_BUCKET) to bound compilations."""
    return max(MIN_PROMPT_BUCKET, 1 << max(0, int(length) - 1).bit_length())


def attended_slots(needed: int, cache_len: int, bucket: int = SLOT_BUCKET) -> int:
    """The cache slots a step's attention reads when it needs the first `needed`: `needed`
    rounded up to a multiple of max(bucket, 2^⌊log2 needed⌋ / 4), at most the cache; bucket 0:
    every slot. A bucket, not `needed` itself, so that a generation compiles a handful of steps."""
    if not bucket:
        return cache_len
    multiple = max(bucket, 1 << max(0, int(needed).bit_length() - 3))
    return min(cache_len, -(-int(needed) // multiple) * multiple)


def slots_needed(lengths: np.ndarray, done: np.ndarray, block_size: int) -> int:
    """The cache slots a step writing `block_size` tokens after each row's length must attend:
    through the longest running row's block (every row's, once none runs)."""
    running = lengths[~done] if not done.all() else lengths
    return int(running.max()) + block_size


def pad_batch(prompts: Sequence[np.ndarray], batch_size: int, max_prompt_len: int):
    """Right-pad up to batch_size prompts -> (tokens [B, bucket], lengths [B], valid [B]).

    Missing rows (a short last batch) get a one-token dummy prompt and valid=False.
    """
    if not 0 < len(prompts) <= batch_size:
        raise ValueError(f"expected 1..{batch_size} prompts, got {len(prompts)}")
    lengths = np.ones((batch_size,), np.int32)
    for i, p in enumerate(prompts):
        if p.ndim != 1 or not len(p):
            raise ValueError(f"prompt {i} must be a non-empty 1-D token array, got shape {p.shape}")
        if len(p) > max_prompt_len:
            raise ValueError(f"prompt {i} has {len(p)} tokens, more than max_prompt_len={max_prompt_len}")
        lengths[i] = len(p)
    tokens = np.zeros((batch_size, prompt_bucket(lengths.max())), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    valid = np.arange(batch_size) < len(prompts)
    return tokens, lengths, valid


def prefill(target: Transformer, tokens, lengths, cache: KVCache, key, sampling, feature_layers=(), num_slots=None):
    """Run the padded prompts; returns (first new token [B], prompt features or None, cache).

    The cache is rolled back to each prompt's true length, so padding is never attended to.
    `num_slots`: the cache slots attention reads (static, >= the padded prompt; None: all).
    """
    logits, features, cache = target.decode(
        tokens, cache, feature_layers=feature_layers, num_valid=lengths, num_slots=num_slots
    )
    last = logits[jnp.arange(tokens.shape[0]), lengths - 1]
    return choose(last, sampling, key), features, cache.replace(lengths=lengths)


@flax.struct.dataclass
class TargetState:
    """The last output token is not in the cache yet: the next step feeds it."""

    target_cache: KVCache
    last: jax.Array
    outputs: outputs_lib.Outputs
    key: jax.Array


@functools.cache
def target_fns(graphdef: nnx.GraphDef, sampling: SamplingConfig):
    """Jitted (prefill, step) for one model structure and sampling setting.

    Built once per (graphdef, sampling) so the graphdef is hashed here, not as a static argument
    on every step: hashing a large model's graphdef costs milliseconds per call.
    """

    @functools.partial(jax.jit, static_argnames=("cache_len", "capacity", "num_slots"))
    def prefill_fn(state, tokens, lengths, valid, key, max_new_tokens, stop_ids, *, cache_len, capacity, num_slots):
        target = nnx.merge(graphdef, state)
        cache = target.new_cache(tokens.shape[0], cache_len)
        key, prefill_key = jax.random.split(key)
        first, _, cache = prefill(target, tokens, lengths, cache, prefill_key, sampling, num_slots=num_slots)
        out = outputs_lib.Outputs.create(tokens.shape[0], capacity).replace(done=~valid)
        out, _ = outputs_lib.append(
            out, first[:, None], jnp.ones_like(lengths), stop_ids=stop_ids, max_new_tokens=max_new_tokens
        )
        return TargetState(cache, first, out, key)

    @functools.partial(jax.jit, donate_argnums=(1,), static_argnames=("num_slots",))
    def step_fn(state, st: TargetState, max_new_tokens, stop_ids, *, num_slots):
        target = nnx.merge(graphdef, state)
        logits, _, cache = target.decode(st.last[:, None], st.target_cache, num_slots=num_slots)
        key, step_key = jax.random.split(st.key)
        token = choose(logits[:, 0], sampling, step_key)
        out, emitted = outputs_lib.append(
            st.outputs, token[:, None], jnp.ones_like(token), stop_ids=stop_ids, max_new_tokens=max_new_tokens
        )
        # Finished rows keep their cache length, so their (ignored) writes never run off the end.
        cache = cache.replace(lengths=jnp.where(out.done, st.target_cache.lengths, cache.lengths))
        return TargetState(cache, token, out, key), emitted

    return prefill_fn, step_fn


class CacheOverflowError(RuntimeError):
    """A decoding step would write past the end of a KV cache (a bug: `Decoder` sizes its caches
    so that this cannot happen; a write past the end would be dropped silently)."""


def run_loop(step: Callable, st, *, block_size: int, max_steps: int | None = None) -> tuple[object, np.ndarray | None]:
    """Call `step(st, slots needed) -> (st, emitted [B])` until every row is done (or max_steps).

    Returns (final state, emitted per step [steps, B]). Every running row emits >= 1 token per
    step, so this ends after at most max_new_tokens steps. Before each step, checks that every
    running row's cache has room for the `block_size` tokens the step writes, and tells the step
    how many cache slots its attention needs (`slots_needed`).
    """
    emitted_steps = []
    while len(emitted_steps) != max_steps:
        done, lengths = jax.device_get((st.outputs.done, st.target_cache.lengths))
        if done.all():
            break
        room = st.target_cache.max_len - lengths[~done]
        if room.min() < block_size:
            raise CacheOverflowError(
                f"the next step writes {block_size} tokens but a row's KV cache of {st.target_cache.max_len} "
                f"slots has only {room.min()} left"
            )
        st, emitted = step(st, slots_needed(lengths, done, block_size))
        emitted_steps.append(emitted)
    emitted = np.stack([np.asarray(e) for e in emitted_steps]) if emitted_steps else None
    return st, emitted


def collect(
    outputs: outputs_lib.Outputs, emitted: np.ndarray | None, num_rows: int, first_token_s: float = 0.0
) -> list[Generation]:
    tokens, lengths = np.asarray(outputs.tokens), np.asarray(outputs.lengths)
    result = []
    for i in range(num_rows):
        steps = emitted[:, i] if emitted is not None else np.zeros((0,), np.int32)
        result.append(Generation(tokens[i, : lengths[i]].copy(), steps[steps > 0].astype(np.int32), first_token_s))
    return result


def _round_up(n: int, multiple: int = 64) -> int:
    return -(-n // multiple) * multiple


class Decoder:
    """Common driver: batching, seeds, warm-up, over the jitted (prefill, step) pair that
    `make_fns(graphdef, sampling)` builds for the decoded models."""

    block_size = 1

    def __init__(
        self,
        models,
        make_fns: Callable,
        *,
        max_prompt_len: int,
        max_new_tokens: int,
        batch_size: int = 1,
        sampling: SamplingConfig = GREEDY,
        stop_tokens: Sequence[int] = (),
        slot_bucket: int = SLOT_BUCKET,
    ):
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self.max_prompt_len = max_prompt_len
        self.max_new_tokens = max_new_tokens
        self.batch_size = batch_size
        self.sampling = sampling
        self._stop_ids = outputs_lib.stop_ids(stop_tokens)
        self._max_new = jnp.asarray(max_new_tokens, jnp.int32)
        # Room for the padded prompt, every new token and one block of (rejected) drafts, rounded
        # up so that nearby max_new_tokens settings share compiled steps.
        self.cache_len = _round_up(prompt_bucket(max_prompt_len) + max_new_tokens + self.block_size)
        self.capacity = _round_up(max_new_tokens + self.block_size)
        self.slot_bucket = slot_bucket  # `attended_slots`; 0: attention reads every cache slot
        graphdef, self._state = nnx.split(models)
        self.prefill_fn, self.step_fn = make_fns(graphdef, sampling)

    def _prefill(self, tokens, lengths, valid, key):
        return self.prefill_fn(
            self._state,
            tokens,
            lengths,
            valid,
            key,
            self._max_new,
            self._stop_ids,
            cache_len=self.cache_len,
            capacity=self.capacity,
            num_slots=self._attended_slots(tokens.shape[1]),
        )

    def _attended_slots(self, needed: int) -> int:
        return attended_slots(needed, self.cache_len, self.slot_bucket)

    def _step(self, st, needed: int | None = None):
        """One step whose attention reads the bucket of `needed` cache slots (default: what
        `slots_needed` says of `st`, read back)."""
        if needed is None:
            done, lengths = jax.device_get((st.outputs.done, st.target_cache.lengths))
            needed = slots_needed(lengths, done, self.block_size)
        return self.step_fn(self._state, st, self._max_new, self._stop_ids, num_slots=self._attended_slots(needed))

    def generate(self, prompts: Sequence[np.ndarray], *, seed: int = 0) -> list[Generation]:
        prompts = [np.asarray(p, np.int32) for p in prompts]
        key = jax.random.key(seed)
        result = []
        for start in range(0, len(prompts), self.batch_size):
            key, batch_key = jax.random.split(key)
            result += self._decode_batch(prompts[start : start + self.batch_size], batch_key)
        return result

    def _decode_batch(self, batch, key, max_steps: int | None = None) -> list[Generation]:
        start = time.perf_counter()
        # Waiting for the prefill costs nothing: the loop reads its state back before the first step.
        st = jax.block_until_ready(self._prefill(*pad_batch(batch, self.batch_size, self.max_prompt_len), key))
        first_token_s = time.perf_counter() - start
        st, emitted = run_loop(self._step, st, block_size=self.block_size, max_steps=max_steps)
        return collect(st.outputs, emitted, len(batch), first_token_s)

    def warmup(self, prompt_lengths: Sequence[int]) -> None:
        """Compile everything `generate` runs for these prompt lengths (prefill per prompt bucket,
        step per bucket of attended slots, from the shortest prompt's first step to the longest
        prompt's last), so that timed runs measure decoding only."""
        key = jax.random.key(0)
        for bucket in sorted({prompt_bucket(n) for n in prompt_lengths}):
            dummy = np.zeros((min(bucket, self.max_prompt_len),), np.int32)
            st = self._prefill(*pad_batch([dummy], self.batch_size, self.max_prompt_len), key)
        first = min(prompt_lengths) + self.block_size
        last = max(prompt_lengths) + self.max_new_tokens + self.block_size
        # Steps on the dummy's state, whatever slots it needs: only their compilation matters.
        for slots in sorted({self._attended_slots(n) for n in range(first, last + 1)}):
            st, _ = self._step(st, slots)
        jax.block_until_ready(st)


class TargetDecoder(Decoder):
    """Target-only decoding: one target forward per token."""

    def __init__(self, target: Transformer, **kwargs):
        super().__init__(target, target_fns, **kwargs)
