"""What the package's modules and the tests import, read from their source (for the layering
check and the fast tier's coverage check)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "dflash_jax"


def imports(path: Path) -> list[str]:
    """Every module a file imports, at any depth (function-level imports included). `from a
    import b` lists `a` and `a.b` (which is a module when b is one: `from dflash_jax import cli`)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append(node.module)
            found += [f"{node.module}.{alias.name}" for alias in node.names]
    return found


def module_name(path: Path) -> str:
    """dflash_jax/training/loop.py -> 'dflash_jax.training.loop'."""
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
