"""What every command-line module shares: absl start-up, the `--config` flag of the commands that
read a training config, one-line user errors, exit statuses.

Each command's `define_flags(flag_values)` defines its flags on absl's FLAGS when it runs as a
program; tests pass their own FlagValues, since several commands share flag names.

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
import functools
import logging
import os
import re
import sys
import textwrap
from collections.abc import Callable, Mapping

from absl import app, flags
from ml_collections import config_flags

from dflash_jax import bundled
from dflash_jax.errors import ConfigError, UserError

# A full disk, a quota, a read-only filesystem: reported in one line, like a user error.
STORAGE_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)

EXIT_ERROR = 1
EXIT_STOPPED = 75
EXIT_INTERRUPTED = 130

CONFIG_FLAG = "config"
PRINT_CONFIG_FLAG = "print_config"
HELP_FLAGS = ("--help", "-help", "-h", "-?", "--helpshort", "--helpfull")
flags.disclaim_key_flags()  # --config is the flag of the command that defines it: its --help lists it
# --config.section.field=value, and --noconfig.section.field for a boolean False.
_CONFIG_OVERRIDE = re.compile(rf"--?(?:no)?{CONFIG_FLAG}\.(.+)")
# --config=file.py[:variants], or --config followed by its value.
_CONFIG_FILE = re.compile(rf"--?{CONFIG_FLAG}(?:=(.*))?")
# absl's words for a required flag left out (the message of mark_flag_as_required's validator).
_MISSING_FLAG = re.compile(r"--(\w+)=None: Flag --\1 must have a value other than None\.")
_REQUIRED_MESSAGE = "Flag --{} must have a value other than None."


def define_config(default: str | None = None, flag_values: flags.FlagValues = flags.FLAGS) -> flags.FlagHolder:
    """`--config=file.py[:variants]` with its `--config.section.field=value` overrides, and
    `--print_config`.

    With a default file, ml_collections reads it and looks the overrides up right here, when the
    flag is defined, rather than when `run` parses the flags: hence the same checks here.
    """
    from dflash_jax.training.config.schema import FIELDS_DOCUMENTED  # only these commands need the schema

    with _flag_errors_exit():
        _checked_config_arguments(sys.argv, has_default=default is not None)
        flags.DEFINE_bool(
            PRINT_CONFIG_FLAG,
            False,
            "Print the resolved config (file, variants and overrides) with every field's comment, and exit.",
            flag_values=flag_values,
        )
        return config_flags.DEFINE_config_file(
            CONFIG_FLAG,
            default,
            "Training config file, optionally with variants: file.py:variant,variant (`dflash-jax "
            "list-configs` lists them; a bundled one is found by name, configs/qwen3.py, from any "
            "directory); override any field with --config.section.field=value; "
            f"{FIELDS_DOCUMENTED}.",
            flag_values=flag_values,
            lock_config=True,
        )


def define_sampling_flags(temperature_help: str, flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """--temperature, --top_p and --top_k, read back by `sampling_config`, and --seed."""
    fv = dict(flag_values=flag_values)
    flags.DEFINE_float("temperature", 0.0, temperature_help, lower_bound=0, **fv)
    flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass (1: off).", **fv)
    flags.DEFINE_integer("top_k", 0, "Top-k sampling (0: off).", lower_bound=0, **fv)
    flags.DEFINE_integer("seed", 0, "Sampling seed.", **fv)


def define_dtype_flag(what: str, choices: list[str], flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """--dtype, left out: `default_dtype()`'s (read back by `dtype_flag`)."""
    flags.DEFINE_enum(
        "dtype",
        None,
        choices,
        f"{what} (default: float32 on a CPU, bfloat16 on an accelerator).",
        flag_values=flag_values,
    )


def dtype_flag(f: flags.FlagValues) -> str:
    """--dtype's value, or `default_dtype()` where it was left out."""
    return f.dtype or default_dtype()


def sampling_config(f: flags.FlagValues):
    """The `decoding.sampling.SamplingConfig` of the sampling flags; a bad value is a user error."""
    from dflash_jax.decoding.sampling import SamplingConfig  # only the decoding commands need jax

    try:
        return SamplingConfig(f.temperature, top_p=f.top_p, top_k=f.top_k)
    except ValueError as e:
        raise UserError(str(e)) from None


def run(
    main: Callable[[list[str]], int | None],
    define_flags: Callable[[], None],
    renamed: Mapping[str, str] | None = None,
) -> None:
    """`absl.app.run(main)` after `define_flags()`, with user errors as one line and the exit
    statuses above.

    `--help` prints the command's docstring and flags and exits 0; `renamed` maps a flag's old
    name to its new one, for a one-line hint instead of "unknown flag"; with `--print_config`,
    the config is printed instead of running `main`.
    """
    define_flags()
    doc = sys.modules[main.__module__].__doc__ or ""

    def guarded(argv):
        # JAX, Orbax and grain log every backend probe, save and read at INFO, gguf-py every file it
        # writes; keep ours.
        for name in ("absl", "jax", "gguf"):
            logging.getLogger(name).setLevel(logging.WARNING)
        try:
            if len(argv) > 1:
                raise UserError(f"unexpected arguments {argv[1:]}: every input is a flag, --name=value")
            if PRINT_CONFIG_FLAG in flags.FLAGS and flags.FLAGS[PRINT_CONFIG_FLAG].value:
                from dflash_jax.training.config.config_text import describe_config

                print(describe_config(flags.FLAGS[CONFIG_FLAG].value))
                return 0
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
        except BrokenPipeError:  # the reader stopped (`| head`): no traceback, and none at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_ERROR

    app.run(guarded, flags_parser=functools.partial(_parse_flags, doc=doc, renamed=renamed or {}))


