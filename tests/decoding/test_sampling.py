"""Sampling filters, block verification, and the output distribution of sampled speculative decoding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats

from dflash_jax.decoding.acceptance import acceptance_stats
from dflash_jax.decoding.sampling import GREEDY, SamplingConfig, argmax, verify_block, warp_probs
from dflash_jax.decoding.speculative import SpeculativeDecoder
from support.decoding_models import make_drafter, make_target, perturbed

SMALL_VOCAB = 16


def test_warp_probs_applies_temperature_top_k_and_top_p():
    logits = jnp.log(jnp.array([0.5, 0.2, 0.15, 0.1, 0.05]))
    np.testing.assert_allclose(warp_probs(logits, SamplingConfig(1.0)), [0.5, 0.2, 0.15, 0.1, 0.05], rtol=1e-6)
    np.testing.assert_allclose(warp_probs(logits, SamplingConfig(1.0, top_k=2)), [5 / 7, 2 / 7, 0, 0, 0], rtol=1e-6)
    # top_p keeps the smallest prefix reaching the mass: 0.5 + 0.2 >= 0.7.
    np.testing.assert_allclose(warp_probs(logits, SamplingConfig(1.0, top_p=0.7)), [5 / 7, 2 / 7, 0, 0, 0], rtol=1e-6)
    np.testing.assert_allclose(warp_probs(logits, SamplingConfig(1.0, top_p=0.71)).sum(), 1.0, rtol=1e-6)
    assert (warp_probs(logits, SamplingConfig(1.0, top_p=0.71)) > 0).sum() == 3
    assert (warp_probs(logits, SamplingConfig(1.0, top_p=0.01)) > 0).sum() == 1
    cold = warp_probs(logits, SamplingConfig(0.5))
    np.testing.assert_allclose(cold, np.array([0.5, 0.2, 0.15, 0.1, 0.05]) ** 2 / 0.325, rtol=1e-5)


def test_argmax_is_jnp_argmax_ties_included():
    # Small integer logits tie often; -inf rows and a row of one value included.
    logits = jax.random.randint(jax.random.key(0), (3, 5, 2000), -4, 4).astype(jnp.float32)
    logits = logits.at[0, 0].set(-jnp.inf).at[0, 1].set(7.0).at[1, 2, 1999].set(9.0)
    assert argmax(logits).dtype == jnp.int32
    np.testing.assert_array_equal(argmax(logits), jnp.argmax(logits, axis=-1))


def test_sampling_config_rejects_bad_values():
    for bad in (dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-2)):
        with pytest.raises(ValueError):
            SamplingConfig(**bad)


def one_hot_logits(tokens, vocab=8):
    return jnp.where(jax.nn.one_hot(jnp.asarray(tokens), vocab) > 0, 10.0, -10.0)


def test_greedy_verification_accepts_the_matching_prefix():
    target_choice = [[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4], [5, 6, 7, 0]]
    drafts = jnp.array([[1, 2, 3], [1, 9, 3], [0, 2, 3], [5, 6, 7]])
    accepted, tokens = verify_block(drafts, one_hot_logits(drafts), one_hot_logits(target_choice), GREEDY, None)
    np.testing.assert_array_equal(accepted, [3, 1, 0, 3])
    # Output of the step: tokens[:accepted + 1] = accepted drafts, then the target's bonus.
    np.testing.assert_array_equal(tokens, target_choice)


def test_sampled_verification_extremes():
    cfg = SamplingConfig(1.0)
    key = jax.random.key(0)
    drafts = jnp.array([[1, 2, 3]] * 64)
    same = one_hot_logits([[1, 2, 3, 4]] * 64)
    accepted, tokens = verify_block(drafts, same[:, :3], same, cfg, key)
    assert np.all(accepted == 3) and np.all(tokens == np.array([1, 2, 3, 4]))
    # The target never picks the drafts: nothing is accepted and the bonus comes from p - q.
    other = one_hot_logits([[5, 6, 7, 0]] * 64)
    accepted, tokens = verify_block(drafts, same[:, :3], other, cfg, key)
    assert np.all(accepted == 0) and np.all(tokens[:, 0] == 5)


def exact_distribution(target, prompt, cfg, length=3):
    """p(y1..y_length) of the target under `cfg` by enumerating every prefix, [V]*length."""
    v = SMALL_VOCAB
    prefixes = np.stack(np.meshgrid(*[np.arange(v)] * (length - 1), indexing="ij"), -1).reshape(-1, length - 1)
    seqs = np.concatenate([np.tile(prompt, (len(prefixes), 1)), prefixes], axis=1)
    graphdef, state = nnx.split(target)

    @jax.jit
    def step_probs(state, seqs):
        logits, _ = nnx.merge(graphdef, state)(seqs, jnp.ones_like(seqs), jnp.arange(seqs.shape[1])[None])
        return warp_probs(logits[:, len(prompt) - 1 :], cfg)

    probs = np.asarray(step_probs(state, jnp.asarray(seqs)), np.float64)  # [prefixes, length, V]
    joint = np.ones([v] * length)
    for i in range(length):
        # prefixes are ordered by (y1, .., y_{length-1}); position i depends on y1..y_i only.
        cond = probs[:, i].reshape([v] * (length - 1) + [v])
        cond = cond[(slice(None),) * i + (0,) * (length - 1 - i)]
        joint *= cond.reshape([v] * (i + 1) + [1] * (length - 1 - i))
    return joint


def chi_square_pvalue(counts, probs, min_expected=5.0):
    """Pearson chi-square of counts against probs, pooling cells expected below min_expected."""
    counts, expected = counts.ravel(), probs.ravel() * counts.sum()
    big = expected >= min_expected
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    return stats.chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue


def marginal_pvalues(counts, probs):
    """Chi-square p-values of the full joint and of every single and adjacent pair of positions:
    the joint pools most cells at this sample size, the marginals keep power on each position."""
    n = counts.ndim
    axes_sets = [()] + [tuple(a for a in range(n) if a != i) for i in range(n)]
    axes_sets += [tuple(a for a in range(n) if a not in (i, i + 1)) for i in range(n - 1)]
    return [chi_square_pvalue(counts.sum(axis=axes), probs.sum(axis=axes)) for axes in axes_sets]


@pytest.fixture(scope="module")
def small_models():
    """kind -> (target, drafter): 2 drafts a block. DFlash2 proposes among 12 of the 16 tokens
    (q is zero elsewhere); DSpark's block of 2 slots drafts 2, the second after the first by a
    Markov bias of order 1, and its confidence spreads (a threshold of 0.2 truncates some blocks
    and leaves every acceptance length common)."""
    target = make_target(seed=5, vocab=SMALL_VOCAB)
    kw = dict(seed=6, mask_id=SMALL_VOCAB - 1)
    dspark = make_drafter(target, block_size=2, kind="dspark", markov_rank=8, **kw)
    w1, w2 = jax.random.split(jax.random.key(0))
    dspark.markov_head.markov_w1.embedding[...] = jax.random.normal(w1, (SMALL_VOCAB, 8))
    dspark.markov_head.markov_w2.kernel[...] = 0.3 * jax.random.normal(w2, (8, SMALL_VOCAB))
    dspark.confidence_head.proj.kernel[...] = 10 * dspark.confidence_head.proj.kernel[...]
    # XPress: one Jacobi pass for 2 drafts, so the second is drawn after the seed's first, not
    # after the final one; a refiner bias of order 1 on an untrained backbone.
    xpress = make_drafter(target, block_size=3, kind="xpress", xpress_rank=8, xpress_num_passes=1, **kw)
    head, keys = xpress.xpress_head, jax.random.split(jax.random.key(1), 4)
    head.w1.embedding[...] = jax.random.normal(keys[0], (SMALL_VOCAB, 8))
    head.in_proj.kernel[...] = 0.3 * jax.random.normal(keys[1], (24, 8))
    head.mix.L[...] = 0.5 * jax.random.normal(keys[2], (8, 3, 3))
    head.w2.kernel[...] = 0.3 * jax.random.normal(keys[3], (8, SMALL_VOCAB))
    return {
        "dflash": (target, make_drafter(target, block_size=3, **kw)),
        "dflash2": (target, perturbed(make_drafter(target, block_size=3, kind="dflash2", selector_top_k=12, **kw))),
        "dspark": (target, dspark),
        "xpress": (target, xpress),
    }


# A draft vocabulary of 13 of the 16 tokens: q is zero on the other 3.
DRAFT_TOKENS = np.array([9, 0, 4, 12, 1, 7, 15, 3, 10, 5, 2, 13, 8], np.int32)


@pytest.mark.parametrize(
    "kind, cfg, confidence_threshold, draft_tokens",
    [
        ("dflash", SamplingConfig(1.0), 0.0, None),
        # The fast tier keeps plain DFlash; the kinds' variants are the slow tier's.
        pytest.param("dflash", SamplingConfig(0.8, top_p=0.9, top_k=6), 0.0, None, marks=pytest.mark.slow),
        pytest.param("dflash2", SamplingConfig(1.0), 0.0, None, marks=pytest.mark.slow),
        pytest.param("dspark", SamplingConfig(1.0), 0.0, None, marks=pytest.mark.slow),
        # Truncated blocks: drafts after a low-confidence slot are not offered.
        pytest.param("dspark", SamplingConfig(1.0), 0.2, None, marks=pytest.mark.slow),
        pytest.param("dflash", SamplingConfig(1.0), 0.0, DRAFT_TOKENS, marks=pytest.mark.slow),
        pytest.param("dflash2", SamplingConfig(1.0), 0.0, DRAFT_TOKENS, marks=pytest.mark.slow),
        pytest.param("xpress", SamplingConfig(1.0), 0.0, None, marks=pytest.mark.slow),
    ],
)
def test_sampled_speculative_decoding_keeps_the_target_distribution(
    small_models, kind, cfg, confidence_threshold, draft_tokens
):
    target, drafter = small_models[kind]
    prompt = np.array([3, 1, 4, 1, 5], np.int32)
    # 4 tokens: the prefill's, then one block of 2 drafts + bonus covers every verification path.
    batch, rounds, length = 2048, 4, 4
    decoder = SpeculativeDecoder(
        target,
        drafter,
        max_prompt_len=8,
        max_new_tokens=length,
        batch_size=batch,
        sampling=cfg,
        confidence_threshold=confidence_threshold,
        draft_tokens=draft_tokens,
    )
    generations = []
    for seed in range(rounds):
        generations += decoder.generate([prompt] * batch, seed=seed)
    samples = np.stack([g.tokens for g in generations])
    counts = np.zeros([SMALL_VOCAB] * length)
    np.add.at(counts, tuple(samples.T), 1)

    # Every path was taken: rejection at each slot and full acceptance (the truncated DSpark case
    # accepts a whole block in 0.3 % of the samples; the seeds are fixed).
    histogram = np.array(acceptance_stats(generations, drafter.cfg.verify_size)["histogram"])
    assert np.all(histogram > 0.002 * len(samples)), histogram

    exact = exact_distribution(target, prompt, cfg, length)
    assert min(marginal_pvalues(counts, exact)) > 1e-4
    # The same test has the power to reject a slightly different distribution.
    hotter = SamplingConfig(cfg.temperature * 1.2, top_p=cfg.top_p, top_k=cfg.top_k)
    assert min(marginal_pvalues(counts, exact_distribution(target, prompt, hotter, length))) < 1e-6
