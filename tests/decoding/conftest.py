"""Decoding test fixtures; the model builders live in decoding_models.py beside this file."""

from __future__ import annotations

import pathlib
import sys

import pytest

# pytest runs with --import-mode=importlib, which does not put test directories on sys.path.
sys.path.insert(0, str(pathlib.Path(__file__).parent))

from decoding_models import CHAT_VOCAB, make_drafter, make_target  # noqa: E402


@pytest.fixture(scope="session")
def random_target():
    return make_target(seed=1)


@pytest.fixture(scope="session")
def untrained_drafter(random_target):
    return make_drafter(random_target, seed=2)


@pytest.fixture(scope="session")
def chat_target(tmp_path_factory):
    """A Hugging Face target directory with random weights, a tokenizer and a chat template."""
    from dflash_jax.data.testing import write_tiny_target
    from dflash_jax.models.reference import write_hf_checkpoint

    directory = write_tiny_target(tmp_path_factory.mktemp("chat_target"))
    write_hf_checkpoint(
        directory, vocab_size=CHAT_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
    )
    return str(directory)
