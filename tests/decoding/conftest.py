"""Decoding test fixtures; the model builders live in tests/support/decoding_models.py."""

from __future__ import annotations

import pytest

from support.decoding_models import CHAT_VOCAB, make_drafter, make_target


@pytest.fixture(scope="session")
def random_target():
    return make_target(seed=1)


@pytest.fixture(scope="session")
def untrained_drafter(random_target):
    return make_drafter(random_target, seed=2)


@pytest.fixture(scope="session")
def chat_target(tmp_path_factory):
    """A Hugging Face target directory with random weights, a tokenizer and a chat template."""
    from support.chat_data import write_tiny_target
    from support.hf_reference import write_hf_checkpoint

    directory = write_tiny_target(tmp_path_factory.mktemp("chat_target"))
    write_hf_checkpoint(
        directory,
        vocab_size=CHAT_VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=512,
    )
    return str(directory)
