"""Every command starts quietly whichever extras are installed (dflash_jax/startup.py): JAX's
platform is chosen from the hardware here unless JAX_PLATFORMS says, and the CUDA plugin's
load-time lines are dropped where no NVIDIA GPU is. The choice and the filter are tested
in-process; the commands (subprocesses, without JAX_PLATFORMS) in the slow tier."""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_jax import startup

REPO = Path(__file__).resolve().parents[1]
DISPATCH = "from dflash_jax.commands import main; main()"
# What the extras print when JAX is left to probe hardware that is not here: the CUDA plugin's C++
# log and its version check's traceback, and libtpu's warnings.
NOISE_MARKERS = ("Traceback", "absl::InitializeLog", "cudart_stub", "Jax plugin", "TPU", "libtpu")
CUDART_LINES = (
    b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n"
    b"I0000 00:00:1796524597.865124   17913 cudart_stub.cc:31] Could not find cuda drivers on your machine, "
    b"GPU will not be used.\n"
)


@pytest.fixture
def hardware(tmp_path, monkeypatch):
    """A machine whose device files are those under tmp_path: `hardware("nvidia0")` adds one."""
    monkeypatch.setattr(startup, "NVIDIA_DEVICES", (str(tmp_path / "nvidia0"),))
    monkeypatch.setattr(startup, "TPU_DEVICES", (str(tmp_path / "accel*"),))
    monkeypatch.setattr(startup, "OTHER_ACCELERATORS", (str(tmp_path / "kfd"),))
    return lambda name: (tmp_path / name).touch()


def test_the_platform_is_the_cpu_only_where_no_accelerator_is(hardware, monkeypatch):
    assert startup.default_platforms() == "cpu"
    hardware("accel0")  # a TPU: JAX's own start-up picks it
    assert startup.default_platforms() is None
    hardware("nvidia0")
    monkeypatch.setattr(startup, "CUDA_PLUGINS", ("jax",))  # a CUDA plugin installed
    assert startup.default_platforms() == "cuda,cpu"
    monkeypatch.setattr(startup, "CUDA_PLUGINS", ("no_such_cuda_plugin",))  # JAX says it is missing
    assert startup.default_platforms() is None


def test_the_users_platform_wins(hardware, monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "tpu")
    startup.start()
    assert os.environ["JAX_PLATFORMS"] == "tpu"
    monkeypatch.delenv("JAX_PLATFORMS")
    startup.start()
    assert os.environ["JAX_PLATFORMS"] == "cpu"


def test_only_the_cuda_plugins_load_lines_are_dropped(capfd):
    with startup._stderr_without(startup.CUDA_PLUGIN_NOISE):
        os.write(2, b"before\n" + CUDART_LINES + b"E0000 a real error\n" + CUDART_LINES)
    assert capfd.readouterr().err == "before\nE0000 a real error\n"


def run_without_platforms(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """A command as a user runs it: no JAX_PLATFORMS (the tests' own process may have one)."""
    if not any(importlib.util.find_spec(extra) for extra in ("libtpu", "jax_cuda12_plugin")):
        pytest.skip("the compile extras (tpu-compile, gpu-compile) are not installed: nothing to quiet")
    env = {name: value for name, value in os.environ.items() if name != "JAX_PLATFORMS"}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, cwd=cwd, env=env)


@pytest.mark.slow
def test_a_config_typo_is_one_line_whatever_the_extras(tmp_path):
    result = run_without_platforms("-c", DISPATCH, "train", "--config.train.learnin_rate=1", cwd=tmp_path)
    assert (result.returncode, result.stderr.splitlines()) == (
        1,
        ["config error: no field train.learnin_rate; did you mean train.learning_rate?"],
    )


def test_a_command_that_writes_a_gguf_file_prints_nothing_of_it(tmp_path):
    """gguf-py logs every file it writes at INFO (absl prints INFO): a command keeps it quiet."""
    script = (
        "import os, gguf\n"
        "from dflash_jax import cli\n"
        "def main(argv):\n"
        "    writer = gguf.GGUFWriter(os.environ['OUT'], 'llama')\n"
        "    writer.write_header_to_file(); writer.write_kv_data_to_file(); writer.write_tensors_to_file()\n"
        "    writer.close(); print('wrote')\n"
        "cli.run(main, lambda: None)\n"
    )
    env = dict(os.environ, OUT=str(tmp_path / "a.gguf"), JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=REPO)
    assert (result.returncode, result.stdout, result.stderr) == (0, "wrote\n", "")
    assert (tmp_path / "a.gguf").stat().st_size > 0


@pytest.mark.slow
def test_a_command_that_starts_jax_prints_no_start_up_noise(tmp_path):
    """train counts the devices (JAX's platforms start), then stops at its UTF-16 data file."""
    data = tmp_path / "train.jsonl"
    data.write_text('{"messages": []}\n', encoding="utf-16")
    args = ("train.py", f"--config.data.train={data}", f"--config.workdir={tmp_path / 'run'}")
    result = run_without_platforms(*args, cwd=REPO)
    noise = [line for line in result.stderr.splitlines() if any(m in line for m in NOISE_MARKERS)]
    assert (result.returncode, noise) == (1, []), result.stderr[-3000:]
    assert result.stderr.splitlines()[-1].startswith(f"error: {data}: the file is UTF-16")


@pytest.mark.parametrize("script", sorted((REPO / "bench").glob("*.py")), ids=lambda p: p.name)
def test_a_bench_script_imports_the_package_before_anything_that_loads_jax(script):
    """bench/ scripts run as `python bench/NAME.py`: the package's start-up quiets JAX only if
    `dflash_jax` is imported before any module that is not the standard library's."""
    tree = ast.parse(script.read_text())
    imported = [
        (node.module if isinstance(node, ast.ImportFrom) else node.names[0].name).partition(".")[0]
        for node in tree.body
        if isinstance(node, ast.Import | ast.ImportFrom) and getattr(node, "module", "") != "__future__"
    ]
    first = next((name for name in imported if name not in sys.stdlib_module_names), None)
    assert first in (None, "dflash_jax"), f"{script.name} imports {first} before dflash_jax"
