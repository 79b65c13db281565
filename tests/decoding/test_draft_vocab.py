"""The draft vocabulary: its logits are the target's over its tokens, its files, its errors."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dflash_jax.decoding.draft_vocab import DraftVocabulary, draft_token_ids, write_frequencies
from dflash_jax.errors import UserError
from dflash_jax.models.transformer import Transformer
from support.decoding_models import make_target, target_config


@pytest.mark.parametrize("tied, softcap", [(False, 0.0), (True, 3.0)])
def test_draft_logits_are_the_targets_over_the_draft_tokens(tied, softcap):
    cfg = dataclasses.replace(target_config(), tie_word_embeddings=tied, final_logit_softcap=softcap)
    target = Transformer(cfg, rngs=nnx.Rngs(0)) if tied else make_target(seed=0, logit_scale=20.0)
    ids = np.array([7, 0, 63, 12, 5], np.int32)
    vocab = DraftVocabulary(target, ids)
    h = jax.random.normal(jax.random.key(1), (2, 3, cfg.hidden_size))
    with jax.default_matmul_precision("highest"):
        full, draft = target.unembed(h), vocab.logits(h)
    np.testing.assert_allclose(draft, full[..., ids], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(vocab.tokens(jnp.array([[0, 2], [4, 1]])), [[7, 63], [5, 0]])
    scattered = np.asarray(vocab.scatter(draft))
    np.testing.assert_array_equal(scattered[..., ids], draft)
    assert np.all(np.isneginf(np.delete(scattered, ids, axis=-1)))
    np.testing.assert_array_equal(vocab.columns(full), full[..., ids])


def test_frequencies_round_trip_most_frequent_first(tmp_path):
    counts = np.array([0, 5, 2, 9, 0, 5, 1])
    write_frequencies(str(tmp_path / "token_frequencies.json"), counts, source="test")
    record = json.loads((tmp_path / "token_frequencies.json").read_text())
    assert record == {"source": "test", "token_ids": [3, 1, 5, 2, 6], "counts": [9, 5, 5, 2, 1]}
    np.testing.assert_array_equal(draft_token_ids(str(tmp_path), 3), [3, 1, 5])
    # Never more than the tokens training saw.
    np.testing.assert_array_equal(draft_token_ids(str(tmp_path), 100), [3, 1, 5, 2, 6])


def test_a_drafter_without_frequencies_is_a_one_line_error(tmp_path):
    with pytest.raises(UserError, match="token_frequencies.json") as e:
        draft_token_ids(str(tmp_path), 8)
    assert "\n" not in str(e.value)
