"""The fast tier (`pytest -m "not slow"`) still imports every module of the package.

`slow` marks subprocess runs, multi-device and multi-process runs, the notebook, the device
check, the wheel install and the longest tests. A module imported only by slow tests (or only
in their subprocesses) would go untested by the tier everyone runs on every change: this test
reads the test files (a file whose every test is slow does not count) and the package's own
imports, and names any module no fast test reaches."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from support.package_imports import PACKAGE, imports, module_name

TESTS = Path(__file__).resolve().parent


def is_slow(decorators: list[ast.expr]) -> bool:
    """`@pytest.mark.slow` among a test's decorators, or `pytestmark = pytest.mark.slow`."""
    return any(ast.unparse(d).replace(" ", "") in ("pytest.mark.slow", "[pytest.mark.slow]") for d in decorators)


def has_fast_tests(tree: ast.Module) -> bool:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in node.targets):
            if is_slow([node.value]):
                return False
    tests = [
        node
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_")
    ]
    return any(not is_slow(test.decorator_list) for test in tests)


def source_of(module: str) -> Path | None:
    """The file of a package module or of a test helper (`support.x`); None for anything else."""
    root = {"dflash_jax": PACKAGE.parent, "support": TESTS}.get(module.split(".")[0])
    if root is None:
        return None
    path = root.joinpath(*module.split("."))
    return next((p for p in (path.with_suffix(".py"), path / "__init__.py") if p.is_file()), None)


def reached_from(files: list[Path]) -> set[str]:
    """Package modules `files` import, directly or through the modules they import."""
    seen, todo = set(), [m for f in files for m in imports(f)]
    while todo:
        module = todo.pop()
        path = source_of(module)
        if module in seen or path is None:
            continue
        seen.add(module)
        todo += imports(path)
        if path.name == "__init__.py" and re.search(r"registry\.\w+\(__name__, __path__", path.read_text()):
            # A registry package imports every module of its own (models/families/, and each drafter
            # kind's loss terms and walk: training/kinds/, decoding/kinds/).
            todo += [f"{module}.{p.stem}" for p in path.parent.glob("*.py") if p.stem != "__init__"]
        parent = module.rpartition(".")[0]  # importing a.b.c runs a.b's __init__ too
        todo += [parent] if parent else []
    return {m for m in seen if m.split(".")[0] == "dflash_jax"}


def fast_test_files() -> list[Path]:
    return [p for p in sorted(TESTS.rglob("test_*.py")) if has_fast_tests(ast.parse(p.read_text()))]


def test_the_fast_tier_imports_every_module():
    modules = {module_name(p) for p in PACKAGE.rglob("*.py")}
    assert sorted(modules - reached_from(fast_test_files())) == []


def test_the_check_can_fail(tmp_path):
    slow_file = tmp_path / "test_slow.py"
    slow_file.write_text("import pytest\nfrom dflash_jax import plan\n\n@pytest.mark.slow\ndef test_a():\n    pass\n")
    all_slow = tmp_path / "test_all_slow.py"
    all_slow.write_text("import pytest\nimport dflash_jax.export\npytestmark = pytest.mark.slow\ndef test_b(): pass\n")
    mixed = tmp_path / "test_mixed.py"
    mixed.write_text("import pytest\n@pytest.mark.slow\ndef test_c(): pass\ndef test_d():\n    import dflash_jax.cli\n")
    assert [has_fast_tests(ast.parse(p.read_text())) for p in (slow_file, all_slow, mixed)] == [False, False, True]
    reached = reached_from([mixed])
    assert "dflash_jax.cli" in reached and "dflash_jax.errors" in reached  # cli imports errors
    assert "dflash_jax.plan" not in reached and "dflash_jax.export" not in reached
