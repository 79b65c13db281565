"""Packages whose every module is one entry: the target families (models/families/), and each
drafter kind's loss terms (training/kinds/) and drafting walk (decoding/kinds/)."""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any


def discover(package: str, path, attribute: str) -> dict[str, Any]:
    """The `attribute` of every module of the package `package` (its `__path__`), by its name."""
    return {entry.name: entry for entry in by_module(package, path, attribute).values()}


def by_module(package: str, path, attribute: str) -> dict[str, Any]:
    """The `attribute` of every module of the package `package` (its `__path__`), by the module's name."""
    return {
        module.name: getattr(importlib.import_module(f"{package}.{module.name}"), attribute)
        for module in pkgutil.iter_modules(path)
    }
