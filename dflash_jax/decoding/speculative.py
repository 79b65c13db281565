"""DFlash speculative decoding (docs/design.md §4), batched, with static shapes, for every drafter
kind (docs/design.md "Drafter kinds": a kind whose every slot drafts proposes one more token per
block than DFlash, so its target verifies B + 1 tokens per step; below, B is the number verified,
`DrafterConfig.verify_size`).

Invariant between steps, per row: the target KV cache and the drafter's context cache both hold
positions 0..p-1 (prompt and accepted output), and the anchor (the last output token) sits at
position p, in neither cache yet. One step:

  1. the drafter fills the block [anchor, MASK × (B-1)] at positions p..p+B-1 in one forward;
  2. the target verifies [anchor, d1..d_{B-1}] in one forward (its cache now holds p..p+B-1);
  3. a drafts are accepted and the target's bonus token is appended: the output gains a+1 tokens;
  4. the target cache is rolled back to p+a+1, the context cache gets the target features of
     positions p..p+a, and the bonus token becomes the next anchor at p+a+1.
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dflash_jax.decoding import outputs as outputs_lib
from dflash_jax.decoding.draft_vocab import DraftVocabulary, FullVocabulary
from dflash_jax.decoding.generate import Decoder, prefill
from dflash_jax.decoding.kinds import WALKS
from dflash_jax.decoding.sampling import SamplingConfig, verify_block
from dflash_jax.errors import ModelError
from dflash_jax.models import kinds
from dflash_jax.models.architecture import TransformerConfig
from dflash_jax.models.drafter import ContextCache, DFlashDrafter
from dflash_jax.models.drafter_config import DrafterConfig
from dflash_jax.models.layers.cache import KVCache
from dflash_jax.models.transformer import Transformer


def check_fits(
    drafter: DrafterConfig, target: TransformerConfig, what: str = "the drafter", target_name: str = "the target"
) -> None:
    """A one-line ModelError, `what` does not fit `target_name`, unless `drafter` was made for a
    target of `target`'s hidden size and vocabulary, with the layers it reads."""
    problems = []
    if drafter.hidden_size != target.hidden_size:
        problems.append(f"hidden size {drafter.hidden_size} (the target's: {target.hidden_size})")
    if drafter.vocab_size != target.vocab_size:
        problems.append(f"vocabulary of {drafter.vocab_size} (the target's: {target.vocab_size})")
    if drafter.num_target_layers != target.num_layers:
        problems.append(f"made for a {drafter.num_target_layers}-layer target (this one has {target.num_layers})")
    if missing := [i for i in drafter.target_layer_ids if not 0 <= i < target.num_layers]:
        problems.append(f"reads target layers {missing}, which the target does not have")
    if problems:
        raise ModelError(f"{what} does not fit {target_name}: {'; '.join(problems)}")


@flax.struct.dataclass
class SpecState:
    target_cache: KVCache
    context: ContextCache
    anchor: jax.Array
    outputs: outputs_lib.Outputs
    key: jax.Array


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
    drafts per block, by the kind's walk (decoding/kinds/; a confidence threshold may propose fewer).
    `vocab`: the tokens drafted among (`draft_vocab.py`). `num_slots`: the context slots the
    drafter's attention reads (static; None: all)."""
    cfg = drafter.cfg
    block = jnp.full(positions.shape, cfg.mask_token_id, jnp.int32).at[:, 0].set(anchor)
    hidden = drafter.decode(target.embed(block), positions, context, num_slots=num_slots)
    return WALKS[cfg.kind](vocab, drafter, hidden, anchor, sampling, key, confidence_threshold, target.embed)


@functools.cache
def spec_fns(graphdef: nnx.GraphDef, sampling: SamplingConfig, confidence_threshold: float = 0.0):
    """Jitted (prefill, step) for one (target, drafter) structure, sampling setting and
    confidence threshold; see `generate.target_fns` for why they are built once per graphdef."""

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

    @functools.partial(jax.jit, donate_argnums=(1,), static_argnames=("num_slots",))
    def step_fn(state, st: SpecState, max_new_tokens, stop_ids, *, num_slots):
        target, drafter, draft_vocabulary = nnx.merge(graphdef, state)
        vocab = FullVocabulary(target) if draft_vocabulary is None else draft_vocabulary
        key, draft_key, verify_key = jax.random.split(st.key, 3)
        start = st.target_cache.lengths
        # The target verifies the anchor and the drafts (one more token than the drafter's block
        # for a kind whose every slot drafts).
        positions = start[:, None] + jnp.arange(drafter.cfg.verify_size)[None, :]
        drafts, draft_logits, proposed = draft_block(
            target,
            drafter,
            vocab,
            st.anchor,
            positions[:, : drafter.cfg.block_size],
            st.context,
            sampling,
            draft_key,
            confidence_threshold,
            num_slots,
        )

        block = jnp.concatenate([st.anchor[:, None], drafts], axis=1)
        logits, features, cache = target.decode(
            block, st.target_cache, feature_layers=drafter.cfg.target_layer_ids, num_slots=num_slots
        )
        accepted, tokens = verify_block(drafts, draft_logits, logits, sampling, verify_key, proposed)

        out, emitted = outputs_lib.append(
            st.outputs, tokens, accepted + 1, stop_ids=stop_ids, max_new_tokens=max_new_tokens
        )
        # Rows still running keep anchor + accepted drafts; finished rows freeze their caches, so
        # their (ignored) writes stay inside the cache length the decoder sized.
        kept = jnp.where(out.done, 0, accepted + 1)
        cache = cache.replace(lengths=start + kept)
        context = drafter.extend_context(st.context, features, positions, kept)
        anchor = jnp.where(out.done, st.anchor, tokens[jnp.arange(tokens.shape[0]), accepted])
        return SpecState(cache, context, anchor, out, key), emitted

    return prefill_fn, step_fn


class SpeculativeDecoder(Decoder):
    """DFlash decoding: one drafter forward and one target forward per step.

    Greedy mode reproduces target-only greedy decoding token for token; sampling mode keeps the
    target's output distribution. `Generation.step_lengths` are the acceptance lengths (a+1,
    cut where a stop token or max_new_tokens ends the output). `confidence_threshold` (drafters
    with a confidence head only): propose the drafts up to the first slot whose confidence is below it.
    `draft_tokens`: token ids [V'] the drafter drafts among (`draft_vocab.py`; None: all).
    """

    def __init__(
        self,
        target: Transformer,
        drafter: DFlashDrafter,
        *,
        confidence_threshold: float = 0.0,
        draft_tokens: np.ndarray | None = None,
        **kwargs,
    ):
        check_fits(drafter.cfg, target.cfg)  # a guard: the commands check the config files before loading
        if confidence_threshold and (problem := kinds.confidence_problem(drafter.cfg.kind)):
            raise ModelError(f"a confidence threshold {problem}")
        if draft_tokens is not None and not 0 < len(draft_tokens) <= target.cfg.vocab_size:
            raise ValueError(
                f"a draft vocabulary of {len(draft_tokens)} tokens (the target has {target.cfg.vocab_size})"
            )
        self.block_size = drafter.cfg.verify_size
        vocab = None if draft_tokens is None else DraftVocabulary(target, draft_tokens)
        super().__init__(
            (target, drafter, vocab), functools.partial(spec_fns, confidence_threshold=confidence_threshold), **kwargs
        )
