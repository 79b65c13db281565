"""A workdir whose checkpoints are damaged (issue 59): export, evaluate and resume use the newest
readable checkpoint, saying in one warning line which they passed over and why, and fail in one line
naming the directory when none reads. Export and evaluate leave a damaged checkpoint as it is; a
resumed run keeps it aside as `<step>.damaged` and redoes its steps exactly (slow tier: the same
batches, losses and weights as the run before the damage)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl import flags
from safetensors.numpy import load_file

from dflash_jax import evaluate, export
from dflash_jax.errors import UserError
from dflash_jax.models import kinds
from dflash_jax.models.drafter_config import DrafterConfig
from dflash_jax.models.families import target_config
from dflash_jax.models.formats.hf import read_config
from dflash_jax.training.checkpoint import RunCheckpoints, join_by
from dflash_jax.training.drafters import export_checkpoint, load_any_drafter, restore_params
from dflash_jax.training.mesh import make_mesh
from dflash_jax.training.optim.optimizer import OptimizerConfig, make_optimizer
from dflash_jax.training.step import init_train_state
from dflash_jax.training.workdir import Workdir
from support import training_runs as testing
from support.stderr import user_lines

TINY_TARGET = str(testing.REPO / "assets" / "tiny-qwen3")
STEPS = (2, 4, 6)


class _Iterator:
    """The data iterator's checkpointed state: where step `step` left it."""

    def __init__(self, step: int = 0):
        self.state = {"epoch": 0, "step": step}

    def get_state(self):
        return self.state

    def set_state(self, state):
        self.state = state


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> types.SimpleNamespace:
    """A workdir with checkpoints at STEPS, each with its own weights (the initial ones x step)."""
    workdir = tmp_path_factory.mktemp("saved")
    cfg = DrafterConfig.for_target(target_config(read_config(TINY_TARGET)), num_layers=1, mask_token_id=5, block_size=4)
    state = init_train_state(
        cfg, make_optimizer(OptimizerConfig(), 10), seed=0, compute_dtype=jnp.float32, mesh=make_mesh(-1, 1)
    )
    meta = {"drafter_config": cfg.to_hf(), "config": {"target": {"path": TINY_TARGET}}, "best_tau": None}
    states = {step: state.replace(params=jax.tree.map(lambda p, s=step: p * s, state.params)) for step in STEPS}
    checkpoints = RunCheckpoints(str(workdir / "checkpoints"), every_steps=1, keep=None, async_save=False)
    for step in STEPS:
        checkpoints.save(step, states[step], meta, _Iterator(step), force=True)
    checkpoints.wait()
    checkpoints.close()
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    return types.SimpleNamespace(workdir=workdir, states=states, abstract=abstract)


@pytest.fixture
def workdir(saved, tmp_path) -> Path:
    return Path(shutil.copytree(saved.workdir, tmp_path / "run"))


