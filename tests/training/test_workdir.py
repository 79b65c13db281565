"""The workdir: a second training run cannot share it with a live one, a dead run leaves no lock,
and a run is finished only once it has exported its last step."""

from __future__ import annotations

import multiprocessing
import os

import pytest

from dflash_jax.training.workdir import Workdir, WorkdirBusyError


def _hold_lock(workdir, ready, release):
    with Workdir.at(workdir).lock():
        ready.set()
        release.wait(30)


def test_second_run_is_refused_and_lock_is_freed(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    ready, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold_lock, args=(str(tmp_path), ready, release))
    holder.start()
    try:
        assert ready.wait(60)
        with pytest.raises(WorkdirBusyError, match=rf"pid {holder.pid}\) is using"):
            with Workdir.at(str(tmp_path)).lock():
                pass
    finally:
        release.set()
        holder.join(30)
    with Workdir.at(str(tmp_path)).lock():  # released on exit
        assert (tmp_path / ".train.lock").read_text() == str(os.getpid())


def test_killed_run_leaves_no_lock(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    ready, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold_lock, args=(str(tmp_path), ready, release))
    holder.start()
    assert ready.wait(60)
    holder.kill()
    holder.join(30)
    with Workdir.at(str(tmp_path)).lock():
        pass


def test_finished_only_with_an_export_of_the_last_step(tmp_path):
    workdir = Workdir.at(str(tmp_path / "run"))
    assert workdir.finished_step() is None and not workdir.is_finished(10)
    os.makedirs(workdir.root)
    workdir.mark_finished(10)
    assert workdir.finished_step() is None  # no export: not finished
    os.makedirs(workdir.export)
    (tmp_path / "run" / "export" / "config.json").write_text("{}")
    assert workdir.finished_step() == 10
    assert workdir.is_finished(10)
    assert not workdir.is_finished(12)  # the config now asks for more steps (e.g. more epochs)
    assert workdir.root == str(tmp_path / "run") and workdir.export == str(tmp_path / "run" / "export")


def test_wandb_run_id_is_kept_per_workdir(tmp_path):
    (tmp_path / "a" / "run").mkdir(parents=True)
    (tmp_path / "b" / "run").mkdir(parents=True)
    first = Workdir.at(str(tmp_path / "a" / "run"))
    same_name = Workdir.at(str(tmp_path / "b" / "run"))
    resumed = Workdir.at(str(tmp_path / "a" / "run"))  # a resumed run opens its workdir anew
    assert resumed.wandb_run_id() == first.wandb_run_id()  # and continues its W&B run
    assert first.wandb_run_id() != same_name.wandb_run_id()  # another run of the same name does not
