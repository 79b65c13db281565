"""The training loop end to end (train.py in subprocesses): exact resume after a hard kill and
after SIGTERM, failed saves, non-finite stops, in-training acceptance and the export."""

from __future__ import annotations

import collections
import functools
import json
import logging
import os
import re
import signal
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
from safetensors.numpy import load_file, save_file

from dflash_jax.data.pipeline import DataPipeline
from dflash_jax.decoding.draft_vocab import draft_token_ids
from dflash_jax.errors import UserError
from dflash_jax.models import kinds as drafter_kinds
from dflash_jax.models.drafter_config import DrafterConfig
from dflash_jax.models.formats.hf import load_drafter
from dflash_jax.training.checkpoint import (
    BestCheckpoint,
    CheckpointSaveError,
    RunCheckpoints,
    changed_settings,
    join_by,
    optimizer_of,
)
from dflash_jax.training.drafters import restore_params
from dflash_jax.training.workdir import Workdir
from support import training_runs as testing
from support.decoding_models import MASK_ID, make_target

EPOCHS = 4  # 12 steps each: long enough to interrupt a run reliably
TOTAL_STEPS = 4 * 12


def run_fields(tiny_run, workdir, **fields):
    return testing.overrides(tiny_run, workdir, **{"train.num_epochs": EPOCHS, **fields})


def train_metrics(workdir: Path) -> dict[int, dict]:
    """Per step, the logged train metrics; each step appears once, even after resumes."""
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if r["kind"] == "train"]
    assert len(steps) == len(set(steps)), f"steps logged twice: {sorted(steps)}"
    return {r["step"]: r for r in rows if r["kind"] == "train"}


def logged_steps(workdir: Path) -> int:
    path = workdir / "metrics.jsonl"
    return max(train_metrics(workdir), default=0) if path.exists() else 0


def latest_checkpoint(workdir: Path) -> int | None:
    checkpoints = RunCheckpoints.reading_only(Workdir.at(str(workdir)).checkpoints)
    try:
        return checkpoints.latest_step()
    finally:
        checkpoints.close()


