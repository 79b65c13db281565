"""What the package does before JAX starts: it chooses JAX's platform from the hardware here, and
keeps the CUDA plugin's load-time log lines off stderr on a machine without an NVIDIA GPU.

The compile extras (`tpu-compile`: libtpu; `gpu-compile`: the CUDA plugin) make a JAX left to
choose its platform probe hardware that is not here: the CUDA plugin's version check raises and
JAX logs its traceback, libtpu starts and warns that it found no TPU. And the plugin's kernel
libraries, which `import jax` loads whatever the platform, log from C++ that they found no CUDA
runtime (no environment variable silences absl's log before it is initialized).

Jax-free on purpose: JAX reads JAX_PLATFORMS once, when it is imported, so the package's
`__init__` runs `start()` before any of its modules imports jax: every command (`dflash-jax`,
`python -m dflash_jax.NAME`, `python train.py`) starts here.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import importlib.abc
import importlib.machinery
import importlib.util
import os
import re
import sys
import tempfile

PLATFORMS_VARIABLE = "JAX_PLATFORMS"
# The device files of an NVIDIA GPU (as JAX looks for them; /dev/dxg: WSL2), and of a TPU
# (/dev/accel*: v4 and older; /dev/vfio/N: the v5 generation and newer). An AMD GPU is /dev/kfd.
NVIDIA_DEVICES = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg")
TPU_DEVICES = ("/dev/accel*", "/dev/vfio/[0-9]*")
OTHER_ACCELERATORS = ("/dev/kfd",)
# The CUDA plugin: its kernels' packages, and the PJRT plugin JAX discovers and initializes.
CUDA_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin")
CUDA_PJRT_PLUGINS = ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")

# What each of the CUDA plugin's libraries logs as it loads without a CUDA runtime.
CUDA_PLUGIN_NOISE = re.compile(
    rb"(?m)^(?:WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR\n"
    rb"|I\d{4} [\d:. ]+\d+ cudart_stub\.cc:\d+\] Could not find cuda drivers on your machine, GPU will not be used\.\n)"
)


def start() -> None:
    """Choose JAX's platform unless the user did, and drop the CUDA plugin's load-time lines
    where no NVIDIA GPU is here (where one is, they say its CUDA is missing: they stay)."""
    if PLATFORMS_VARIABLE not in os.environ and (platforms := default_platforms()):
        os.environ[PLATFORMS_VARIABLE] = platforms
    if not _present(NVIDIA_DEVICES) and not any(isinstance(f, _QuietCudaPlugin) for f in sys.meta_path):
        sys.meta_path.insert(0, _QuietCudaPlugin())


def default_platforms() -> str | None:
    """JAX_PLATFORMS for the hardware here: 'cuda,cpu' on an NVIDIA GPU with the CUDA plugin
    installed, 'cpu' where no accelerator is, and None (JAX chooses) on any other accelerator:
    a TPU (JAX's own start-up picks it), a GPU without its plugin (JAX says so), an AMD GPU."""
    if _present(NVIDIA_DEVICES):
        return "cuda,cpu" if any(importlib.util.find_spec(p) for p in CUDA_PLUGINS) else None
    if _present(TPU_DEVICES + OTHER_ACCELERATORS):
        return None
    return "cpu"


def _present(patterns: tuple[str, ...]) -> bool:
    return any(glob.glob(pattern) for pattern in patterns)


class _QuietCudaPlugin(importlib.abc.MetaPathFinder):
    """Runs the CUDA plugin's start-up with CUDA_PLUGIN_NOISE dropped from what it writes to
    stderr: the loads of its compiled kernels (at `import jax`) and its PJRT plugin's
    `initialize()` (JAX's first use of a device); any other line stays."""

    def find_spec(self, name, path, target=None):
        package, dot, _ = name.partition(".")
        if not (dot and package in CUDA_PLUGINS) and name not in CUDA_PJRT_PLUGINS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _QuietLoader(spec.loader)
        return spec


class _QuietLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader):
        self.loader = loader

    def create_module(self, spec):
        with _stderr_without(CUDA_PLUGIN_NOISE):
            return self.loader.create_module(spec)

    def exec_module(self, module):
        with _stderr_without(CUDA_PLUGIN_NOISE):
            self.loader.exec_module(module)
        if module.__name__ in CUDA_PJRT_PLUGINS:
            module.initialize = _quiet(module.initialize)


def _quiet(function):
    @functools.wraps(function)
    def quiet(*args, **kwargs):
        with _stderr_without(CUDA_PLUGIN_NOISE):
            return function(*args, **kwargs)

    return quiet


@contextlib.contextmanager
def _stderr_without(noise: re.Pattern[bytes]):
    """Everything written to file descriptor 2 inside the block (C++ writes there directly), less
    the lines `noise` matches, written out when it ends."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no stderr to filter
        yield
        return
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            kept = noise.sub(b"", captured.read())
            with open(2, "wb", closefd=False) as stderr:
                stderr.write(kept)
