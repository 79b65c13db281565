"""DFlash2's selector walk and DSpark's Markov walk against float64 references of z-lab's and
DeepSpec's decoding loops (tests/support/kind_references.py), greedy and with DSpark's
confidence truncation, over the whole vocabulary and over a draft vocabulary (the references
then see -inf logits outside it)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from dflash_jax.decoding.draft_vocab import DraftVocabulary, FullVocabulary
from dflash_jax.decoding.kinds import WALKS
from dflash_jax.decoding.sampling import GREEDY, SamplingConfig, warp_probs
from support import kind_references as ref
from support.decoding_models import make_drafter, make_target, perturbed


def _t(x):
    return torch.tensor(np.asarray(x, np.float64))


@pytest.fixture(scope="module")
def models():
    target = make_target(seed=1)
    return {
        "dflash2": (target, perturbed(make_drafter(target, seed=2, kind="dflash2", selector_top_k=8), scale=0.5)),
        "dspark": (target, perturbed(make_drafter(target, seed=2, kind="dspark", markov_rank=8), scale=0.5)),
    }


# 40 of the 64 tokens, in no particular order.
DRAFT_TOKENS = np.random.default_rng(9).permutation(64)[:40].astype(np.int32)


def _vocabulary(target, draft_tokens):
    """(the vocabulary the walk drafts among, the target's logits as the reference sees them)."""
    if draft_tokens is None:
        return FullVocabulary(target), target.unembed
    outside = np.ones(target.cfg.vocab_size, bool)
    outside[draft_tokens] = False
    return DraftVocabulary(target, draft_tokens), lambda h: jnp.where(outside, -jnp.inf, target.unembed(h))


def _inputs(seed):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.normal(size=(3, 4, 32)), jnp.float32), jnp.asarray(rng.integers(0, 63, 3), jnp.int32)


@pytest.mark.parametrize("draft_tokens", [None, DRAFT_TOKENS])
def test_selector_walk_drafts_as_z_labs(models, draft_tokens):
    target, drafter = models["dflash2"]
    vocab, reference_logits = _vocabulary(target, draft_tokens)
    hidden, anchor = _inputs(0)
    with jax.default_matmul_precision("highest"):
        drafts, logits, _ = WALKS["dflash2"](vocab, drafter, hidden, anchor, GREEDY, jax.random.key(0), 0.0)
        unary = reference_logits(hidden[:, 1:])
    selector = drafter.candidate_selector
    codebooks = (_t(selector.predecessor_codebook[...]), _t(selector.successor_codebook[...]))
    for row in range(3):
        expected = ref.selector_walk(
            _t(unary[row]),
            _t(hidden[row, 1:]),
            anchor[row],
            codebooks,
            _t(selector.hidden_projection.kernel[...]),
            top_k=8,
        )
        assert np.asarray(drafts[row]).tolist() == expected
    # Each slot's logits are finite on its 8 candidates only, and the draft scores best there.
    assert np.all(np.isfinite(logits).sum(-1) == 8)
    np.testing.assert_array_equal(np.argmax(logits, -1), drafts)
    # Sampled: every draft is one of its slot's candidates, drawn from softmax(S / T) over them.
    sampled, sampled_logits, _ = WALKS["dflash2"](
        vocab, drafter, hidden, anchor, SamplingConfig(1.0), jax.random.key(1), 0.0
    )
    q = np.asarray(warp_probs(sampled_logits, SamplingConfig(1.0)))
    assert np.all(np.take_along_axis(q, np.asarray(sampled)[..., None], -1) > 0)
    assert np.all((q > 0).sum(-1) == 8)
    if draft_tokens is not None:
        assert set(np.asarray(drafts).ravel()) | set(np.asarray(sampled).ravel()) <= set(draft_tokens)


@pytest.mark.parametrize("threshold, draft_tokens", [(0.0, None), (0.5, None), (0.0, DRAFT_TOKENS)])
def test_markov_walk_drafts_as_deepspec(models, threshold, draft_tokens):
    target, drafter = models["dspark"]
    vocab, reference_logits = _vocabulary(target, draft_tokens)
    hidden, anchor = _inputs(1)
    with jax.default_matmul_precision("highest"):
        drafts, logits, proposed = WALKS["dspark"](vocab, drafter, hidden, anchor, GREEDY, jax.random.key(0), threshold)
        unary = reference_logits(hidden)
    markov, confidence = drafter.markov_head, drafter.confidence_head
    weights = (_t(markov.markov_w1.embedding[...]), _t(markov.markov_w2.kernel[...]))
    head = (_t(confidence.proj.kernel[...][:, 0]), _t(confidence.proj.bias[...][0]))
    counts = []
    for row in range(3):
        expected, count = ref.markov_walk(
            _t(unary[row]), _t(hidden[row]), anchor[row], weights, head, threshold=threshold
        )
        assert np.asarray(drafts[row]).tolist() == expected
        counts.append(count)
    assert np.asarray(proposed).tolist() == counts
    np.testing.assert_array_equal(np.argmax(logits, -1), drafts)  # the corrected logits chose them
    if draft_tokens is not None:
        assert np.all(np.isfinite(logits).sum(-1) == len(draft_tokens))
    if threshold:
        assert min(counts) < 4  # the truncation is exercised
