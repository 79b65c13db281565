"""A second training run cannot share a workdir with a live one; a dead run leaves no lock."""

from __future__ import annotations

import multiprocessing
import os

import pytest

from dflash_jax.training.workdir_lock import WorkdirBusyError, workdir_lock


def _hold_lock(workdir, ready, release):
    with workdir_lock(workdir):
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
            with workdir_lock(str(tmp_path)):
                pass
    finally:
        release.set()
        holder.join(30)
    with workdir_lock(str(tmp_path)):  # released on exit
        assert (tmp_path / ".train.lock").read_text() == str(os.getpid())


def test_killed_run_leaves_no_lock(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    ready, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold_lock, args=(str(tmp_path), ready, release))
    holder.start()
    assert ready.wait(60)
    holder.kill()
    holder.join(30)
    with workdir_lock(str(tmp_path)):
        pass