# The fields that train each drafter kind (docs/design.md §12): its name alone.
KINDS = {
    "dflash": {"drafter.kind": "dflash"},
    "dflash2": {},  # the default's
    "dspark": {"drafter.kind": "dspark"},
    "xpress": {"drafter.kind": "xpress"},
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_resume_after_hard_kill_and_sigterm_is_exact(tiny_run, compilation_cache, tmp_path, kind):
    env = testing.subprocess_env(compilation_cache)
    run_kind = functools.partial(run_fields, **KINDS[kind])

    # Uninterrupted reference, which also measures acceptance with speculative decoding.
    reference = tmp_path / "reference"
    proc = testing.start_training(
        run_kind(
            tiny_run,
            reference,
            **{
                "eval.prompts": tiny_run.prompts,
                "eval.every_steps": 24,
                "eval.num_prompts": 2,
                "eval.max_new_tokens": 8,
            },
        ),
        env,
        tmp_path / "reference.log",
    )
    testing.finish(proc, tmp_path / "reference.log")
    assert proc.returncode == 0
    lines = [json.loads(line) for line in (reference / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in lines if e["kind"] == "eval"] == [24, TOTAL_STEPS]
    assert [(e["step"], e["epoch"]) for e in lines if e["kind"] == "epoch"] == [(0, 0), (12, 1), (24, 2), (36, 3)]
    assert (reference / "export_best" / "model.safetensors").is_file()
    assert "tau" in train_metrics(reference)[24]

    # Same run, hard-killed right after its checkpoint at step 8 ...
    interrupted = tmp_path / "interrupted"
    fields = run_kind(tiny_run, interrupted)
    proc = testing.start_training(fields, env, tmp_path / "run1.log")
    testing.wait_for(lambda: (interrupted / "checkpoints" / "8").is_dir(), proc, tmp_path / "run1.log")
    testing.kill(proc)
    assert proc.returncode == -signal.SIGKILL
    assert not (interrupted / "export").exists(), "the run finished before it could be killed"

    # ... resumed, then stopped by SIGTERM, which must leave a checkpoint at the stopping step ...
    proc = testing.start_training(fields, env, tmp_path / "run2.log")
    testing.wait_for(lambda: logged_steps(interrupted) >= 20, proc, tmp_path / "run2.log")
    os.killpg(proc.pid, signal.SIGTERM)
    output = testing.finish(proc, tmp_path / "run2.log")
    assert proc.returncode == 75, output[-3000:]  # stopped on request after saving: rerun to resume
    stopped_at = int(output.split("stopping at step ")[1].split()[0])
    assert output.strip().splitlines()[-1] == (
        f"stopped at step {stopped_at} of {TOTAL_STEPS} after saving a checkpoint; run the same command again to resume"
    )
    assert 20 <= stopped_at < TOTAL_STEPS
    assert latest_checkpoint(interrupted) == stopped_at
    assert not (interrupted / "export").exists()

    # ... and resumed to the end: same batches, same losses, bitwise the same weights.
    proc = testing.start_training(fields, env, tmp_path / "run3.log")
    testing.finish(proc, tmp_path / "run3.log")
    assert proc.returncode == 0
    want, got = train_metrics(reference), train_metrics(interrupted)
    assert sorted(got) == sorted(want) == list(range(1, TOTAL_STEPS + 1))
    for step in want:
        for key in ("loss", "tau_train", "grad_norm", "fill", "learning_rate"):
            assert got[step][key] == want[step][key], (step, key)
    _, final = restore_params(Workdir.at(str(interrupted)))
    _, reference_final = restore_params(Workdir.at(str(reference)))
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(final), jax.device_get(reference_final))

    # The export at the end is what `python -m dflash_jax.export` writes from the checkpoint.
    out = tmp_path / "exported"
    subprocess.run(
        [sys.executable, "-m", "dflash_jax.export", f"--workdir={reference}", f"--output={out}"],
        env=env,
        check=True,
        capture_output=True,
        timeout=120,
    )
    exported, trained = load_file(out / "model.safetensors"), load_file(reference / "export" / "model.safetensors")
    assert exported.keys() == trained.keys() and "fc.weight" in exported
    for name in exported:
        np.testing.assert_array_equal(exported[name], trained[name], err_msg=name)
    assert (out / "token_frequencies.json").read_text() == (reference / "token_frequencies.json").read_text()
    exported_drafter = load_drafter(reference / "export")
    assert (exported_drafter.cfg.mask_token_id, exported_drafter.cfg.kind) == (testing.MASK_TOKEN_ID, kind)

    # Rerunning a finished run says so; raising its epochs trains on and exports again.
    eval_fields = {
        "eval.prompts": tiny_run.prompts,
        "eval.every_steps": 24,
        "eval.num_prompts": 2,
        "eval.max_new_tokens": 8,
    }
    proc = testing.start_training(run_kind(tiny_run, reference, **eval_fields), env, tmp_path / "again.log")
    assert "dflash_jax: this run had already finished" in testing.finish(proc, tmp_path / "again.log")
    extended = run_kind(tiny_run, reference, **{**eval_fields, "train.num_epochs": EPOCHS + 1})
    proc = testing.start_training(extended, env, tmp_path / "extended.log")
    output = testing.finish(proc, tmp_path / "extended.log")
    assert proc.returncode == 0 and "dflash_jax: training finished" in output, output[-3000:]
    # The summary says where the export is and which engines serve the kind.
    assert f"drafter export: {reference / 'export'} ({drafter_kinds.get(kind).served_by()})" in output
    assert Workdir.at(str(reference)).finished_step() == TOTAL_STEPS + 12
    assert sorted(train_metrics(reference)) == list(range(1, TOTAL_STEPS + 13))


@pytest.mark.slow
def test_non_finite_training_stops_with_a_message_and_finite_checkpoints(tiny_run, compilation_cache, tmp_path):
    target = tmp_path / "nan_target"
    target.mkdir()
    for f in Path(tiny_run.target).iterdir():
        (target / f.name).write_bytes(f.read_bytes())
    weights = load_file(target / "model.safetensors")
    weights["model.layers.0.input_layernorm.weight"][:] = np.nan
    save_file(weights, target / "model.safetensors", metadata={"format": "pt"})

    workdir = tmp_path / "run"
    fields = run_fields(
        tiny_run, workdir, **{"target.path": target, "train.max_nonfinite_streak": 3, "checkpoint.every_steps": 2}
    )
    proc = testing.start_training(fields, testing.subprocess_env(compilation_cache), tmp_path / "log")
    output = testing.finish(proc, tmp_path / "log")
    assert proc.returncode != 0
    assert (
        output.strip()
        .splitlines()[-1]
        .startswith("training stopped: 3 consecutive steps (up to step 3) had a non-finite loss or gradient")
    )
    assert latest_checkpoint(workdir) == 2
    _, params = restore_params(Workdir.at(str(workdir)))
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(jax.device_get(params)))

    # Resuming it with the other optimizer: one line, before any step.
    checkpoints = RunCheckpoints.reading_only(Workdir.at(str(workdir)).checkpoints)
    saved = optimizer_of(checkpoints.restore_meta(2))
    checkpoints.close()
    other = {"adamw": "muon", "muon": "adamw"}[saved]
    proc = testing.start_training(
        {**fields, "train.optimizer": other}, testing.subprocess_env(compilation_cache), tmp_path / "log2"
    )
    output = testing.finish(proc, tmp_path / "log2")
    assert proc.returncode == 1
    assert (
        output.strip()
        .splitlines()[-1]
        .endswith(
            f"was trained with train.optimizer={saved}; resuming needs the same optimizer "
            f"(this config: {other}), or a new workdir"
        )
    ), output[-2000:]
    assert latest_checkpoint(workdir) == 2


