"""What models/families/ and models/kinds/ share: a package whose every module is one entry."""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any


def discover(package: str, path, attribute: str) -> dict[str, Any]:
    """The `attribute` of every module of the package `package` (its `__path__`), by its name."""
    found = {}
    for module in pkgutil.iter_modules(path):
        entry = getattr(importlib.import_module(f"{package}.{module.name}"), attribute)
        found[entry.name] = entry
    return found
