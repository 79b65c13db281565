"""Greedy speculative decoding is lossless, its bookkeeping is consistent, its steps compile once."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dflash_jax.decoding import generate as generate_lib
from dflash_jax.decoding import speculative
from dflash_jax.decoding.draft_vocab import FullVocabulary
from dflash_jax.decoding.generate import TargetDecoder
from dflash_jax.decoding.speculative import SpeculativeDecoder
from dflash_jax.models.kinds import domino
from dflash_jax.models.layers.block_attention import block_context_mask
from support.decoding_models import (
    BLOCK,
    MASK_ID,
    VOCAB,
    OracleDrafter,
    make_drafter,
    make_successor_target,
    make_target,
    perturbed,
    random_prompts,
    successor_drafter,
)

# Lengths straddle the 16-token prompt bucket; 5 prompts with batch 2 leave a short last batch.
PROMPT_LENGTHS = (3, 16, 17, 9, 30)
MAX_PROMPT = 32
MAX_NEW = 24


def naive_greedy(target, prompt, max_new):
    """Greedy decoding by a full forward over the growing sequence each token, without a cache."""
    graphdef, state = nnx.split(target)
    width = len(prompt) + max_new

    @jax.jit
    def next_token(state, seq, length):
        segment_ids = (jnp.arange(width) < length).astype(jnp.int32)[None]
        logits, _ = nnx.merge(graphdef, state)(seq[None], segment_ids, jnp.arange(width)[None])
        return jnp.argmax(logits[0, length - 1])

    seq = np.zeros(width, np.int32)
    seq[: len(prompt)] = prompt
    for length in range(len(prompt), width):
        seq[length] = next_token(state, seq, length)
    return seq[len(prompt) :]


@pytest.fixture(scope="module")
def cases(random_target, untrained_drafter):
    """name -> (target, drafter): almost nothing accepted, everything accepted, in between; for
    DFlash and, through their own walks, the DFlash2 and DSpark kinds (`successor_drafter`)."""
    copy_target, successor = make_successor_target(seed=3, noise=0.0)
    noisy_target, noisy_successor = make_successor_target(seed=4, noise=2.0)
    cases = {
        "untrained": (random_target, untrained_drafter),
        "copies_target": (copy_target, OracleDrafter(copy_target, successor)),
        "partial": (noisy_target, OracleDrafter(noisy_target, noisy_successor)),
    }
    for kind in ("dflash2", "dspark", "xpress"):
        cases[f"{kind}_untrained"] = (random_target, perturbed(make_drafter(random_target, seed=2, kind=kind)))
        cases[f"{kind}_copies_target"] = (copy_target, successor_drafter(copy_target, successor, kind))
        cases[f"{kind}_partial"] = (noisy_target, successor_drafter(noisy_target, noisy_successor, kind))
    cases["domino_untrained"] = (random_target, perturbed(make_drafter(random_target, seed=2, kind="domino")))
    return cases


def decode_both(target, drafter, prompts, **kw):
    kw = dict(max_prompt_len=MAX_PROMPT, **kw)
    return TargetDecoder(target, **kw).generate(prompts), SpeculativeDecoder(target, drafter, **kw).generate(prompts)


def test_target_decoder_matches_uncached_greedy(random_target):
    prompts = random_prompts(0, (5, 17))
    got = TargetDecoder(random_target, max_prompt_len=MAX_PROMPT, max_new_tokens=10, batch_size=2).generate(prompts)
    for prompt, g in zip(prompts, got):
        np.testing.assert_array_equal(g.tokens, naive_greedy(random_target, prompt, 10))


@pytest.mark.parametrize(
    "name, tau_range, batch_size",
    [
        *(
            # Batch size 2 (rows of different lengths) in the slow tier for plain DFlash.
            (name, tau_range, 1) if batch_size == 1 else pytest.param(name, tau_range, 2, marks=pytest.mark.slow)
            for batch_size in (1, 2)
            for name, tau_range in (
                ("untrained", (1.0, 1.3)),
                ("copies_target", (BLOCK - 0.5, BLOCK)),
                ("partial", (1.5, BLOCK - 0.5)),
            )
        ),
        # DSpark verifies BLOCK + 1 tokens a step: every slot of its block drafts. The fast tier
        # keeps each kind's partly right drafter.
        pytest.param("dflash2_untrained", (1.0, 1.3), 2, marks=pytest.mark.slow),
        pytest.param("dflash2_copies_target", (BLOCK - 0.5, BLOCK), 2, marks=pytest.mark.slow),
        ("dflash2_partial", (1.5, BLOCK - 0.5), 2),
        pytest.param("dspark_untrained", (1.0, 1.3), 2, marks=pytest.mark.slow),
        pytest.param("dspark_copies_target", (BLOCK + 0.3, BLOCK + 1), 1, marks=pytest.mark.slow),
        ("dspark_partial", (1.5, BLOCK + 0.5), 2),
        pytest.param("xpress_untrained", (1.0, 1.3), 2, marks=pytest.mark.slow),
        pytest.param("xpress_copies_target", (BLOCK - 0.5, BLOCK), 1, marks=pytest.mark.slow),
        ("xpress_partial", (1.5, BLOCK - 0.5), 2),
    ],
)
def test_greedy_is_lossless(cases, name, tau_range, batch_size):
    target, drafter = cases[name]
    prompts = random_prompts(10, PROMPT_LENGTHS)
    ref, spec = decode_both(target, drafter, prompts, max_new_tokens=MAX_NEW, batch_size=batch_size)
    for r, s in zip(ref, spec):
        np.testing.assert_array_equal(s.tokens, r.tokens)
        assert len(s.tokens) == MAX_NEW
    taus = [s.step_lengths.mean() for s in spec]
    assert tau_range[0] <= np.mean(taus) <= tau_range[1], taus


@pytest.mark.parametrize(
    "name",
    [
        "untrained",
        "partial",
        "dflash2_partial",
        "dspark_copies_target",
        pytest.param("xpress_partial", marks=pytest.mark.slow),
        pytest.param("copies_target", marks=pytest.mark.slow),
    ],
)
def test_greedy_is_lossless_across_stop_tokens(cases, name):
    target, drafter = cases[name]
    prompts = random_prompts(20, PROMPT_LENGTHS)
    free, _ = decode_both(target, drafter, prompts, max_new_tokens=MAX_NEW, batch_size=2)
    # Stop at tokens that occur mid-output, so stops land inside accepted blocks too.
    stop_tokens = {int(g.tokens[k]) for g, k in zip(free, (4, 7, 10, 13, 18))}
    ref, spec = decode_both(target, drafter, prompts, max_new_tokens=MAX_NEW, batch_size=2, stop_tokens=stop_tokens)
    stopped = 0
    for r, s in zip(ref, spec):
        np.testing.assert_array_equal(s.tokens, r.tokens)
        stopped += int(s.tokens[-1] in stop_tokens and len(s.tokens) < MAX_NEW)
        assert not set(s.tokens[:-1].tolist()) & stop_tokens
    assert stopped == len(prompts)


@pytest.mark.parametrize("max_new", [1, 2, 5, 7])
def test_greedy_is_lossless_at_every_max_new_tokens(cases, max_new):
    target, drafter = cases["copies_target"]
    prompts = random_prompts(30, (4, 11))
    ref, spec = decode_both(target, drafter, prompts, max_new_tokens=max_new, batch_size=2)
    for r, s in zip(ref, spec):
        np.testing.assert_array_equal(s.tokens, r.tokens)
        assert len(s.tokens) == max_new
        assert 1 + s.step_lengths.sum() == max_new


@pytest.mark.parametrize(
    "name",
    [
        "copies_target",
        "dflash2_copies_target",
        *(pytest.param(f"{kind}_copies_target", marks=pytest.mark.slow) for kind in ("dspark", "xpress")),
    ],
)
def test_greedy_with_a_draft_vocabulary_is_lossless(cases, name):
    """Every token in the draft vocabulary (in another order): the same drafts, all accepted. A
    fifth of the tokens left out: the target emits them, the drafts miss them, the output stays."""
    target, drafter = cases[name]
    prompts = random_prompts(50, (5, 12))
    ref, spec = decode_both(target, drafter, prompts, max_new_tokens=MAX_NEW, batch_size=2)
    every = np.random.default_rng(0).permutation(VOCAB).astype(np.int32)
    emitted = np.concatenate([r.tokens for r in ref])
    most = every[~np.isin(every, emitted[:: len(emitted) // 12])]
    assert len(most) < VOCAB
    for tokens in (every, most):
        kw = dict(max_prompt_len=MAX_PROMPT, max_new_tokens=MAX_NEW, batch_size=2, draft_tokens=tokens)
        drafted = SpeculativeDecoder(target, drafter, **kw).generate(prompts)
        for r, s, d in zip(ref, spec, drafted):
            np.testing.assert_array_equal(d.tokens, r.tokens)
            if tokens is every:
                np.testing.assert_array_equal(d.step_lengths, s.step_lengths)
    assert np.mean([d.step_lengths.mean() for d in drafted]) < np.mean([s.step_lengths.mean() for s in spec])


def test_first_token_stop_ends_without_a_step(cases):
    target, drafter = cases["partial"]
    prompts = random_prompts(40, (6,))
    first = SpeculativeDecoder(target, drafter, max_prompt_len=8, max_new_tokens=1).generate(prompts)[0]
    out = SpeculativeDecoder(
        target, drafter, max_prompt_len=8, max_new_tokens=MAX_NEW, stop_tokens=[int(first.tokens[0])]
    ).generate(prompts)[0]
    np.testing.assert_array_equal(out.tokens, first.tokens)
    assert len(out.step_lengths) == 0


@pytest.mark.parametrize(
    "name",
    [
        "untrained",
        "dflash2_partial",
        *(pytest.param(n, marks=pytest.mark.slow) for n in ("partial", "dspark_partial", "xpress_partial")),
    ],
)
def test_step_bookkeeping(cases, name):
    """Per step: a+1 tokens emitted (1..B, B the tokens verified), both caches hold exactly
    prompt + output minus anchor."""
    target, drafter = cases[name]
    prompts = random_prompts(50, (5, 13, 20))
    lengths = np.array([len(p) for p in prompts])
    decoder = SpeculativeDecoder(target, drafter, max_prompt_len=MAX_PROMPT, max_new_tokens=MAX_NEW, batch_size=3)
    st = decoder._prefill(*generate_lib.pad_batch(prompts, 3, MAX_PROMPT), jax.random.key(0))
    total = np.ones(3, int)
    while not np.all(np.asarray(st.outputs.done)):
        running = ~np.asarray(st.outputs.done)
        st, emitted = decoder._step(st)
        emitted = np.asarray(emitted)
        assert np.all((emitted[running] >= 1) & (emitted[running] <= drafter.cfg.verify_size))
        assert np.all(emitted[~running] == 0)
        total += emitted
        np.testing.assert_array_equal(np.asarray(st.outputs.lengths), total)
        still = ~np.asarray(st.outputs.done)
        cache_len = np.asarray(st.target_cache.lengths)
        np.testing.assert_array_equal(cache_len[still], (lengths + total - 1)[still])
        np.testing.assert_array_equal(np.asarray(st.context.lengths)[still], cache_len[still])
        np.testing.assert_array_equal(
            np.asarray(st.anchor)[still], np.asarray(st.outputs.tokens)[still, total[still] - 1]
        )
    assert np.all(total == MAX_NEW)


def test_steps_compile_once_per_decoder_shape():
    """New prompts, lengths and stop positions never recompile the step; prefill compiles per bucket."""
    target = make_target(seed=7)
    drafter = make_drafter(target, seed=8)
    decoder = SpeculativeDecoder(target, drafter, max_prompt_len=40, max_new_tokens=9, batch_size=2)
    decoder.generate(random_prompts(60, (3, 5)))
    # Counts are deltas: other tests' decoders of the same model structure share these functions.
    steps, prefills = decoder.step_fn._cache_size(), decoder.prefill_fn._cache_size()
    decoder.generate(random_prompts(61, (2, 14, 7, 12, 1)))
    decoder.generate(random_prompts(62, (9,)), seed=3)
    # Another decoder of the same shapes (as measure_acceptance builds per call) shares them.
    SpeculativeDecoder(target, drafter, max_prompt_len=40, max_new_tokens=9, batch_size=2, stop_tokens=[5]).generate(
        random_prompts(64, (4,))
    )
    assert (decoder.step_fn._cache_size(), decoder.prefill_fn._cache_size()) == (steps, prefills)
    decoder.generate(random_prompts(63, (33, 20)))  # a new prompt bucket: one more prefill only
    assert (decoder.step_fn._cache_size(), decoder.prefill_fn._cache_size()) == (steps, prefills + 1)


def test_bucketed_attention_decodes_the_same_tokens(random_target, untrained_drafter):
    """Attention over a bucketed prefix of the caches (16-slot buckets of a 64-slot cache: the
    generation crosses two boundaries) decodes the same tokens in the same steps as over every slot,
    target alone and DFlash; `warmup` compiles every bucket that `generate` then runs."""
    prompts = random_prompts(80, (14,))
    kw = dict(max_prompt_len=MAX_PROMPT, max_new_tokens=MAX_NEW)
    assert {generate_lib.attended_slots(n, 64, 16) for n in range(14 + 1, 14 + MAX_NEW + BLOCK)} == {16, 32, 48}
    outputs = []
    for make in (
        lambda **k: TargetDecoder(random_target, **kw, **k),
        lambda **k: SpeculativeDecoder(random_target, untrained_drafter, **kw, **k),
    ):
        every_slot = make(slot_bucket=0).generate(prompts)
        bucketed = make(slot_bucket=16)
        assert bucketed.cache_len == 64
        bucketed.warmup([len(p) for p in prompts])
        compiled = bucketed.step_fn._cache_size(), bucketed.prefill_fn._cache_size()
        outputs.append(bucketed.generate(prompts))
        assert (bucketed.step_fn._cache_size(), bucketed.prefill_fn._cache_size()) == compiled
        for full, got in zip(every_slot, outputs[-1]):
            np.testing.assert_array_equal(got.tokens, full.tokens)
            np.testing.assert_array_equal(got.step_lengths, full.step_lengths)
    for alone, spec in zip(*outputs):
        np.testing.assert_array_equal(spec.tokens, alone.tokens)


def test_rejects_mismatched_drafter_and_long_prompts(random_target):
    other = make_target(seed=0, vocab=32)
    with pytest.raises(ValueError, match="does not fit the target"):
        SpeculativeDecoder(random_target, make_drafter(other, mask_id=31), max_prompt_len=8, max_new_tokens=4)
    decoder = SpeculativeDecoder(random_target, make_drafter(random_target), max_prompt_len=8, max_new_tokens=4)
    with pytest.raises(ValueError, match="more than max_prompt_len"):
        decoder.generate(random_prompts(0, (9,)))


@pytest.mark.parametrize(
    "kind", ["dflash", "dflash2", *(pytest.param(k, marks=pytest.mark.slow) for k in ("dspark", "domino", "xpress"))]
)
def test_served_drafts_equal_the_training_forward(cases, kind):
    """At every step, the drafter's logits as served equal its training forward for that anchor.

    The training forward sees the target features of the final sequence at positions strictly
    before the anchor (docs/design.md §3.2); serving builds the same context incrementally from prefill and
    accepted tokens. A mismatch here is the train/serve skew that ruins acceptance. DFlash2 and
    DSpark score each slot after the previous draft: their training-side scores (the selector's
    over the unary top-k, the Markov-corrected logits), given the served drafts as the previous
    tokens, are what was served. Serving reads 16-slot buckets of the context cache (crossing
    from 16 to 32 slots here), as the decoder's steps do.
    """
    target, drafter = cases["untrained" if kind == "dflash" else f"{kind}_untrained"]
    prompt = random_prompts(70, (9,))
    decoder = SpeculativeDecoder(target, drafter, max_prompt_len=16, max_new_tokens=16, slot_bucket=16)
    graphs = nnx.split((target, drafter))

    @functools.partial(jax.jit, static_argnames="num_slots")
    def served_drafts(state, st, num_slots):
        t, d = nnx.merge(graphs[0], state)
        positions = st.target_cache.lengths[:, None] + jnp.arange(BLOCK)[None, :]
        key = jax.random.key(0)
        return speculative.draft_block(
            t, d, FullVocabulary(t), st.anchor, positions, st.context, decoder.sampling, key, num_slots=num_slots
        )[:2]

    st = decoder._prefill(*generate_lib.pad_batch(prompt, 1, 16), jax.random.key(0))
    anchors, drafts, served = [], [], []
    while not np.all(np.asarray(st.outputs.done)):
        anchors.append(int(st.target_cache.lengths[0]))
        tokens, logits = served_drafts(graphs[1], st, decoder._attended_slots(anchors[-1] + BLOCK))
        drafts.append(np.asarray(tokens[0]))
        served.append(np.asarray(logits[0]))
        st, _ = decoder._step(st)
    out = np.asarray(st.outputs.tokens[0, : int(st.outputs.lengths[0])])

    @jax.jit
    def training_logits(state, seq, anchor_index, drafts):
        t, d = nnx.merge(graphs[0], state)
        segment_ids, positions = jnp.ones_like(seq), jnp.arange(seq.shape[1])[None]
        features = t.features(seq, segment_ids, positions, d.cfg.target_layer_ids)
        blocks = jnp.full((1, anchor_index.shape[1], BLOCK), MASK_ID).at[..., 0].set(seq[0, anchor_index[0]])
        states = d(
            t.embed(blocks),
            anchor_index[..., None] + jnp.arange(BLOCK),
            d.context(features),
            positions,
            block_context_mask(segment_ids, anchor_index),
        )[0]
        hidden = states[:, d.cfg.first_draft_slot : d.cfg.first_draft_slot + d.cfg.num_drafts]  # the proposed slots
        unary = t.unembed(hidden)
        previous = jnp.concatenate([blocks[0, :, :1], drafts[:, :-1]], axis=1)
        if d.cfg.kind == "xpress":  # its passes (more than the B - 1 drafts) reach the sequential walk
            head = d.xpress_head
            latent = head.latent(head.hidden_part(states), jnp.concatenate([blocks[0, :, :1], previous], axis=1))
            return unary + head.bias(latent[:, 1:])
        if d.cfg.kind == "dspark":
            return unary + d.markov_head.bias(d.markov_head.embed(previous))
        if d.cfg.kind == "domino":  # the GRU over the anchor and the drafts before each slot, as training reads labels
            states = d.prefix_gru(t.embed(previous))
            slots = jnp.arange(unary.shape[-2])
            return domino.corrected(
                d.cfg.pure_draft_prefix_len,
                slots,
                unary,
                domino.correction(domino.kernels(d.embed_proj), hidden, states),
            )
        if d.cfg.kind == "dflash2":
            selector = d.candidate_selector
            values, candidates = jax.lax.top_k(unary, d.cfg.selector_top_k)
            scores = values + selector.pair_scores(selector.context(hidden, previous), candidates)
            block, slot, _ = jnp.indices(candidates.shape)
            return jnp.full(unary.shape, -jnp.inf).at[block, slot, candidates].set(scores)
        return unary

    seq = jnp.asarray(np.concatenate([prompt[0], out]))[None]
    trained = np.asarray(training_logits(graphs[1], seq, jnp.asarray(anchors)[None], jnp.asarray(np.stack(drafts))))
    assert len(anchors) > 3 and anchors[0] + BLOCK <= 16 < anchors[-1]
    np.testing.assert_allclose(np.stack(served), trained, atol=2e-4, rtol=2e-4)


def test_a_cache_too_small_for_the_next_step_fails_loudly(random_target, untrained_drafter):
    """A write past the end of a KV cache would be dropped silently; the decoder refuses first."""
    decoder = SpeculativeDecoder(random_target, untrained_drafter, max_prompt_len=16, max_new_tokens=40)
    assert decoder.generate(random_prompts(0, (16,)))[0].tokens.size == 40  # sized to fit: fine
    decoder.cache_len = 16 + 2 * BLOCK  # as if mis-sized: room for two blocks after the prompt
    with pytest.raises(generate_lib.CacheOverflowError, match=f"writes {BLOCK} tokens but a row's KV cache"):
        decoder.generate(random_prompts(0, (16,)))
