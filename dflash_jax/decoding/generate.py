"""Target-only generation (greedy or sampled), batched, with static shapes.

This is the baseline that speculative decoding must reproduce exactly in greedy mode, the
"target alone" speed in `evaluate`, and the built-in back-end of `regenerate`. The pieces that
speculative decoding shares live here too: prompt batching, the prefill and the host loop.

Static shapes: a decoder fixes (batch size, cache length) when it is built; prompts are
right-padded to power-of-two buckets, so only one step function and a few prefill functions
are ever compiled, whatever the prompts.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dflash_jax.decoding import outputs as outputs_lib
from dflash_jax.decoding.sampling import GREEDY, SamplingConfig, choose
from dflash_jax.models.cache import KVCache
from dflash_jax.models.transformer import Transformer

MIN_PROMPT_BUCKET = 16


@dataclasses.dataclass(frozen=True)
class Generation:
    """One prompt's output: the new tokens (stop token included) and, per decoding step, how
    many tokens that step added (the first token comes from the prefill and is in no step)."""

    tokens: np.ndarray
    step_lengths: np.ndarray


def prompt_bucket(length: int) -> int:
    """Prompts are padded to a power of two (at least MIN_PROMPT_BUCKET) to bound compilations."""
    return max(MIN_PROMPT_BUCKET, 1 << max(0, int(length) - 1).bit_length())


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


def prefill(target: Transformer, tokens, lengths, cache: KVCache, key, sampling, feature_layers=()):
    """Run the padded prompts; returns (first new token [B], prompt features or None, cache).

    The cache is rolled back to each prompt's true length, so padding is never attended to.
    """
    logits, features, cache = target.decode(tokens, cache, feature_layers=feature_layers, num_valid=lengths)
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

    @functools.partial(jax.jit, static_argnames=("cache_len", "capacity"))
    def prefill_fn(state, tokens, lengths, valid, key, max_new_tokens, stop_ids, *, cache_len, capacity):
        target = nnx.merge(graphdef, state)
        cache = target.new_cache(tokens.shape[0], cache_len)
        key, prefill_key = jax.random.split(key)
        first, _, cache = prefill(target, tokens, lengths, cache, prefill_key, sampling)
        out = outputs_lib.Outputs.create(tokens.shape[0], capacity).replace(done=~valid)
        out, _ = outputs_lib.append(
            out, first[:, None], jnp.ones_like(lengths), stop_ids=stop_ids, max_new_tokens=max_new_tokens
        )
        return TargetState(cache, first, out, key)

    @functools.partial(jax.jit, donate_argnums=(1,))
    def step_fn(state, st: TargetState, max_new_tokens, stop_ids):
        target = nnx.merge(graphdef, state)
        logits, _, cache = target.decode(st.last[:, None], st.target_cache)
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
    """Call `step(st) -> (st, emitted [B])` until every row is done (or max_steps).

    Returns (final state, emitted per step [steps, B]). Every running row emits >= 1 token per
    step, so this ends after at most max_new_tokens steps. Before each step, checks that every
    running row's cache has room for the `block_size` tokens the step writes.
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
        st, emitted = step(st)
        emitted_steps.append(emitted)
    emitted = np.stack([np.asarray(e) for e in emitted_steps]) if emitted_steps else None
    return st, emitted


def collect(outputs: outputs_lib.Outputs, emitted: np.ndarray | None, num_rows: int) -> list[Generation]:
    tokens, lengths = np.asarray(outputs.tokens), np.asarray(outputs.lengths)
    result = []
    for i in range(num_rows):
        steps = emitted[:, i] if emitted is not None else np.zeros((0,), np.int32)
        result.append(Generation(tokens[i, : lengths[i]].copy(), steps[steps > 0].astype(np.int32)))
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
        )

    def _step(self, st):
        return self.step_fn(self._state, st, self._max_new, self._stop_ids)

    def generate(self, prompts: Sequence[np.ndarray], *, seed: int = 0) -> list[Generation]:
        prompts = [np.asarray(p, np.int32) for p in prompts]
        key = jax.random.key(seed)
        result = []
        for start in range(0, len(prompts), self.batch_size):
            key, batch_key = jax.random.split(key)
            result += self._decode_batch(prompts[start : start + self.batch_size], batch_key)
        return result

    def _decode_batch(self, batch, key, max_steps: int | None = None) -> list[Generation]:
        st = self._prefill(*pad_batch(batch, self.batch_size, self.max_prompt_len), key)
        st, emitted = run_loop(self._step, st, block_size=self.block_size, max_steps=max_steps)
        return collect(st.outputs, emitted, len(batch))

    def warmup(self, prompt_lengths: Sequence[int]) -> None:
        """Compile everything `generate` runs for these prompt lengths (prefill per bucket, step),
        so that timed runs measure decoding only."""
        for bucket in sorted({prompt_bucket(n) for n in prompt_lengths}):
            dummy = np.zeros((min(bucket, self.max_prompt_len),), np.int32)
            self._decode_batch([dummy], jax.random.split(jax.random.key(0))[1], max_steps=2)


class TargetDecoder(Decoder):
    """Target-only decoding: one target forward per token."""

    def __init__(self, target: Transformer, **kwargs):
        super().__init__(target, target_fns, **kwargs)
