"""Decoding test fixtures; the model builders live in decoding_models.py beside this file."""

from __future__ import annotations

import pathlib
import sys

import pytest

# pytest runs with --import-mode=importlib, which does not put test directories on sys.path.
sys.path.insert(0, str(pathlib.Path(__file__).parent))

from decoding_models import make_drafter, make_target  # noqa: E402


@pytest.fixture(scope="session")
def random_target():
    return make_target(seed=1)


@pytest.fixture(scope="session")
def untrained_drafter(random_target):
    return make_drafter(random_target, seed=2)