@pytest.mark.slow
def test_failed_save_stops_the_run_at_once_and_keeps_the_last_good_checkpoint(tiny_run, compilation_cache, tmp_path):
    workdir = tmp_path / "run"
    fields = run_fields(tiny_run, workdir, **{"checkpoint.every_steps": 4})
    env = {**testing.subprocess_env(compilation_cache), "FAIL_SAVE_AT_STEP": "8"}
    log = tmp_path / "log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                str(testing.REPO / "tests" / "support" / "failing_save.py"),
                *[f"--config.{k}={v}" for k, v in fields.items()],
            ],
            cwd=testing.REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    output = testing.finish(proc, log)
    assert proc.returncode == 1, output[-3000:]
    assert "Traceback" not in output
    last = output.strip().splitlines()[-1]
    assert last.startswith(
        f"training stopped: saving the checkpoint of step 8 to {workdir / 'checkpoints'} failed "
        "(OSError: [Errno 28] No space left on device"
    ), last
    assert re.search(
        r"a checkpoint needs about [0-9.]+ [KMG]iB, [0-9.]+ [KMG]iB are free there; the last good "
        r"checkpoint is step 4: free some space",
        last,
    ), last
    assert sorted(os.listdir(workdir / "checkpoints")) == ["4"]  # the partial save is gone
    assert latest_checkpoint(workdir) == 4
    assert logged_steps(workdir) == 8  # stopped at the failed save, not steps later
    # The next run resumes from the last good checkpoint and finishes.
    proc = testing.start_training(fields, testing.subprocess_env(compilation_cache), tmp_path / "log2")
    testing.finish(proc, tmp_path / "log2")
    assert proc.returncode == 0
    assert sorted(train_metrics(workdir)) == list(range(1, TOTAL_STEPS + 1))


def test_best_checkpoint_of_a_redone_step_never_collides(tmp_path):
    params = {"w": jnp.arange(4.0)}
    best = BestCheckpoint(str(tmp_path))
    best.save(8, params, 1.5)
    best.save(8, params, 1.5)  # the same step again (a rerun evaluates it again): no error
    best.close()
    # A run resumed from step 4 redoes step 8: the best of the lost future goes, the rerun saves it.
    best = BestCheckpoint(str(tmp_path), resumed_step=4)
    assert best.manager.all_steps() == []
    best.save(8, params, 1.5)
    assert best.manager.all_steps() == [8]
    best.close()


