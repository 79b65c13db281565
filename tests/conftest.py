"""Shared fixtures: tiny random Hugging Face checkpoints written by `transformers` itself."""

from __future__ import annotations

import os
import pathlib
import sys

import pytest

# pytest runs with --import-mode=importlib, which does not put tests/ on sys.path; the helpers in
# tests/support/ are imported as `support.<module>`, here and in the tests' subprocesses.
TESTS = str(pathlib.Path(__file__).parent)
sys.path.insert(0, TESTS)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [TESTS, os.environ.get("PYTHONPATH")]))

from support.hf_reference import write_hf_checkpoint  # noqa: E402


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
