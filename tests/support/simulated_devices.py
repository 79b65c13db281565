"""Run a test script in a fresh Python process with simulated CPU devices (the device count is
fixed when JAX starts, so multi-device checks cannot run in the test process itself)."""

from __future__ import annotations

import os
import subprocess
import sys


def run_script(code: str, *, devices: int, import_dir: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """`python -c code` on `devices` simulated CPU devices, with `import_dir` importable."""
    env = dict(
        os.environ,
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
        JAX_PLATFORMS="cpu",
        PYTHONPATH=os.pathsep.join([import_dir, os.environ.get("PYTHONPATH", "")]),
    )
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
