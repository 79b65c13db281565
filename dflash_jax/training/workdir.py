"""The workdir of a training run: every path of the run, whether it finished, and its lock.

    <workdir>/
      checkpoints/        Orbax steps: train state, run metadata, data-iterator position
      best_checkpoint/    drafter weights with the best in-training acceptance length (tau)
      export/             the final drafter (docs/design.md §5), written when the run finishes
      export_best/        the best-tau drafter in the same format
      finished.json       {"step": N}: the run reached its last step N and exported
      token_frequencies.json  the trained-on tokens by count (decoding/draft_vocab.py), copied
                          into every export
      metrics.jsonl       one JSON line per log step, epoch start and evaluation
      tensorboard/        the same scalars for TensorBoard
      eval/               the closing evaluation (eval.json, eval.png)
      wandb_run_id        the Weights & Biases run this workdir logs to (log.wandb)
      .train.lock         held by the running training process (one run per workdir)

Nothing else in the package spells these names (docs/design.md §7.1).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import shutil
import uuid

import jax

from dflash_jax.decoding.draft_vocab import FREQUENCIES_FILE
from dflash_jax.errors import UserError


class WorkdirBusyError(UserError):
    """Another training process holds the workdir."""


def check_writable(path: str, name: str, *, directory: bool = True) -> None:
    """Refuses, in one line naming `name` (a flag or config field), a `directory` (else a file)
    at `path` that could not be written: `path` is a file (a directory), or lies under a file,
    or its nearest existing directory is not writable. Checked before any work; directories
    that do not exist yet are made when first written to (with their parents)."""
    full = os.path.abspath(os.path.expanduser(path))
    if os.path.isdir(full) and not directory:
        raise UserError(f"{name}={path}: a directory; name the file to write")
    if os.path.lexists(full) and not os.path.isdir(full) and directory:
        raise UserError(f"{name}={path}: a file, not a directory")
    existing = full if directory else os.path.dirname(full)
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise UserError(f"{name}={path}: {existing} is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"{name}={path}: {existing} is not writable")


def _entry(name: str) -> property:
    """A path inside the workdir, as a read-only attribute."""
    return property(lambda self: os.path.join(self.root, name))


@dataclasses.dataclass(frozen=True)
class Workdir:
    root: str  # absolute

    @classmethod
    def at(cls, path: str) -> Workdir:
        return cls(os.path.abspath(os.path.expanduser(path)))

    def _path(self, name: str) -> str:
        return os.path.join(self.root, name)

    checkpoints = _entry("checkpoints")
    best_checkpoint = _entry("best_checkpoint")
    export = _entry("export")
    export_best = _entry("export_best")
    token_frequencies = _entry(FREQUENCIES_FILE)
    metrics = _entry("metrics.jsonl")
    tensorboard = _entry("tensorboard")
    eval = _entry("eval")
    _finished_file = _entry("finished.json")

    def wandb_run_id(self) -> str:
        """A random id made once per workdir: a resumed run continues its own W&B run only."""
        path = self._path("wandb_run_id")
        if not os.path.isfile(path):
            with open(path + ".tmp", "w") as f:
                f.write(uuid.uuid4().hex[:16])
            os.replace(path + ".tmp", path)
        with open(path) as f:
            return f.read().strip()

    def has_checkpoints(self) -> bool:
        return os.path.isdir(self.checkpoints)

    def finished_step(self) -> int | None:
        """The last step of the run if it finished and exported its drafter, else None."""
        try:
            with open(self._finished_file) as f:
                step = int(json.load(f)["step"])
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            return None
        return step if os.path.isfile(os.path.join(self.export, "config.json")) else None

    def is_finished(self, total_steps: int) -> bool:
        """Whether the run has trained all `total_steps` and exported (a run whose config now asks
        for more steps, e.g. more epochs, is not finished)."""
        step = self.finished_step()
        return step is not None and step >= total_steps

    def mark_finished(self, step: int) -> None:
        """Called once the export of the last step is in place."""
        tmp = self._finished_file + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"step": step}, f)
        os.replace(tmp, self._finished_file)

    @contextlib.contextmanager
    def lock(self):
        """Holds an exclusive lock on `.train.lock` (process 0 only) while the run lasts.

        A second run in the same directory would interleave its checkpoints and metrics with the
        first one's. The OS releases the lock when the process dies, so a crashed run never
        blocks the next one. A run that fails before writing anything (bad data, a target that
        does not load) leaves no workdir behind if it created it.
        """
        if jax.process_index() != 0:
            yield
            return
        created = not os.path.exists(self.root)
        os.makedirs(self.root, exist_ok=True)
        with open(self._path(".train.lock"), "a+") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.seek(0)
                holder = handle.read().strip() or "unknown"
                raise WorkdirBusyError(
                    f"another training run (pid {holder}) is using {self.root}; wait for it, stop it, "
                    "or pass a different --config.workdir"
                ) from None
            handle.seek(0)
            handle.truncate()
            handle.write(str(os.getpid()))
            handle.flush()
            try:
                yield
            except BaseException:
                if created and self._holds_only_the_lock():
                    shutil.rmtree(self.root, ignore_errors=True)
                raise
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def _holds_only_the_lock(self) -> bool:
        """Nothing but the lock file and empty directories."""
        for _, _, files in os.walk(self.root):
            if any(name != ".train.lock" for name in files):
                return False
        return True


def existing_workdir(path: str, name: str) -> Workdir:
    """The training workdir at `path`, which holds checkpoints; else a one-line UserError."""
    workdir = Workdir.at(path)
    if not os.path.lexists(workdir.root):
        raise UserError(f"{name}={path}: no such directory")
    if not os.path.isdir(workdir.root):
        raise UserError(f"{name}={path}: a file, not a training workdir")
    if not workdir.has_checkpoints():
        raise UserError(f"{name}={path}: not a training workdir (no {workdir.checkpoints})")
    return workdir