def _parse_flags(argv: list[str], *, doc: str, renamed: Mapping[str, str]) -> list[str]:
    """absl's flag parsing, with one-line errors instead of a traceback or a page of usage, and
    help on stdout with exit status 0 (absl's exits 1)."""
    arguments = argv[1 : argv.index("--")] if "--" in argv else argv[1:]
    if any(arg in HELP_FLAGS for arg in arguments):
        print(help_text(flags.FLAGS, doc, full="--helpfull" in arguments))
        sys.exit(0)
    with _flag_errors_exit():
        check_renamed_flags(arguments, renamed)
        if CONFIG_FLAG in flags.FLAGS:
            argv = _checked_config_arguments(argv, has_default=flags.FLAGS[CONFIG_FLAG].default is not None)
        return flags.FLAGS(argv)


def help_text(flag_values: flags.FlagValues, doc: str, full: bool = False) -> str:
    """The command's docstring, then its flags: each with its help and `(required)` or its
    default, bundled paths as they read in the repository. `full` adds the flags the libraries
    define (absl's logging, grain, orbax), by module."""
    by_module = flag_values.flags_by_module_dict()
    lines = [textwrap.dedent(doc).strip(), "", "flags:"]
    ours = {f for module, fs in by_module.items() if _is_ours(module) for f in fs}
    lines += [_flag_help(f) for f in sorted(ours, key=lambda f: f.name)]
    for module, fs in sorted(by_module.items()) if full else ():
        if not _is_ours(module):
            lines += ["", f"{module}:", *[_flag_help(f) for f in sorted(fs, key=lambda f: f.name)]]
    return "\n".join(lines)


def _is_ours(module: str) -> bool:
    """Flags this package defines: by its modules, or by a program run as __main__ (absl then
    names the module by its path)."""
    return module.startswith("dflash_jax") or module == sys.argv[0]


def _flag_help(flag: flags.Flag) -> str:
    name = f"--[no]{flag.name}" if flag.boolean else f"--{flag.name}"
    text = textwrap.fill(f"{name}: {flag.help}", width=100, initial_indent="  ", subsequent_indent="    ")
    required = any(getattr(v, "message", None) == _REQUIRED_MESSAGE.format(flag.name) for v in flag.validators)
    if required:
        text += "\n    (required)"
    elif flag.default_as_str:
        text += f"\n    (default: {_without_machine_paths(flag.default_as_str)})"
    if flag.parser.syntactic_help:
        text += f"\n    ({flag.parser.syntactic_help})"
    return text


def _without_machine_paths(text: str) -> str:
    """Bundled paths in `text` as they read in the repository (`configs/default.py`)."""
    return text.replace(f"{bundled.ROOT}{os.sep}", "")


def check_renamed_flags(arguments: list[str], renamed: Mapping[str, str]) -> None:
    """A flag given by its old name: a UserError naming the new one (absl would suggest the
    closest flag, often another one)."""
    for arg in arguments:
        name = arg.lstrip("-").split("=", 1)[0]
        if arg.startswith("-") and name in renamed:
            raise UserError(f"--{name} is now --{renamed[name]}")


def _checked_config_arguments(argv: list[str], *, has_default: bool) -> list[str]:
    """What ml_collections would report with a traceback or a misleading line, caught first: an
    override of a field that does not exist (naming the closest one), overrides without the config
    file they change (`has_default`: the command has one of its own), a config file that does not
    exist, and variants given to a config file that has none. Returns argv with a config file that
    is not here replaced by the bundled config of its name (`configs/qwen3.py` from any directory)."""
    from dflash_jax.training.config.presets import check_variants_accepted
    from dflash_jax.training.config.schema import check_field_path

    out = list(argv)
    overrides, config_given = [], False
    for i, arg in enumerate(argv[1:], start=1):
        if arg == "--":
            break
        name = arg.split("=", 1)[0]
        if override := _CONFIG_OVERRIDE.fullmatch(name):
            check_field_path(override.group(1))
            overrides.append(name)
        elif config_file := _CONFIG_FILE.fullmatch(arg):
            config_given = True
            inline = config_file.group(1) is not None  # --config=value, else --config value
            at = i if inline else i + 1
            value = config_file.group(1) if inline else argv[at] if at < len(argv) else ""
            path, colon, variants = value.partition(":")
            found = bundled.config_file(path)
            if not os.path.isfile(found):
                raise ConfigError(
                    f"--{CONFIG_FLAG}={value}: no such file (`dflash-jax list-configs` lists the bundled ones)"
                )
            check_variants_accepted(found, variants, shown_as=path)
            out[at] = (f"--{CONFIG_FLAG}=" if inline else "") + found + colon + variants
    if overrides and not config_given and not has_default:  # absl would call them unknown flags
        raise ConfigError(
            f"{overrides[0]} overrides a field of the config file, and no --{CONFIG_FLAG}=FILE is given "
            "(`dflash-jax list-configs` lists the bundled ones)"
        )
    return out


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


def default_dtype() -> str:
    """The weights' and compute's dtype when a command's --dtype is left out: float32 on a CPU,
    where bfloat16 matmuls are emulated and slow, bfloat16 on an accelerator."""
    import jax

    return "float32" if jax.default_backend() == "cpu" else "bfloat16"
