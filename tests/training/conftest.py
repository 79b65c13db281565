"""Training test fixtures; the helpers live in `tests/support/training_runs.py`."""

from __future__ import annotations

import pytest

from support import training_runs as testing


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    return testing.write_tiny_run(tmp_path_factory.mktemp("tiny_run"))


@pytest.fixture(scope="session")
def compilation_cache(tmp_path_factory):
    """Shared by the session's training subprocesses: one configuration compiles once."""
    return tmp_path_factory.mktemp("jax_compilation_cache")
