"""What a user asked for and did not get is said in one line: a draft vocabulary larger than the
tokens training saw (capped), a data set name that is not one (the nearest name suggested, as for a
mistyped config field)."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from dflash_jax.data.presets import PRESETS
from dflash_jax.data.sources import resolve_sources
from dflash_jax.decoding.draft_vocab import FREQUENCIES_FILE, draft_token_ids, write_frequencies
from dflash_jax.errors import ConfigError, DataError
from dflash_jax.training.config.presets import load_config_file
from dflash_jax.training.config.run_config import resolve
from support.training_runs import REPO


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_a_draft_vocabulary_larger_than_the_trained_tokens_is_capped_in_one_line(tmp_path, caplog):
    write_frequencies(str(tmp_path / FREQUENCIES_FILE), np.array([0, 5, 2, 9, 0, 5, 1]), source="test")
    with caplog.at_level(logging.WARNING):
        np.testing.assert_array_equal(draft_token_ids(str(tmp_path), 3), [3, 1, 5])
        assert warnings(caplog) == []  # what was asked for
        np.testing.assert_array_equal(draft_token_ids(str(tmp_path), 49152), [3, 1, 5, 2, 6])
        np.testing.assert_array_equal(draft_token_ids(str(tmp_path), 49152), [3, 1, 5, 2, 6])
    assert warnings(caplog) == [  # once, however often it is read
        "draft vocabulary capped at 5 tokens (asked for 49152): the drafter's training saw only 5 distinct "
        f"tokens ({tmp_path / FREQUENCIES_FILE})"
    ]


@pytest.mark.parametrize(
    "name, suggestion",
    [("ultrachatt", "ultrachat"), ("ShareGPT", "sharegpt"), ("nemotron-chat", "nemotron-v2-chat"), ("nothing", None)],
)
def test_a_data_set_name_that_is_not_one_suggests_the_nearest(tmp_path, monkeypatch, name, suggestion):
    monkeypatch.chdir(tmp_path)  # no local file of that name
    with pytest.raises(DataError) as raised:
        resolve_sources(name)
    names = ", ".join(PRESETS)
    expected = f"data source {name!r} does not exist, nor is it a data set name ({names})"
    assert str(raised.value) == expected + (f"; did you mean {suggestion}?" if suggestion else "")


def test_a_mistyped_data_set_in_the_config_is_a_config_error_with_the_suggestion(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = load_config_file(str(REPO / "configs" / "default.py"))
    config.workdir, config.data.train = str(tmp_path / "run"), "sharegtp"
    with pytest.raises(ConfigError, match=r"data source 'sharegtp' does not exist.*; did you mean sharegpt\?$"):
        resolve(config, num_devices=1)
    assert list(tmp_path.iterdir()) == []
