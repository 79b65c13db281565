"""Shared fixtures: tiny random Hugging Face checkpoints written by `transformers` itself."""

from __future__ import annotations

import pytest

from dflash_jax.models.reference import write_hf_checkpoint


@pytest.fixture(scope="session")
def make_hf_checkpoint():
    """Factory fixture: `make_hf_checkpoint(out_dir, arch=..., seed=..., **config_overrides)`."""
    return write_hf_checkpoint


@pytest.fixture(scope="session")
def qwen3_checkpoint(tmp_path_factory):
    return write_hf_checkpoint(tmp_path_factory.mktemp("qwen3"), arch="qwen3")


@pytest.fixture(scope="session")
def qwen3_tied_checkpoint(tmp_path_factory):
    return write_hf_checkpoint(tmp_path_factory.mktemp("qwen3_tied"), arch="qwen3", tie_word_embeddings=True)


@pytest.fixture(scope="session")
def llama_checkpoint(tmp_path_factory):
    return write_hf_checkpoint(tmp_path_factory.mktemp("llama"), arch="llama")
