"""A training config as text: every field with its value, and the comments that document it.

The comments are read from the section dataclasses' source (training/config/sections.py and the classes
its sections extend, data/settings.py for `data`), where each field is documented once, and
printed as they stand there: a comment above a group of fields is printed above the same group. `--print_config` prints this;
`dflash-jax list-configs` uses `field_values` to say what each config file and variant sets.
"""

from __future__ import annotations

import dataclasses
import inspect
import re

import ml_collections

from dflash_jax.field_checks import field_path
from dflash_jax.models.drafter_config import section_fields
from dflash_jax.training.config.sections import SECTIONS, TopLevelSettings

_FIELD = re.compile(r"\s+(\w+)\s*:[^=]+=")
_METHODS = re.compile(r"\s+(def |@)")  # the fields end where the methods begin


def field_values(config: ml_collections.ConfigDict) -> dict[str, object]:
    """{'workdir': ..., 'train.learning_rate': ..., ...} for every field `config` holds."""
    values = {}
    for key, value in config.items():
        if key in SECTIONS and isinstance(value, ml_collections.ConfigDict):
            values.update({field_path(key, name): v for name, v in value.items()})
        else:
            values[key] = value
    return values


def describe_config(config: ml_collections.ConfigDict) -> str:
    """Every field as `section.field = value`, `(default: ...)` where the config changes it, under
    the comments its dataclass gives it."""
    values = field_values(config)
    legend = (
        "# Every field of the config. `(default: X)` marks a field that the config file, its variants\n"
        "# or the command line set away from its default (training/config/sections.py and the classes it extends)."
    )
    blocks = [legend, _describe_section("", TopLevelSettings, values)]
    for name, cls in SECTIONS.items():
        blocks.append(_describe_section(name, cls, values))
    return "\n\n".join(blocks)


def _describe_section(section: str, cls, values: dict[str, object]) -> str:
    defaults = {f.name: f.default for f in section_fields(cls)}
    doc = inspect.getdoc(cls)
    written = not doc.startswith(f"{cls.__name__}(")  # else the signature dataclasses put there
    summary = " ".join(doc.split("\n\n")[0].split())
    lines = [f"## {section or 'top level'}" + (f": {summary}" if written else "")]
    shown = set()
    # A section may extend others (train: ObjectiveSettings, OptimizerConfig; drafter: its kinds'
    # sizes): each class's own fields, in the order dataclasses gives them (the bases' first).
    # A comment is printed with the fields below it, not above fields no config sets.
    for owner in reversed([c for c in cls.__mro__ if dataclasses.is_dataclass(c)]):
        comments = []
        for comment, name in _documented_fields(owner):
            if comment:
                comments.append(comment)
            elif name in defaults and name not in shown:
                shown.add(name)
                path = field_path(section, name)
                value = values.get(path, defaults[name])
                changed = "" if _same(value, defaults[name]) else f"    (default: {defaults[name]!r})"
                lines += [*comments, f"{path} = {value!r}{changed}"]
                comments = []
            else:
                comments = []
    return "\n".join(lines)


def _documented_fields(owner) -> list[tuple[str, str]]:
    """(comment line, '') and ('', field name) in the order `owner`'s source writes them."""
    source = inspect.getsource(owner).splitlines()[1:]
    end = next((i for i, line in enumerate(source) if _METHODS.match(line)), len(source))
    found = []
    for line in source[:end]:
        stripped, field = line.strip(), _FIELD.match(line)
        if stripped.startswith("#"):
            found.append((stripped, ""))
        elif field:
            found.append(("", field.group(1)))
    return found


def _same(value, default) -> bool:
    # A ConfigDict holds a tuple field given on the command line as a list.
    return list(value) == list(default) if isinstance(default, tuple) else value == default
