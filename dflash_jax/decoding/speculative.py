"""DFlash speculative decoding (docs/design.md §4), batched, with static shapes, for every drafter
kind (docs/design.md "Drafter kinds": DSpark drafts one more token per block than DFlash, so its
target verifies B + 1 tokens per step; below, B is the number verified).

Invariant between steps, per row: the target KV cache and the drafter's context cache both hold
positions 0..p-1 (prompt and accepted output), and the anchor (the last output token) sits at
position p, in neither cache yet. One step:

  1. the drafter fills the block [anchor, MASK × (B-1)] at positions p..p+B-1 in one forward;
  2. the target verifies [anchor, d1..d_{B-1}] in one forward (its cache now holds p..p+B-1);
  3. a drafts are accepted and the target's bonus token is appended: the output gains a+1 tokens;
  4. the target cache is rolled back to p+a+1, the context cache gets the target features of
     positions p..p+a, and the bonus token becomes the next anchor at p+a+1.

With a verify threshold θ > 0 (`SpeculativeDecoder(verify_threshold=)`), step 2 verifies only as
many tokens as the drafts deserve: the host reads back, per row, how many leading drafts the
drafter itself gives a probability ≥ θ of all being accepted (the running product of q(d_i)),
and the target verifies the anchor and that many drafts, rounded up to a compiled length (2, 4,
... tokens, the whole block). On a CPU a target pass over fewer tokens costs less (XLA:CPU's
matmul of k rows, docs/design.md §11); a draft left out is one never offered, so greedy output
stays the target's and sampled output its distribution.
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dflash_jax.decoding import drafting
from dflash_jax.decoding import outputs as outputs_lib
from dflash_jax.decoding.draft_vocab import DraftVocabulary, FullVocabulary
from dflash_jax.decoding.generate import Decoder, prefill, slots_needed
from dflash_jax.decoding.sampling import SamplingConfig, choose, verify_block, warp_probs
from dflash_jax.models.cache import KVCache
from dflash_jax.models.drafter import ContextCache, DFlashDrafter
from dflash_jax.models.transformer import Transformer


@flax.struct.dataclass
class SpecState:
    target_cache: KVCache
    context: ContextCache
    anchor: jax.Array
    outputs: outputs_lib.Outputs
    key: jax.Array


@flax.struct.dataclass
class Drafted:
    """Step 1's output, which step 2 verifies: drafts [B, K], the logits they were chosen from
    [B, K, V], the drafts proposed [B], how many leading drafts reach the verify threshold [B],
    and the keys of the verification and of the next step."""

    drafts: jax.Array
    draft_logits: jax.Array
    proposed: jax.Array
    confident: jax.Array
    verify_key: jax.Array
    next_key: jax.Array


def verify_lengths(verify_size: int) -> tuple[int, ...]:
    """The verify lengths an adaptive decoder compiles: 2, 4, 8, ... tokens below the whole
    block, and the whole block."""
    return (*(2**k for k in range(1, verify_size.bit_length()) if 2**k < verify_size), verify_size)


def verify_length(confident: np.ndarray, done: np.ndarray, lengths: tuple[int, ...]) -> int:
    """The shortest of `lengths` that verifies the anchor and the confident drafts of every
    running row (a batch verifies one length)."""
    needed = 1 + int(confident[~done].max(initial=0))
    return next((n for n in lengths if n >= needed), lengths[-1])


def confident_drafts(drafts, draft_logits, sampling: SamplingConfig, threshold: float) -> jax.Array:
    """Per row, the leading drafts whose running product of the drafter's probabilities q(d_i)
    (its estimate that all of them are accepted) is at least `threshold`."""
    q = warp_probs(draft_logits, sampling) if not sampling.greedy else jax.nn.softmax(draft_logits, axis=-1)
    q_draft = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    return jnp.sum(jnp.cumprod(q_draft, axis=1) >= threshold, axis=1).astype(jnp.int32)


def draft_block(
    target: Transformer,
    drafter: DFlashDrafter,
    vocab,
    anchor,
    positions,
    context,
    sampling,
    key,
    confidence_threshold=0.0,
    num_slots=None,
):
    """Step 1: one drafter pass over the block at `positions` [B, Bk] -> (drafts [B, K], the
    logits they were chosen from [B, K, V], the number of drafts proposed [B]), K = the kind's
    drafts per block. DFlash drafts every slot after the anchor on its own; DFlash2 and DSpark
    walk the block (`drafting.py`), and DSpark may propose fewer than K. `vocab`: the tokens
    drafted among (`draft_vocab.py`). `num_slots`: the context slots the drafter's attention
    reads (static; None: all)."""
    cfg = drafter.cfg
    block = jnp.full(positions.shape, cfg.mask_token_id, jnp.int32).at[:, 0].set(anchor)
    hidden = drafter.decode(target.embed(block), positions, context, num_slots=num_slots)
    proposed = jnp.full(anchor.shape, cfg.num_drafts, jnp.int32)
    if cfg.kind == "dspark":
        return drafting.markov_walk(vocab, drafter, hidden, anchor, sampling, key, confidence_threshold)
    if cfg.kind == "dflash2":
        return (*drafting.selector_walk(vocab, drafter, hidden, anchor, sampling, key), proposed)
    logits = vocab.logits(hidden[:, 1:])
    return vocab.tokens(choose(logits, sampling, key)), vocab.scatter(logits), proposed


@functools.cache
def spec_fns(
    graphdef: nnx.GraphDef, sampling: SamplingConfig, confidence_threshold: float = 0.0, verify_threshold: float = 0.0
):
    """Jitted (prefill, step, draft, verify) for one (target, drafter) structure, sampling
    setting, DSpark confidence threshold and verify threshold; see `generate.target_fns` for why
    they are built once per graphdef. `step` is `draft` and `verify` of the whole block in one
    call; an adaptive decoder calls the two apart, to choose the verify length in between."""

    @functools.partial(jax.jit, static_argnames=("cache_len", "capacity", "num_slots"))
    def prefill_fn(state, tokens, lengths, valid, key, max_new_tokens, stop_ids, *, cache_len, capacity, num_slots):
        target, drafter, _ = nnx.merge(graphdef, state)
        batch, prompt_len = tokens.shape
        cache = target.new_cache(batch, cache_len, max_step=drafter.cfg.verify_size)
        key, prefill_key = jax.random.split(key)
        first, features, cache = prefill(
            target,
            tokens,
            lengths,
            cache,
            prefill_key,
            sampling,
            feature_layers=drafter.cfg.target_layer_ids,
            num_slots=num_slots,
        )
        context = drafter.new_cache(batch, cache_len)
        positions = jnp.broadcast_to(jnp.arange(prompt_len), (batch, prompt_len))
        context = drafter.extend_context(context, features, positions, lengths)
        out = outputs_lib.Outputs.create(batch, capacity).replace(done=~valid)
        out, _ = outputs_lib.append(
            out, first[:, None], jnp.ones_like(lengths), stop_ids=stop_ids, max_new_tokens=max_new_tokens
        )
        return SpecState(cache, context, first, out, key)

    def draft(state, st: SpecState, num_slots) -> Drafted:
        target, drafter, draft_vocabulary = nnx.merge(graphdef, state)
        vocab = FullVocabulary(target) if draft_vocabulary is None else draft_vocabulary
        key, draft_key, verify_key = jax.random.split(st.key, 3)
        positions = st.target_cache.lengths[:, None] + jnp.arange(drafter.cfg.block_size)[None, :]
        drafts, draft_logits, proposed = draft_block(
            target,
            drafter,
            vocab,
            st.anchor,
            positions,
            st.context,
            sampling,
            draft_key,
            confidence_threshold,
            num_slots,
        )
        confident = confident_drafts(drafts, draft_logits, sampling, verify_threshold) if verify_threshold else proposed
        return Drafted(drafts, draft_logits, proposed, confident, verify_key, key)

    def verify(state, st: SpecState, drafted: Drafted, max_new_tokens, stop_ids, num_slots, verify_len):
        """The target on the anchor and the first verify_len - 1 drafts (DSpark verifies one
        more token than the drafter's block: every slot of its block drafts)."""
        target, drafter, _ = nnx.merge(graphdef, state)
        start = st.target_cache.lengths
        positions = start[:, None] + jnp.arange(verify_len)[None, :]
        drafts, draft_logits = drafted.drafts[:, : verify_len - 1], drafted.draft_logits[:, : verify_len - 1]
        block = jnp.concatenate([st.anchor[:, None], drafts], axis=1)
        logits, features, cache = target.decode(
            block, st.target_cache, feature_layers=drafter.cfg.target_layer_ids, num_slots=num_slots
        )
        proposed = jnp.minimum(drafted.proposed, verify_len - 1)
        accepted, tokens = verify_block(drafts, draft_logits, logits, sampling, drafted.verify_key, proposed)

        out, emitted = outputs_lib.append(
            st.outputs, tokens, accepted + 1, stop_ids=stop_ids, max_new_tokens=max_new_tokens
        )
        # Rows still running keep anchor + accepted drafts; finished rows freeze their caches, so
        # their (ignored) writes stay inside the cache length the decoder sized.
        kept = jnp.where(out.done, 0, accepted + 1)
        cache = cache.replace(lengths=start + kept)
        context = drafter.extend_context(st.context, features, positions, kept)
        anchor = jnp.where(out.done, st.anchor, tokens[jnp.arange(tokens.shape[0]), accepted])
        return SpecState(cache, context, anchor, out, drafted.next_key), emitted

    @functools.partial(jax.jit, donate_argnums=(1,), static_argnames=("num_slots",))
    def step_fn(state, st: SpecState, max_new_tokens, stop_ids, *, num_slots):
        drafted = draft(state, st, num_slots)
        verify_size = drafted.drafts.shape[1] + 1
        return verify(state, st, drafted, max_new_tokens, stop_ids, num_slots, verify_size)

    draft_fn = jax.jit(draft, static_argnames=("num_slots",))
    verify_fn = jax.jit(verify, donate_argnums=(1,), static_argnames=("num_slots", "verify_len"))
    return prefill_fn, step_fn, draft_fn, verify_fn


class SpeculativeDecoder(Decoder):
    """DFlash decoding: one drafter forward and one target forward per step.

    Greedy mode reproduces target-only greedy decoding token for token; sampling mode keeps the
    target's output distribution. `Generation.step_lengths` are the acceptance lengths (a+1,
    cut where a stop token or max_new_tokens ends the output). `confidence_threshold` (DSpark
    drafters only): propose the drafts up to the first slot whose confidence is below it.
    `draft_tokens`: token ids [V'] the drafter drafts among (`draft_vocab.py`; None: all).
    `verify_threshold` in [0, 1): > 0 verifies per step only the drafts the drafter gives at
    least that probability of all being accepted (the module docstring; 0: the whole block).
    """

    def __init__(
        self,
        target: Transformer,
        drafter: DFlashDrafter,
        *,
        confidence_threshold: float = 0.0,
        draft_tokens: np.ndarray | None = None,
        verify_threshold: float = 0.0,
        **kwargs,
    ):
        if drafter.cfg.vocab_size != target.cfg.vocab_size or drafter.cfg.hidden_size != target.cfg.hidden_size:
            raise ValueError(
                f"drafter (vocab {drafter.cfg.vocab_size}, hidden {drafter.cfg.hidden_size}) does not "
                f"fit the target (vocab {target.cfg.vocab_size}, hidden {target.cfg.hidden_size})"
            )
        if drafter.cfg.num_target_layers != target.cfg.num_layers:
            raise ValueError(
                f"drafter was built for a {drafter.cfg.num_target_layers}-layer target, "
                f"this target has {target.cfg.num_layers} layers"
            )
        if confidence_threshold and drafter.cfg.kind != "dspark":
            raise ValueError(f"a confidence threshold needs a DSpark drafter, not a {drafter.cfg.kind!r} one")
        if draft_tokens is not None and not 0 < len(draft_tokens) <= target.cfg.vocab_size:
            raise ValueError(
                f"a draft vocabulary of {len(draft_tokens)} tokens (the target has {target.cfg.vocab_size})"
            )
        if not 0 <= verify_threshold < 1:
            raise ValueError(f"a verify threshold must be in [0, 1), got {verify_threshold}")
        self.block_size = drafter.cfg.verify_size
        self.verify_threshold = verify_threshold
        self.verify_lengths = verify_lengths(drafter.cfg.verify_size)
        vocab = None if draft_tokens is None else DraftVocabulary(target, draft_tokens)
        make_fns = functools.partial(
            spec_fns, confidence_threshold=confidence_threshold, verify_threshold=verify_threshold
        )
        super().__init__((target, drafter, vocab), make_fns, **kwargs)
        self.draft_fn, self.verify_fn = self.fns[2:]

    def _step(self, st, needed: int | None = None, verify_len: int | None = None):
        """One step; with a verify threshold, the draft and the verify as two calls and, between
        them, the verify length read from the drafts (`verify_len`: this one instead)."""
        if not self.verify_threshold:
            return super()._step(st, needed)
        if needed is None:
            needed = slots_needed(*jax.device_get((st.target_cache.lengths, st.outputs.done)), self.block_size)
        num_slots = self._attended_slots(needed)
        drafted = self.draft_fn(self._state, st, num_slots=num_slots)
        if verify_len is None:
            done, confident = jax.device_get((st.outputs.done, drafted.confident))
            verify_len = verify_length(confident, done, self.verify_lengths)
        return self.verify_fn(
            self._state, st, drafted, self._max_new, self._stop_ids, num_slots=num_slots, verify_len=verify_len
        )

    def _warm_step(self, st, num_slots_needed: int):
        for verify_len in self.verify_lengths if self.verify_threshold else (None,):
            st, _ = self._step(st, num_slots_needed, verify_len)
        return st
