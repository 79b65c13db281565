"""What every command-line module shares: absl start-up, the `--config` flag of the commands that
read a training config, one-line user errors, exit statuses.

No command takes positional arguments: a stray word (`--prompts=a b`) is a one-line error, not
silently ignored. Flag names follow one convention across commands (README, "Command-line
conventions").

Exit statuses, the same for every command:
  0   success (a training run that finished, or had finished before)
  1   an error; a user error (bad config, file or data) is one line on stderr, no traceback
  75  training stopped on request (SIGTERM / SIGINT) after saving a checkpoint: rerun the same
      command to resume (EX_TEMPFAIL, which batch schedulers read as "try again")
  130 interrupted by Ctrl-C outside training, nothing saved
Anything else that escapes is a bug and keeps its traceback.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import sys
from collections.abc import Callable

from absl import app, flags
from ml_collections import config_flags

from dflash_jax.errors import ConfigError, UserError

# A full disk, a quota, a read-only filesystem: reported in one line, like a user error.
STORAGE_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)

EXIT_ERROR = 1
EXIT_STOPPED = 75
EXIT_INTERRUPTED = 130

CONFIG_FLAG = "config"
flags.disclaim_key_flags()  # --config is the flag of the command that defines it: its --help lists it
# --config.section.field=value, and --noconfig.section.field for a boolean False.
_CONFIG_OVERRIDE = re.compile(rf"--?(?:no)?{CONFIG_FLAG}\.(.+)")
# --config=file.py[:variants], or --config followed by its value.
_CONFIG_FILE = re.compile(rf"--?{CONFIG_FLAG}(?:=(.*))?")
# absl's words for a required flag left out.
_MISSING_FLAG = re.compile(r"--(\w+)=None: Flag --\1 must have a value other than None\.")


def define_config(default: str | None = None) -> flags.FlagHolder:
    """`--config=file.py[:variants]` with its `--config.section.field=value` overrides.

    With a default file, ml_collections reads it and looks the overrides up right here, when the
    flag is defined, rather than when `run` parses the flags: hence the same checks here.
    """
    from dflash_jax.training.run_config import FIELDS_DOCUMENTED  # only these commands need the schema

    with _flag_errors_exit():
        _check_config_arguments(sys.argv)
        return config_flags.DEFINE_config_file(
            CONFIG_FLAG,
            default,
            "Training config file (configs/*.py), optionally with variants: file.py:variant,variant; "
            f"override any field with --config.section.field=value; {FIELDS_DOCUMENTED}.",
            lock_config=True,
        )


def run(main: Callable[[list[str]], int | None]) -> None:
    """`absl.app.run(main)`, with user errors as one line and the exit statuses above."""

    def guarded(argv):
        # JAX, Orbax and grain log every backend probe, save and read at INFO; keep ours.
        for name in ("absl", "jax"):
            logging.getLogger(name).setLevel(logging.WARNING)
        try:
            if len(argv) > 1:
                raise UserError(f"unexpected arguments {argv[1:]}: every input is a flag, --name=value")
            return main(argv)
        except UserError as e:
            print(f"{e.label}: {e}", file=sys.stderr)
        except OSError as e:
            if e.errno not in STORAGE_ERRORS:
                raise
            print(f"error: {e}", file=sys.stderr)  # the machine's storage, not a bug
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED
        return EXIT_ERROR

    app.run(guarded, flags_parser=_parse_flags)


def _parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing, with one-line errors instead of a traceback or a page of usage."""
    with _flag_errors_exit():
        if CONFIG_FLAG in flags.FLAGS:
            _check_config_arguments(argv)
        return flags.FLAGS(argv)


def _check_config_arguments(argv: list[str]) -> None:
    """What ml_collections would report with a traceback, caught first: an override of a field
    that does not exist (naming the closest one) and a config file that does not exist."""
    from dflash_jax.training.run_config import check_field_path

    for i, arg in enumerate(argv[1:], start=1):
        if arg == "--":
            break
        name = arg.split("=", 1)[0]
        if override := _CONFIG_OVERRIDE.fullmatch(name):
            check_field_path(override.group(1))
        elif config_file := _CONFIG_FILE.fullmatch(arg):
            value = config_file.group(1)
            if value is None:
                value = argv[i + 1] if i + 1 < len(argv) else ""
            if not os.path.isfile(value.split(":", 1)[0]):
                raise ConfigError(f"--{CONFIG_FLAG}={value}: no such file")


@contextlib.contextmanager
def _flag_errors_exit():
    """A bad flag, config file or config field: one line on stderr, then EXIT_ERROR."""
    try:
        yield
    except UserError as e:  # a mistyped field, or a config file's own check (configs/qwen3.py's variants)
        message = f"{e.label}: {e}"
    except flags.Error as e:  # e.g. a value that does not parse as its field's type
        text = str(e).removeprefix("flag ")
        if missing := _MISSING_FLAG.fullmatch(text):
            text = f"--{missing.group(1)} is required"
        label = ConfigError.label if text.startswith(f"--{CONFIG_FLAG}.") else UserError.label
        message = f"{label}: {text}"
    else:
        return
    print(message, file=sys.stderr)
    sys.exit(EXIT_ERROR)
