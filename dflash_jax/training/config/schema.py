"""The training config's schema: `base_config()` generated from the section dataclasses
(training/config/sections.py; `data` is data/settings.py's `DataConfig`), where each field's default and
meaning are written once, and the checks every config goes through: every field it sets exists
(`check_field_names`, naming the closest real one), and each section has the right types and
passes its own `problems()` (`section`). A mistake is a `ConfigError` naming its field.
"""

from __future__ import annotations

import dataclasses
import difflib
import numbers
import typing

import ml_collections

from dflash_jax.errors import ConfigError
from dflash_jax.field_checks import field_path
from dflash_jax.models.drafter_config import section_fields
from dflash_jax.training.config.sections import SECTIONS, TopLevelSettings

FIELDS_DOCUMENTED = (
    "every field, its default and its meaning are documented in the section dataclasses of "
    "dflash_jax/training/config/sections.py (train: also ObjectiveSettings in dflash_jax/training/objective.py "
    "and OptimizerConfig in dflash_jax/training/optim/optimizer.py; drafter: DrafterConfig in "
    "dflash_jax/models/drafter_config.py and each kind's sizes in dflash_jax/models/kinds/; data: DataConfig "
    "in dflash_jax/data/settings.py); --print_config prints them"
)


def base_config() -> ml_collections.ConfigDict:
    """Every field with its default, generated from the section dataclasses (training/config/sections.py,
    data/settings.py for `data`), where each field is documented."""
    config = _config_dict(TopLevelSettings())
    for name, section in SECTIONS.items():
        config[name] = _config_dict(section())
    return config


def _config_dict(settings) -> ml_collections.ConfigDict:
    # Not type-safe: a value of the wrong type is reported by resolve, naming section.field.
    values = {f.name: getattr(settings, f.name) for f in section_fields(type(settings))}
    return ml_collections.ConfigDict(values, type_safe=False)


def field_paths() -> list[str]:
    """Every field of the config as overrides name it: `workdir`, `train.learning_rate`, ..."""
    top = [f.name for f in dataclasses.fields(TopLevelSettings)]
    return top + [field_path(name, f.name) for name, cls in SECTIONS.items() for f in section_fields(cls)]


def check_field_path(path: str) -> None:
    """Raises ConfigError, naming the closest real field, when `path` is not a field."""
    paths = field_paths()
    if path in paths:
        return
    closest = difflib.get_close_matches(path, paths, n=1)
    raise ConfigError(f"no field {path}; " + (f"did you mean {closest[0]}?" if closest else FIELDS_DOCUMENTED))


def check_field_names(config: ml_collections.ConfigDict) -> None:
    """Every field `config` sets exists: a mistyped name would otherwise be a silent no-op."""
    for key in config.keys():
        value = config[key]
        if key in SECTIONS and isinstance(value, (ml_collections.ConfigDict, dict)):
            for name in value.keys():
                check_field_path(field_path(key, name))
        else:
            check_field_path(key)


def section(config: ml_collections.ConfigDict, name: str):
    """Section `name` ('' = the top-level fields) of `config` as its dataclass, checked: a value
    of the wrong type or one of the section's problems is a ConfigError. Fields the config does
    not set keep their dataclass defaults."""
    cls = SECTIONS[name] if name else TopLevelSettings
    values = config if not name else config[name] if name in config else {}
    types = typing.get_type_hints(cls)
    settings = cls(
        **{
            f.name: _typed(field_path(name, f.name), values[f.name], types[f.name])
            for f in section_fields(cls)
            if f.name in values
        }
    )
    problems = settings.problems()
    require(not problems, "; ".join(problems))
    return settings


# What a message calls each type a field can have, and the values it accepts (numpy scalars
# included; an int is a number), converted to it.
_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "True or False"}
_ACCEPTED = {str: str, int: numbers.Integral, float: numbers.Real, bool: bool}


def _typed(path: str, value, kind):
    """`value` as a field of type `kind` (a list is a tuple), else a ConfigError."""
    if typing.get_origin(kind) is tuple:
        item = typing.get_args(kind)[0]  # tuple[item, ...]
        if isinstance(value, (tuple, list)) and all(_accepts(item, v) for v in value):
            return tuple(item(v) for v in value)
        raise ConfigError(f"{path}={value!r} must be a tuple of {_TYPE_NAMES[item].split()[-1]}s")
    require(_accepts(kind, value), f"{path}={value!r} must be {_TYPE_NAMES[kind]}")
    return kind(value)


def _accepts(kind, value) -> bool:
    # A bool is an int to Python, not to a config.
    return isinstance(value, _ACCEPTED[kind]) and (kind is bool or not isinstance(value, bool))


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)
