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

# The tests' programs are tiny: XLA:CPU spends longer compiling than running them, and its cheap
# LLVM pipeline (what the tests' subprocess runs use too) takes a fifth off the fast tier.
QUICK_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {QUICK_COMPILE}".strip()


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


@pytest.fixture(scope="session", autouse=True)
def gguf_cache(tmp_path_factory):
    """GGUF targets' generated directories (models/formats/gguf.py) go to a temporary folder, for this
    process and the commands the tests start."""
    with pytest.MonkeyPatch.context() as patch:
        path = tmp_path_factory.mktemp("gguf_cache")
        patch.setenv("DFLASH_JAX_GGUF_CACHE", str(path))
        yield path


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory):
    """A tiny llama GGUF as llama.cpp writes SmolLM2's: Q4_1 matrices, Q8_0 embedding, tied."""
    from support.gguf_checkpoint import write_tiny_gguf

    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.Q4_1.gguf")
