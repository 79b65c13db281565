"""Errors a user can cause, as opposed to bugs.

The command-line modules print a `UserError` as one line (no traceback) and exit non-zero;
anything else is a bug and keeps its traceback. Every message names what is wrong and where
(the config field, or the file and, for JSON Lines, the 1-based line).
"""


def some_of(names: list[str], most: int = 4) -> str:
    """`names` as a message lists them: the first `most`, then how many more there are."""
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


class UserError(Exception):
    """A mistake in the user's input: a config field, a file, a row of data."""

    label = "error"  # what the one-line message starts with


class ConfigError(UserError):
    """A config field that cannot work, found before anything is created on disk."""

    label = "config error"


class DataError(UserError):
    """Input data that cannot be used: a missing or unreadable file, or a bad row in strict mode."""


class ModelError(UserError, ValueError):
    """A model directory or config.json that cannot be used: an unsupported architecture, a
    missing or misshapen tensor (a ValueError too, for callers that check shapes)."""
