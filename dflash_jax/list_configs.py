"""List the bundled training config files, their variants and what each sets.

    dflash-jax list-configs              # every file: what it is, the fields it sets, its variants
    dflash-jax list-configs --markdown   # the README's table of config files

A file's fields are those it sets beyond the defaults of the section dataclasses (training/
sections.py); a variant's are those it changes from the file's default variants. Pass a file to
any training command as `--config=configs/NAME.py[:variant,variant]`; `--print_config` prints
every field of the result.
"""

from __future__ import annotations

import inspect
import textwrap
from pathlib import Path

from absl import flags

from dflash_jax import bundled, cli
from dflash_jax.training.config.config_text import field_values
from dflash_jax.training.config.presets import config_variants, load_config_module, takes_variants
from dflash_jax.training.config.schema import base_config


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    flags.DEFINE_bool("markdown", False, "Print the README's table of config files instead.", flag_values=flag_values)


def main(argv, f: flags.FlagValues = flags.FLAGS):
    del argv
    print(markdown_table() if f.markdown else listing())


def config_files(directory: Path = bundled.CONFIGS) -> list[Path]:
    """The config files, the default run first."""
    return sorted(directory.glob("*.py"), key=lambda p: (p.name != "default.py", p.name))


def listing(directory: Path = bundled.CONFIGS) -> str:
    return "\n\n".join(_describe_file(path) for path in config_files(directory))


def markdown_table(directory: Path = bundled.CONFIGS) -> str:
    rows = ["| config | what it is | variants (in bold: what the default already is) |", "|---|---|---|"]
    for path in config_files(directory):
        module = load_config_module(str(path))
        names = ", ".join(f"**`{v}`**" if not sets else f"`{v}`" for v, sets in _variants(module)) or "none"
        rows.append(f"| `{bundled.shown(path)}` | {_summary(module)} | {names} |")
    return "\n".join(rows)


def _describe_file(path: Path) -> str:
    module = load_config_module(str(path))
    lines = [f"{bundled.shown(path)}: {_summary(module)}"]
    sets = _fields(_changes(field_values(base_config()), field_values(module.get_config())))
    lines.append(textwrap.fill(f"sets: {sets}", width=100, initial_indent="  ", subsequent_indent="    "))
    variants = config_variants(module)
    if not takes_variants(module):
        lines.append("  variants: none")
    elif variants is None:
        lines.append("  variants: not listed (it declares no VARIANTS)")
    else:
        lines.append(f"  variants (default {variants.default_size}), comma-separated:")
        width = max(len(name) for name in variants.names())
        for name, sets in _variants(module):
            lines.append(f"    {name:<{width}}  {_fields(sets) if sets else '(as the default)'}")
    return "\n".join(lines)


def _variants(module) -> list[tuple[str, dict]]:
    """Each variant of a config module with the fields it changes from the default variants."""
    variants = config_variants(module)
    if variants is None:
        return []
    default = field_values(module.get_config())
    return [(name, _changes(default, field_values(module.get_config(name)))) for name in variants.names()]


def _summary(module) -> str:
    return " ".join((inspect.getdoc(module) or "").split("\n\n")[0].split())


def _changes(before: dict, after: dict) -> dict:
    return {k: v for k, v in after.items() if before.get(k) != v}


def _fields(values: dict) -> str:
    return ", ".join(f"{k}={_value(v)}" for k, v in values.items()) or "nothing beyond the defaults"


def _value(value) -> str:
    """A field's value, bundled paths (one, or comma-separated as `data.train` takes them) as they
    read in the repository (configs/targets/...)."""
    if isinstance(value, str):  # `shown` leaves anything but an absolute path as it is
        value = ",".join(bundled.shown(part) for part in value.split(","))
    return repr(value)


def run() -> None:
    """The command: `dflash-jax list-configs`."""
    cli.run(main, define_flags)


if __name__ == "__main__":
    run()
