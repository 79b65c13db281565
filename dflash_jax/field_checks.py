"""The checks every config section's `problems()` makes of its fields, one message each, naming
the field as overrides name it (`section.field`, or `field` at the top level). Jax-free, so any
layer's settings (models/drafter_config.py, data/settings.py, training/config/sections.py) use it."""

from __future__ import annotations


def field_path(section: str, name: str) -> str:
    """How messages and overrides name a field: `section.name`, or `name` at the top level."""
    return f"{section}.{name}" if section else name


def at_least(section: str, settings, **minimum) -> list[str]:
    """A message for each field below its minimum."""
    return [
        f"{field_path(section, name)}={getattr(settings, name)} must be at least {low}"
        for name, low in minimum.items()
        if getattr(settings, name) < low
    ]


def one_of(section: str, settings, **allowed) -> list[str]:
    """A message for each field whose value is not among its choices."""
    return [
        f"{field_path(section, name)}={getattr(settings, name)!r} is not one of {', '.join(choices)}"
        for name, choices in allowed.items()
        if getattr(settings, name) not in choices
    ]