class _Iterator:
    def get_state(self):
        return {"epoch": 0, "step": 1}


class _BrokenIterator:
    """A data iterator whose state cannot be read, so saving a checkpoint with it fails."""

    def get_state(self):
        raise OSError("disk full")


def test_failed_save_never_becomes_latest(tmp_path):
    checkpoints = RunCheckpoints(tmp_path, every_steps=1, keep=3, async_save=True)
    checkpoints.save(1, {"w": jnp.arange(4.0)}, {"epoch": 0}, _Iterator())
    checkpoints.wait()
    with pytest.raises(
        CheckpointSaveError, match=r"step 2 .* failed \(OSError: disk full\).* last good checkpoint is step 1"
    ):
        checkpoints.save(2, {"w": jnp.arange(4.0) + 1}, {"epoch": 0}, _BrokenIterator())
        checkpoints.wait()
    assert checkpoints.latest_step() == 1
    checkpoints.close()

    reopened = RunCheckpoints(tmp_path, every_steps=1, keep=3, async_save=True)
    assert reopened.manager.all_steps() == [1]
    restored = reopened.restore_state(1, {"w": jax.ShapeDtypeStruct((4,), jnp.float32)})
    np.testing.assert_array_equal(restored["w"], np.arange(4.0))
    reopened.close()


def test_a_failed_save_waits_for_a_writer_thread_that_has_not_run_yet():
    """Orbax may start a writer thread just as a save fails: threading lists it before it runs,
    and joining it then raised instead of waiting for it (seen once under a loaded machine)."""
    ran = threading.Event()
    writer = threading.Thread(target=lambda: (time.sleep(0.05), ran.set()))
    threading.Timer(0.05, writer.start).start()  # listed or not, it has not run when joined
    join_by(writer, time.monotonic() + 10.0)
    assert ran.is_set() and not writer.is_alive()


@pytest.mark.parametrize("layer_ids, warned", [((0, 3), True), ((0, 2), False)])
def test_warns_when_engines_cannot_serve_the_last_layer(layer_ids, warned, caplog):
    import dataclasses
    from types import SimpleNamespace

    from dflash_jax.training import loop
    from support.decoding_models import make_drafter, make_target

    drafter = dataclasses.replace(make_drafter(make_target()).cfg, num_target_layers=4, target_layer_ids=layer_ids)
    setup = SimpleNamespace(target=SimpleNamespace(num_layers=4), drafter=drafter)
    with caplog.at_level("WARNING", logger=loop.__name__):
        loop._warn_if_engines_cannot_serve(setup)
    assert ("llama.cpp, SGLang and vLLM" in caplog.text) == warned


