"""Checkpoints of a run: train state, run metadata and the data iterator, saved together.

One Orbax step directory holds three items: `state` (the `TrainState` arrays: drafter weights,
optimizer state, step, RNG key, skip counters), `meta` (JSON: epoch, best acceptance so far,
the drafter's export config and the resolved run config) and `data` (the data iterator's
position). Orbax writes a step into a temporary directory and renames it only once complete,
so an interrupted or failed save never shows up as a step; `latest_step` only sees finished ones.

A save that fails (a full disk, a storage error) stops the run with one `CheckpointSaveError`
line saying what, where and how much space the checkpoint needs; the partial directory is
removed and the last good checkpoints stay (docs/design.md §7.3). Asynchronous saves are checked
after every step, so a failure is noticed as soon as it happens.

A second manager keeps the drafter weights with the best acceptance length (tau) measured
during training.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
from typing import Any

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as save_policies

from dflash_jax.data.pipeline import DataIterator, DataIteratorRestore, DataIteratorSave
from dflash_jax.errors import UserError
from dflash_jax.training.step import TrainState

# How long a failed save waits for its other writers before removing the partial checkpoint.
_WRITER_GRACE_S = 10.0


def join_by(thread: threading.Thread, deadline: float) -> None:
    """Waits for `thread` to end, until `deadline` (time.monotonic()). threading lists a thread
    from its start() on, before it runs, and joining it then raises: wait for it to run too."""
    while time.monotonic() < deadline:
        try:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
            return
        except RuntimeError:  # "cannot join thread before it is started"
            time.sleep(0.01)


def _size(num_bytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.2f} {unit}"
    return f"{num_bytes / 2**10:.1f} KiB"


class CheckpointSaveError(UserError):
    """A checkpoint could not be written; the run stops, its last good checkpoints stay."""

    label = "training stopped"


def optimizer_of(meta: dict[str, Any]) -> str:
    """The optimizer whose state a checkpoint holds, from its metadata (its config's
    `train.optimizer`); checkpoints from before the option hold AdamW's."""
    return meta.get("config", {}).get("train", {}).get("optimizer", "adamw")


def ema_decay_of(meta: dict[str, Any]) -> float:
    """The weight-average decay of a checkpoint's optimizer state (0: none), as `optimizer_of`."""
    return float(meta.get("config", {}).get("train", {}).get("ema_decay", 0.0))


class RunCheckpoints:
    """The train-state checkpoints in `directory` (a workdir's `checkpoints/`)."""

    def __init__(self, directory: str, *, every_steps: int, keep: int | None, async_save: bool):
        self.directory = directory
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                # Exactly every N steps (Orbax's default would also save the first step); the
                # loop forces the final and the on-signal saves.
                save_decision_policy=save_policies.FixedIntervalPolicy(every_steps),
                max_to_keep=keep,
                enable_async_checkpointing=async_save,
                cleanup_tmp_directories=True,  # leftovers of saves that never finished
            ),
        )
        self._saving: tuple[int, int] | None = None  # (step, bytes) of the latest save started
        self._threads_before_save: set[threading.Thread] = set()

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(
        self,
        step: int,
        state: TrainState,
        meta: dict[str, Any],
        iterator: DataIterator,
        *,
        force: bool = False,
    ) -> bool:
        """Saves if `step` is on the save interval (or `force`); returns whether it did.

        Raises CheckpointSaveError if this save, or an earlier asynchronous one, failed.
        """
        if not force and not self.manager.should_save(step):
            return False
        # Orbax lets the previous asynchronous save finish first anyway; waiting here blames its
        # failure on its own step and its own writer threads, not on this save's.
        self.wait()
        self._saving = (step, sum(x.nbytes for x in jax.tree.leaves(state)))
        self._threads_before_save = set(threading.enumerate())
        with self._reporting_failures():
            return self.manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(state),
                    meta=ocp.args.JsonSave(meta),
                    data=DataIteratorSave(iterator),
                ),
                force=force,
            )

    def check_for_errors(self) -> None:
        """Raises CheckpointSaveError if an asynchronous save has failed (cheap: call every step)."""
        with self._reporting_failures():
            self.manager.check_for_errors()

    def restore(
        self, step: int, abstract_state: TrainState, iterator: DataIterator
    ) -> tuple[TrainState, dict[str, Any]]:
        """Restores onto `abstract_state`'s shardings; repositions `iterator` in place."""
        restored = self.manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state),
                meta=ocp.args.JsonRestore(),
                data=DataIteratorRestore(iterator),
            ),
        )
        return restored.state, restored.meta

    def restore_state(self, step: int, abstract_state: TrainState) -> TrainState:
        """The train state alone (export needs neither data nor metadata)."""
        restored = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state)))
        return restored.state

    def restore_meta(self, step: int) -> dict[str, Any]:
        return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta

    def wait(self) -> None:
        """Blocks until pending asynchronous saves are on disk; raises CheckpointSaveError if one
        failed."""
        with self._reporting_failures():
            self.manager.wait_until_finished()

    @contextlib.contextmanager
    def _reporting_failures(self):
        try:
            yield
        except CheckpointSaveError:
            raise
        except Exception as e:  # Orbax and the storage below it raise many kinds of errors
            raise self._save_failed(e) from e

    def _save_failed(self, error: Exception) -> CheckpointSaveError:
        step, needed = self._saving or (None, 0)
        # The failed save's other writers run on in the threads Orbax started for it: let them end
        # before removing what they wrote (and before the interpreter exits under them, with
        # tracebacks). Idle pool workers never end, hence one deadline for them all.
        deadline = time.monotonic() + _WRITER_GRACE_S
        for thread in set(threading.enumerate()) - self._threads_before_save:
            if thread is not threading.current_thread() and not thread.daemon:
                join_by(thread, deadline)
        for name in os.listdir(self.directory) if os.path.isdir(self.directory) else ():
            if step is not None and name.startswith(f"{step}.orbax-checkpoint-tmp"):
                shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)  # the partial save
        free = shutil.disk_usage(self.directory).free if os.path.isdir(self.directory) else 0
        kept = self.manager.all_steps(read=True)
        kept_text = f"the last good checkpoint is step {max(kept)}" if kept else "no checkpoint was saved before"
        return CheckpointSaveError(
            f"saving the checkpoint of step {step} to {self.directory} failed "
            f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else 'no detail'}); "
            f"a checkpoint needs about {_size(needed)}, {_size(free)} are free there; "
            f"{kept_text}: free some space (or change checkpoint.keep) and rerun the same command to resume"
        )

    def close(self) -> None:
        self.manager.close()


class BestCheckpoint:
    """The drafter weights of the best acceptance length (tau) seen so far."""

    def __init__(self, directory: str, *, resumed_step: int | None = None):
        self.manager = ocp.CheckpointManager(
            directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=1, enable_async_checkpointing=False),
        )
        # A resumed run redoes the steps after its checkpoint: a best kept from those steps
        # belongs to the lost future (the rerun measures it again, bitwise the same).
        for step in self.manager.all_steps():
            if resumed_step is not None and step > resumed_step:
                self.manager.delete(step)

    def save(self, step: int, params, tau: float) -> None:
        if step in self.manager.all_steps():
            self.manager.delete(step)
        self.manager.save(
            step,
            args=ocp.args.Composite(params=ocp.args.StandardSave(params), meta=ocp.args.JsonSave({"tau": tau})),
            force=True,
        )

    def close(self) -> None:
        self.manager.close()
