"""The README as a newcomer types it: a manual of at most 250 lines (its measurements live in
docs/performance.md), its development install and test commands are the ones `.ci/run` runs, and
every `configs/NAME.py[:variants]` string in it is accepted as written."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from dflash_jax import bundled
from dflash_jax.training.config.presets import check_variants_accepted, load_config_file

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text(encoding="utf-8")
# `configs/qwen3.py:8b,b10` as a reader copies it; `configs/NAME.py` (a placeholder) is not one.
CONFIG_STRING = re.compile(r"configs/[a-z0-9_]+\.py(?::[a-z0-9.,-]+)?")
# Issue 57: what it is, install, the CPU default, a real run, serving, configs, further reading.
MAX_LINES = 250
# Flags that change only how much a command prints.
QUIET = {"-q", "--quiet"}


def words(command: str) -> tuple[str, ...]:
    """A command as the shell splits it, without `python -m` before pip/pytest and quiet flags."""
    argv = shlex.split(command, comments=True)
    if argv[:2] == ["python", "-m"]:
        argv = argv[2:]
    return tuple(a for a in argv if a not in QUIET)


def readme_test_commands() -> list[tuple[str, ...]]:
    """The commands of the code block after the README's development paragraph."""
    section = README.split("\nDevelopment:", 1)[1]
    block = re.search(r"\n\n((?:    .*\n)+)", section).group(1)
    return [words(line) for line in block.splitlines() if line.strip()]


def ci_commands() -> list[tuple[str, ...]]:
    """The pip and pytest commands `.ci/run` runs, its `tier M ARGS` calls expanded through the
    pytest line of the `tier` function (`"$1"` is M, `"${@:2}"` the rest)."""
    script = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    tier = next(line for line in script.splitlines() if "pytest" in line and '"$1"' in line)
    out = []
    for line in script.splitlines():
        argv = shlex.split(line, comments=True)
        if line == tier:
            continue
        if argv[:1] == ["tier"]:
            line = tier.replace('"$1"', shlex.quote(argv[1])).replace('"${@:2}"', shlex.join(argv[2:]))
        command = words(line) if line.strip() and not line.lstrip().startswith("#") else ()
        if command[:2] == ("pip", "install") and "--upgrade" not in command or command[:1] == ("pytest",):
            out.append(command)
    return out


def test_the_readme_is_a_manual_of_at_most_250_lines():
    lines = len(README.splitlines())
    assert lines <= MAX_LINES, f"README.md has {lines} lines: move tables and details to docs/ (at most {MAX_LINES})"


def test_readme_test_commands_are_what_ci_runs():
    readme, ci = readme_test_commands(), ci_commands()
    assert readme, "the README's development block holds no command"
    assert readme == ci, f"README: {readme}\n.ci/run: {ci}"


@pytest.mark.parametrize("spec", sorted(set(CONFIG_STRING.findall(README))))
def test_every_config_string_in_the_readme_loads_as_typed(spec):
    path, _, variants = spec.partition(":")
    found = bundled.config_file(path)
    assert Path(found).is_file(), f"{spec}: no such config file"
    check_variants_accepted(found, variants, shown_as=path)
    load_config_file(found, variants)
