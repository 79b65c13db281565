"""The package installs: one `dflash-jax` command, the bundled configs and assets inside the wheel,
and a non-editable install trains from any directory."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest

from dflash_jax import bundled, commands

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
# Bundled data directories shipped as packages of their own (setuptools wants every directory a
# package), besides configs/ and assets/ themselves.
DATA_PACKAGES = {"dflash_jax.configs", "dflash_jax.configs.targets", "dflash_jax.assets", "dflash_jax.assets.data"}


def tracked_files(*directories: str) -> list[str]:
    out = subprocess.run(["git", "ls-files", *directories], capture_output=True, text=True, cwd=REPO, check=True)
    return out.stdout.split()


def test_the_wheel_lists_every_subpackage():
    """pyproject.toml names its packages (configs/ and assets/ are mapped into the package, which
    package discovery cannot do): a new subpackage must be added there, or the wheel lacks it."""
    subpackages = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "dflash_jax").rglob("__init__.py")}
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    assert listed == subpackages | DATA_PACKAGES, (
        f"pyproject.toml's [tool.setuptools] packages: add {sorted(subpackages - listed)}, "
        f"remove {sorted(listed - subpackages - DATA_PACKAGES)}"
    )
    assert PYPROJECT["tool"]["setuptools"]["package-dir"] == {
        "dflash_jax.configs": "configs",
        "dflash_jax.assets": "assets",
    }
    assert PYPROJECT["project"]["scripts"] == {"dflash-jax": "dflash_jax.commands:main"}


def test_bundled_configs_are_found_by_name_from_any_directory(tmp_path, monkeypatch):
    assert bundled.DEFAULT_CONFIG == REPO / "configs" / "default.py"  # a checkout: beside the package
    assert bundled.ASSETS == REPO / "assets"
    monkeypatch.chdir(tmp_path)
    assert bundled.config_file("configs/qwen3.py") == str(REPO / "configs" / "qwen3.py")
    assert bundled.config_file("qwen3.py") == str(REPO / "configs" / "qwen3.py")
    assert bundled.config_file("elsewhere/qwen3.py") == "elsewhere/qwen3.py"  # another directory's: as given
    assert bundled.config_file("configs/nope.py") == "configs/nope.py"
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "qwen3.py").write_text("")
    assert bundled.config_file("configs/qwen3.py") == "configs/qwen3.py"  # a file here comes first
    assert bundled.shown(REPO / "configs" / "targets" / "Qwen3-8B.json") == "configs/targets/Qwen3-8B.json"
    assert bundled.shown("Qwen/Qwen3-8B") == "Qwen/Qwen3-8B"


def test_the_command_lists_its_subcommands_and_names_a_mistyped_one(capsys):
    with pytest.raises(SystemExit) as exit:
        commands.main(["dflash-jax", "--help"])
    assert exit.value.code == 0
    out = capsys.readouterr().out
    assert all(f"\n  {name} " in out for name in commands.COMMANDS), out
    with pytest.raises(SystemExit) as exit:
        commands.main(["dflash-jax", "trian"])
    assert exit.value.code == 1
    assert capsys.readouterr().err.splitlines()[0] == "error: unknown command 'trian'; did you mean train?"


@pytest.mark.slow
def test_a_wheel_installed_elsewhere_trains_two_steps_from_any_directory(tmp_path):
    """Build the wheel from the tracked files, install it (no dependencies) into a fresh virtual
    environment that borrows this one's libraries, and run `dflash-jax train` on the bundled
    default from a directory outside the repository."""
    source = tmp_path / "source"  # building writes build/ and *.egg-info beside the sources
    source.mkdir()
    files = tracked_files()
    subprocess.run(["tar", "-cf", str(tmp_path / "src.tar"), *files], cwd=REPO, check=True)
    subprocess.run(["tar", "-xf", str(tmp_path / "src.tar")], cwd=source, check=True)
    wheels = tmp_path / "wheels"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels), str(source)],
        check=True,
        timeout=600,
    )
    (wheel,) = wheels.glob("*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    for name in tracked_files("configs", "assets/data", "assets/tiny-qwen3"):
        assert f"dflash_jax/{name}" in shipped, name
    for name in tracked_files("dflash_jax/training/gpu_targets"):  # plan --hardware=h200 compiles with them
        assert name in shipped, name

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run([*pip, "--python", str(python), "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True)
    # The libraries (jax, flax, ...) from this environment, without installing them again: a path
    # line, so this environment's own .pth files (an editable dflash_jax) are not read.
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(site, "borrowed_libraries.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_backend_optimization_level=0")
    fields = {
        "workdir": "run",
        "train.max_steps": 2,
        "data.cache_dir": str(tmp_path / "cache"),
        "eval.num_prompts": 1,
        "eval.max_new_tokens": 8,
        "log.progress_bars": False,
    }
    result = subprocess.run(
        [str(venv / "bin" / "dflash-jax"), "train", *[f"--config.{k}={v}" for k, v in fields.items()]],
        capture_output=True,
        text=True,
        cwd=elsewhere,
        env=env,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "dflash_jax: training finished" in result.stdout
    assert (elsewhere / "run" / "export" / "model.safetensors").is_file()
    # It was the installed package, with the assets it carries, not this checkout's.
    where = subprocess.run(
        [str(python), "-c", "from dflash_jax import bundled; print(bundled.ASSETS)"],
        capture_output=True,
        text=True,
        cwd=elsewhere,
        env=env,
        check=True,
    ).stdout.strip()
    assert Path(where) == Path(site) / "dflash_jax" / "assets"