def largest_file(directory: Path) -> Path:
    return max((p for p in directory.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def cut(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def emptied(step_dir: Path) -> None:
    for entry in step_dir.iterdir():
        shutil.rmtree(entry) if entry.is_dir() else entry.unlink()


# How each damage shows (what the warning says of it), as a reader of the step finds it.
DAMAGES = {
    "array_data_cut": (lambda d: cut(largest_file(d / "state")), "reading it failed (ValueError: OUT_OF_RANGE: Error"),
    "array_index_cut": (lambda d: cut(d / "state" / "manifest.ocdbt"), "reading it failed (ValueError: DATA_LOSS: "),
    "state_missing": (lambda d: shutil.rmtree(d / "state"), "its state item is missing"),
    "empty_directory": (emptied, "an empty directory"),
    "unfinished_save": (lambda d: (d / "commit_success.txt").unlink(), "its save did not finish"),
    "step_metadata_garbled": (lambda d: (d / "_CHECKPOINT_METADATA").write_text("{"), "_CHECKPOINT_METADATA is not"),
    "run_metadata_garbled": (lambda d: (d / "meta" / "metadata").write_bytes(b"\xff\0"), "meta/metadata is not JSON"),
    "iterator_garbled": (lambda d: (d / "data" / "data_iterator.json").write_text("[1,"), "data/data_iterator.json"),
    "state_tree_garbled": (lambda d: (d / "state" / "_METADATA").write_text(""), "state/_METADATA is not JSON"),
}


def damage(workdir: Path, step: int, how: str) -> str:
    DAMAGES[how][0](workdir / "checkpoints" / str(step))
    return DAMAGES[how][1]


def fingerprint(directory: Path) -> dict[str, str]:
    """Every file under `directory` by its contents' hash: what is on disk, to compare."""
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def params_of(workdir: Path, step: int | None = None):
    return jax.device_get(restore_params(Workdir.at(str(workdir)), step)[1])


def assert_same(a, b) -> None:
    jax.tree.map(np.testing.assert_array_equal, a, b)


@pytest.fixture(scope="module")
def step_4_params(saved):
    return params_of(saved.workdir, 4)


@pytest.mark.parametrize("how", DAMAGES)
def test_the_newest_readable_checkpoint_is_used_with_one_warning(workdir, step_4_params, caplog, how):
    reason = damage(workdir, 6, how)
    on_disk = fingerprint(workdir)
    with caplog.at_level(logging.WARNING):
        assert_same(params_of(workdir), step_4_params)
    checkpoints = workdir / "checkpoints"
    [line] = warnings(caplog)
    assert line.startswith(f"the checkpoint of step 6 in {checkpoints} is damaged ({reason}"), line
    assert line.endswith("); using step 4, the newest readable one"), line
    assert fingerprint(workdir) == on_disk  # the damaged checkpoint is left as it is


def test_no_readable_checkpoint_is_one_line_naming_the_directory(workdir):
    for step, how in zip(STEPS, ("state_missing", "empty_directory", "array_data_cut")):
        damage(workdir, step, how)
    with pytest.raises(UserError) as raised:
        restore_params(Workdir.at(str(workdir)))
    checkpoints = workdir / "checkpoints"
    message = str(raised.value)
    assert message.startswith(
        f"no readable checkpoint: the checkpoints of steps 6, 4, 2 in {checkpoints} are damaged "
        "(step 6: reading it failed (ValueError: OUT_OF_RANGE: Error reading "
    ), message
    assert "; step 4: an empty directory; step 2: its state item is missing); start afresh in a new workdir" in message
    assert "\n" not in message


def test_a_damaged_step_asked_for_is_one_line_and_not_replaced(workdir):
    damage(workdir, 4, "run_metadata_garbled")
    with pytest.raises(UserError) as raised:
        restore_params(Workdir.at(str(workdir)), 4)
    assert str(raised.value) == (
        f"the checkpoint of step 4 in {workdir / 'checkpoints'} is damaged (meta/metadata is not JSON)"
    )


def test_export_uses_the_newest_readable_checkpoint(workdir, tmp_path, caplog, capsys):
    reference = export_checkpoint(Workdir.at(str(workdir)), step=4, out_dir=str(tmp_path / "step4"))
    damage(workdir, 6, "array_data_cut")
    with caplog.at_level(logging.WARNING):
        run_cli(export, [f"--workdir={workdir}", f"--output={tmp_path / 'exported'}"])
    served = kinds.get(DrafterConfig().kind).served_by()  # the fixture's kind
    assert capsys.readouterr().out == f"exported drafter to {tmp_path / 'exported'} ({served})\n"
    assert len(warnings(caplog)) == 1
    want, got = load_file(Path(reference) / "model.safetensors"), load_file(tmp_path / "exported" / "model.safetensors")
    assert want.keys() == got.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_export_refuses_to_replace_a_directory_that_is_no_drafter_export(workdir, tmp_path, capsys):
    """An export replaces its directory whole: a model's directory given as --output is left as
    it was, with one line; a previous export, or an empty directory, is replaced."""
    model = Path(shutil.copytree(TINY_TARGET, tmp_path / "a_model"))
    before = fingerprint(model)
    with pytest.raises(UserError) as raised:
        run_cli(export, [f"--workdir={workdir}", f"--output={model}"])
    assert str(raised.value).startswith(f"--output={model} holds README.md, config.json, ")
    assert str(raised.value).endswith(
        "and is no drafter export, which an export would replace whole: name a new or empty directory"
    )
    assert fingerprint(model) == before
    (tmp_path / "empty").mkdir()
    for out in (tmp_path / "empty", tmp_path / "empty"):  # the second time over the first's export
        run_cli(export, [f"--workdir={workdir}", f"--output={out}"])
        assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert capsys.readouterr().out.count("exported drafter to") == 2


def test_evaluate_reads_its_target_and_drafter_from_readable_checkpoints_warning_once(workdir, caplog):
    """evaluate reads the run's metadata (the target, the drafter's config) and then its weights:
    a damage found by either is said once."""
    damage(workdir, 6, "run_metadata_garbled")
    with caplog.at_level(logging.WARNING):
        assert evaluate._target(None, str(workdir), None) == TINY_TARGET
        load_any_drafter(str(workdir))
    [line] = warnings(caplog)
    assert "step 6" in line and line.endswith("using step 4, the newest readable one")


def test_resume_keeps_the_damaged_step_aside_and_saves_it_again(workdir, saved, caplog):
    damage(workdir, 6, "array_data_cut")
    checkpoints_dir = workdir / "checkpoints"
    damaged = fingerprint(checkpoints_dir / "6")
    checkpoints = RunCheckpoints(str(checkpoints_dir), every_steps=1, keep=None, async_save=False)
    iterator = _Iterator()
    with caplog.at_level(logging.WARNING):
        step, state, meta = checkpoints.resume(saved.abstract, iterator, check_meta=lambda meta: None)
    assert step == 4 and iterator.state == {"epoch": 0, "step": 4} and meta["best_tau"] is None
    assert_same(jax.device_get(state), jax.device_get(saved.states[4]))
    [line] = warnings(caplog)
    assert line.endswith(f"; resuming from step 4, the newest readable one; kept aside as {checkpoints_dir}/6.damaged")
    # Kept, out of Orbax's sight: the run saves step 6 again beside it.
    assert sorted(os.listdir(checkpoints_dir)) == ["2", "4", "6.damaged"]
    assert fingerprint(checkpoints_dir / "6.damaged") == damaged
    checkpoints.save(6, saved.states[6], meta, iterator, force=True)
    checkpoints.wait()
    checkpoints.close()
    assert sorted(os.listdir(checkpoints_dir)) == ["2", "4", "6", "6.damaged"]
    assert_same(params_of(workdir), params_of(saved.workdir, 6))


def test_export_leaves_a_running_save_alone_and_a_run_removes_its_unfinished_saves_at_once(workdir):
    """Reading a workdir (export, evaluate) while a run saves in it leaves the run's save in
    progress where it is, also after any thread the reading started has ended; a run starting in
    the workdir removes what a save that never finished left, before its constructor returns (a
    thread doing it could outlive a command that stops at once, and print a traceback)."""
    checkpoints_dir = workdir / "checkpoints"
    unfinished = checkpoints_dir / "8.orbax-checkpoint-tmp-1796654328"
    (unfinished / "state").mkdir(parents=True)
    before = set(threading.enumerate())
    export_checkpoint(Workdir(str(workdir)), out_dir=str(workdir / "exported"))
    deadline = time.monotonic() + 10
    for thread in set(threading.enumerate()) - before:
        join_by(thread, deadline)
    assert sorted(os.listdir(checkpoints_dir)) == ["2", "4", "6", unfinished.name]
    checkpoints = RunCheckpoints(str(checkpoints_dir), every_steps=1, keep=None, async_save=False)
    assert sorted(os.listdir(checkpoints_dir)) == ["2", "4", "6"]
    assert checkpoints.latest_step() == 6
    checkpoints.close()


def test_a_checkpoint_the_config_does_not_fit_is_not_called_damaged(workdir):
    checkpoints = RunCheckpoints(str(workdir / "checkpoints"), every_steps=1, keep=None, async_save=False)

    def refuse(meta):
        raise UserError("trained with another optimizer")

    with pytest.raises(UserError, match="^trained with another optimizer$"):
        checkpoints.resume(None, _Iterator(), check_meta=refuse)
    checkpoints.close()
    assert sorted(os.listdir(workdir / "checkpoints")) == ["2", "4", "6"]


def test_weights_of_another_drafter_than_the_config_says_are_one_line_not_damage(tmp_path):
    """A sound checkpoint whose weights are not those of the drafter its saved config describes (a
    DFlash2 drafter's under a DFlash config.json, as an older version could write): export and
    resume say so in one line, pass over no step and set none aside."""
    target = target_config(read_config(TINY_TARGET))
    cfgs = {
        kind: DrafterConfig.for_target(target, num_layers=1, mask_token_id=5, block_size=4, kind=kind)
        for kind in ("dflash", "dflash2")
    }
    state = init_train_state(
        cfgs["dflash2"], make_optimizer(OptimizerConfig(), 10), seed=0, compute_dtype=jnp.float32, mesh=make_mesh(-1, 1)
    )
    meta = {"drafter_config": cfgs["dflash"].to_hf(), "config": {"target": {"path": TINY_TARGET}}, "best_tau": None}
    checkpoints = RunCheckpoints(str(tmp_path / "checkpoints"), every_steps=1, keep=None, async_save=False)
    for step in (2, 4):
        checkpoints.save(step, state, meta, _Iterator(step), force=True)
    checkpoints.wait()
    expected = r"^the checkpoint of step 4 in .* holds other weights than the drafter its config describes \(it has params\.candidate_selector, params\.layers\.0\.attention_conv, .*\): written by another version of dflash_jax\?"
    with pytest.raises(UserError, match=expected):
        restore_params(Workdir(str(tmp_path)))
    dflash = init_train_state(
        cfgs["dflash"], make_optimizer(OptimizerConfig(), 10), seed=0, compute_dtype=jnp.float32, mesh=make_mesh(-1, 1)
    )
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), dflash)
    with pytest.raises(UserError, match=expected):
        checkpoints.resume(abstract, _Iterator(), check_meta=lambda meta: None)
    checkpoints.close()
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["2", "4"]


def run_cli(module, args: list[str]) -> None:
    """The CLI's main on its own FlagValues, as `python -m` would run it (without a process)."""
    flag_values = flags.FlagValues()
    module.define_flags(flag_values)
    flag_values(["prog", *args])
    module.main([], flag_values)


# The slow tier: a real run, damaged, resumed and exported by the commands.
EPOCH_STEPS = 12


def train_metrics(workdir: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if r["kind"] == "train"}


def command(args: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=testing.REPO, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow
def test_a_run_resumes_exactly_from_before_its_damaged_checkpoint(tiny_run, compilation_cache, tmp_path):
    env = testing.subprocess_env(compilation_cache)
    workdir = tmp_path / "run"
    fields = testing.overrides(tiny_run, workdir, **{"train.num_epochs": 1, "checkpoint.every_steps": 4})
    proc = testing.start_training(fields, env, tmp_path / "first.log")
    assert testing.finish(proc, tmp_path / "first.log") and proc.returncode == 0
    checkpoints = workdir / "checkpoints"
    assert sorted(os.listdir(checkpoints)) == ["12", "4", "8"]
    first_metrics, first_export = train_metrics(workdir), load_file(workdir / "export" / "model.safetensors")

    # The final checkpoint damaged: export uses step 8, with one warning line.
    damage(workdir, 12, "array_data_cut")
    exported = command(["dflash_jax.export", f"--workdir={workdir}", f"--output={tmp_path / 'exported'}"], env)
    assert exported.returncode == 0, exported.stderr[-3000:]
    lines = user_lines(exported.stderr)
    assert len(lines) == 1, "\n".join(lines)
    [line] = lines
    assert f"the checkpoint of step 12 in {checkpoints} is damaged (reading it failed (" in line
    assert line.endswith("using step 8, the newest readable one")
    assert sorted(os.listdir(checkpoints)) == ["12", "4", "8"]

    # Rerun: resumes from step 8 (the damaged step kept aside) and redoes 9-12 as the first run did.
    proc = testing.start_training(fields, env, tmp_path / "again.log")
    output = testing.finish(proc, tmp_path / "again.log")
    assert proc.returncode == 0, output[-3000:]
    assert "Traceback" not in output
    [line] = [line for line in output.splitlines() if "is damaged" in line]
    assert line.endswith(f"resuming from step 8, the newest readable one; kept aside as {checkpoints}/12.damaged")
    assert sorted(os.listdir(checkpoints)) == ["12", "12.damaged", "4", "8"]
    again = train_metrics(workdir)
    assert sorted(again) == list(range(1, EPOCH_STEPS + 1))
    for step in range(9, EPOCH_STEPS + 1):
        for key in ("loss", "tau_train", "grad_norm", "learning_rate"):
            assert again[step][key] == first_metrics[step][key], (step, key)
    second_export = load_file(workdir / "export" / "model.safetensors")
    for name in first_export:
        np.testing.assert_array_equal(second_export[name], first_export[name], err_msg=name)

    # No checkpoint readable: training, export and evaluate each stop in one line naming the workdir.
    for step, how in ((12, "state_missing"), (8, "empty_directory"), (4, "run_metadata_garbled")):
        damage(workdir, step, how)
    expected = f"no readable checkpoint: the checkpoints of steps 12, 8, 4 in {checkpoints} are damaged ("
    proc = testing.start_training(fields, env, tmp_path / "none.log")
    output = testing.finish(proc, tmp_path / "none.log")
    assert proc.returncode == 1 and "Traceback" not in output
    assert output.strip().splitlines()[-1].startswith(f"error: {expected}"), output[-2000:]
    for args, prefix in (
        (["dflash_jax.export", f"--workdir={workdir}", f"--output={tmp_path / 'none'}"], "error: "),
        (
            ["dflash_jax.evaluate", f"--drafter={workdir}", f"--output={tmp_path / 'none'}"],
            f"error: --drafter={workdir}: ",
        ),
    ):
        result = command(args, env)
        assert result.returncode == 1
        lines = user_lines(result.stderr)
        assert len(lines) == 1, result.stderr[-3000:]
        assert lines[0].startswith(prefix + expected), lines[0]
    assert not (tmp_path / "none").exists()