def test_a_short_run_in_process_trains_exports_and_knows_it_finished(tiny_run, tmp_path, caplog):
    """The loop without a subprocess (the fast tier's run of it): every step logged once, the
    drafter exported, and a second call finds the run finished and trains nothing."""
    from dflash_jax.training.config.presets import load_config_file
    from dflash_jax.training.config.run_config import resolve
    from dflash_jax.training.loop import train

    config = load_config_file(str(testing.REPO / "configs" / "default.py"))
    workdir = tmp_path / "run"
    fields = {"train.max_steps": 3, "checkpoint.every_steps": 2, "data.heldout_rows": 2}
    config.update_from_flattened_dict(testing.overrides(tiny_run, workdir, **fields))
    outcome = train(resolve(config, num_devices=1))
    assert (outcome.finished, outcome.already_finished, outcome.step) == (True, False, 3)
    assert sorted(train_metrics(workdir)) == [1, 2, 3]
    assert json.loads((workdir / "export" / "config.json").read_text())["architectures"] == ["DFlash2DraftModel"]
    # The trained-on tokens by count, held-out prompts left out, in the workdir and the export.
    setup = resolve(config, num_devices=1)
    data = DataPipeline.from_config(setup.data, setup.target_path)
    assert len(data.heldout) == 2
    want = collections.Counter()
    for i in data.train_samples:
        tokens, mask = data.cache.sample(i)
        want.update(tokens[mask == 1].tolist())
    frequencies = json.loads((workdir / "token_frequencies.json").read_text())
    assert dict(zip(frequencies["token_ids"], frequencies["counts"])) == want
    assert frequencies["counts"] == sorted(frequencies["counts"], reverse=True)
    assert (workdir / "export" / "token_frequencies.json").read_text() == (
        workdir / "token_frequencies.json"
    ).read_text()
    np.testing.assert_array_equal(draft_token_ids(str(workdir / "export"), 5), frequencies["token_ids"][:5])
    again = train(resolve(config, num_devices=1))
    assert (again.finished, again.already_finished, again.step) == (True, True, 3)
    # Rerun longer, with an edit: it resumes, and says what differs from the checkpoint's settings.
    config.update_from_flattened_dict({"train.max_steps": 4, "train.grad_clip_norm": 0.5})
    with caplog.at_level(logging.WARNING, logger="dflash_jax.training.loop"):
        longer = train(resolve(config, num_devices=1))
    assert (longer.finished, longer.already_finished, longer.step) == (True, False, 4)
    assert (
        "resuming with settings other than the checkpoint's: train.grad_clip_norm: 1.0 -> 0.5; train.max_steps: 3 -> 4"
        in caplog.text
    )
    # Another drafter cannot take its weights: one line naming what differs, the checkpoints kept.
    config.update_from_flattened_dict({"train.max_steps": 5, "drafter.conv_kernel_size": 3})
    with pytest.raises(UserError, match=r"holds another drafter \(drafter.conv_kernel_size: 2 -> 3\); resuming needs"):
        train(resolve(config, num_devices=1))
    assert latest_checkpoint(workdir) == 4


def test_resuming_needs_the_drafters_shape_not_its_training_only_fields():
    """An XPress checkpoint from before XPress's backbone became DFlash2's layers is refused in one
    line that names the field to set back; its loss weights, which no export carries, may change."""
    from dflash_jax.training.loop import _check_resumable

    target = make_target(seed=0).cfg
    sizes = dict(num_layers=1, mask_token_id=MASK_ID, block_size=4, target_layer_ids=(0, 1), kind="xpress")
    saved = DrafterConfig.for_target(target, **sizes, xpress_backbone="dflash")
    meta = {"drafter_config": saved.to_hf(), "config": {"train": {"optimizer": "muon"}}}

    def setup(**fields):
        drafter = DrafterConfig.for_target(target, **sizes, **fields)
        return types.SimpleNamespace(
            drafter=drafter, workdir=Workdir.at("/run"), optimizer=types.SimpleNamespace(optimizer="muon")
        )

    _check_resumable(meta, setup(xpress_backbone="dflash", xpress_backbone_weight=0.5, xpress_consistency_passes=1))
    with pytest.raises(
        UserError, match=r"^/run/checkpoints holds another drafter \(drafter.xpress_backbone: 'dflash' -> 'dflash2'\)"
    ):
        _check_resumable(meta, setup())


def test_changed_settings_names_each_difference_and_the_fields_a_checkpoint_lacks():
    saved = {"config": {"train": {"learning_rate": 0.001, "optimizer": "muon"}, "drafter": {"kind": "xpress"}}}
    now = {
        "train": {"learning_rate": 0.002, "optimizer": "muon"},
        "drafter": {"kind": "xpress", "xpress_backbone_weight": 1.0},
    }
    assert changed_settings(saved, saved["config"]) == ""
    assert changed_settings(saved, now) == (
        "drafter.xpress_backbone_weight: not in the saved config -> 1.0; train.learning_rate: 0.001 -> 0.002"
    )
    assert (
        changed_settings(saved, now, most=1)
        == "drafter.xpress_backbone_weight: not in the saved config -> 1.0 (and 1 more)"
    )
