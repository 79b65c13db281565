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

A checkpoint damaged after its save (a truncated or garbled file, a missing item, an emptied step
directory, metadata that is not JSON) is passed over: `newest_readable` reads the newest one that
reads, saying in one warning line which it passed over and why; none readable is one line naming
the directory. Damage is found cheaply before any restore: Orbax's marks (its `commit_success.txt`
of a finished save, its items, the JSON it writes) and the arrays' database (its index, and every
stored value's last byte); otherwise by the restore failing. Nothing is deleted: export and
evaluate leave a damaged checkpoint where it is (and the unfinished save of a run training in the
same workdir); a resumed run, which saves those steps again, keeps it beside them as
`<step>.damaged`, and removes what its own saves that never finished left. A byte changed inside
the arrays' data goes unnoticed (Orbax keeps no checksum of it).

A second manager keeps the drafter weights with the best acceptance length (tau) measured
during training.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import orbax.checkpoint as ocp
import tensorstore
from jax.experimental import multihost_utils
from orbax.checkpoint import checkpoint_managers as save_policies

from dflash_jax.data.pipeline import DataIterator, DataIteratorRestore, DataIteratorSave
from dflash_jax.errors import UserError
from dflash_jax.training.step import TrainState

log = logging.getLogger(__name__)

# How long a failed save waits for its other writers before removing the partial checkpoint.
_WRITER_GRACE_S = 10.0
# The items of every step (see above); `meta` and `data` are JSON files.
ITEMS, JSON_ITEMS = ("state", "meta", "data"), ("meta", "data")
# What Orbax writes in a step: the marker of a finished save, the step's metadata and the state's tree.
COMMITTED, STEP_METADATA, STATE_METADATA = "commit_success.txt", "_CHECKPOINT_METADATA", "state/_METADATA"
# A damaged step a resumed run keeps beside the steps it saves again (Orbax sees no step in the name).
DAMAGED_SUFFIX = ".damaged"
# Orbax's mark of a save in progress: it writes step N into `N<UNFINISHED>-<time>`, renamed when done.
UNFINISHED = ".orbax-checkpoint-tmp"

T = TypeVar("T")


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


def changed_settings(meta: dict[str, Any], config: dict[str, Any], *, most: int = 8) -> str:
    """The settings `config` (a run's config as written, by section) gives other than the one a
    checkpoint was saved under, as `section.field: saved -> now`; a field the saved config lacks
    came with a later version, so the run trained with what that version did. '' when they agree."""

    def flat(tree: dict, prefix: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in tree.items():
            if isinstance(value, dict):
                out.update(flat(value, f"{prefix}{key}."))
            else:
                out[f"{prefix}{key}"] = value
        return out

    saved, now = flat(meta.get("config", {})), flat(config)
    changes = [
        f"{key}: {saved[key]!r} -> {value!r}" if key in saved else f"{key}: not in the saved config -> {value!r}"
        for key, value in sorted(now.items())
        if key not in saved or saved[key] != value
    ]
    more = f" (and {len(changes) - most} more)" if len(changes) > most else ""
    return "; ".join(changes[:most]) + more


class RunCheckpoints:
    """The train-state checkpoints in `directory` (a workdir's `checkpoints/`): those a run saves
    and resumes from, or (`reading`) those export and evaluate read."""

    def __init__(self, directory: str, *, every_steps: int, keep: int | None, async_save: bool, reading: bool = False):
        """`reading`: only read (see `reading_only`); a run (not `reading`) first removes what its
        own saves that never finished left."""
        self.directory = directory
        if not reading:
            _remove_unfinished_saves(directory)
        with _without_orbax_metadata_lines():  # it reads every step's metadata
            self.manager = ocp.CheckpointManager(
                self.directory,
                options=ocp.CheckpointManagerOptions(
                    # Exactly every N steps (Orbax's default would also save the first step); the
                    # loop forces the final and the on-signal saves.
                    save_decision_policy=save_policies.FixedIntervalPolicy(every_steps),
                    max_to_keep=keep,
                    enable_async_checkpointing=async_save,
                    create=not reading,
                    # Not Orbax's clean-up of unfinished saves: it runs in a thread of its own, which a
                    # command that stops at once leaves running into the interpreter's exit (a
                    # traceback on stderr), and in a reader it would delete a running save.
                    cleanup_tmp_directories=False,
                ),
            )
        self._saving: tuple[int, int] | None = None  # (step, bytes) of the latest save started
        self._threads_before_save: set[threading.Thread] = set()

    @classmethod
    def reading_only(cls, directory: str) -> RunCheckpoints:
        """The checkpoints as export and evaluate read them: nothing removed or created, so that
        the save a run training in the same workdir has in progress stays untouched."""
        return cls(directory, every_steps=1, keep=None, async_save=False, reading=True)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def damage(self, step: int) -> str | None:
        """Why the checkpoint of `step` cannot be read, as far as it shows without restoring it;
        None if it looks sound."""
        path = os.path.join(self.directory, str(step))  # Orbax's step name
        names = os.listdir(path)
        if not names:
            return "an empty directory"
        if COMMITTED not in names:
            return f"its save did not finish (no {COMMITTED})"
        if missing := [item for item in ITEMS if not os.path.isdir(os.path.join(path, item))]:
            return f"its {' and '.join(missing)} item{'s are' if len(missing) > 1 else ' is'} missing"
        json_files = [STEP_METADATA, STATE_METADATA]
        for item in JSON_ITEMS:
            json_files += [f"{item}/{name}" for name in os.listdir(os.path.join(path, item)) if name != COMMITTED]
        for name in json_files:
            try:
                with open(os.path.join(path, name), encoding="utf-8") as f:
                    json.load(f)
            except FileNotFoundError:
                return f"{name} is missing"
            except ValueError:  # not UTF-8, not JSON
                return f"{name} is not JSON"
        return _unreadable_arrays(os.path.join(path, "state"))

    def newest_readable(
        self, read: Callable[[int], T], *, step: int | None = None, resuming: bool = False
    ) -> tuple[int, T]:
        """(step, `read(step)`) for the newest checkpoint that is sound and reads, or for `step`
        alone if given. Those passed over are said in one warning line and left where they are,
        except `resuming`, which moves them aside (the run saves those steps again). None readable:
        a one-line UserError naming the directory. A UserError of `read` (a config that does not
        match the checkpoint) is raised as it is: the checkpoint is not damaged."""
        steps = self.manager.all_steps()
        if step is not None and step not in steps:
            raise UserError(f"no checkpoint of step {step} in {self.directory} (steps: {sorted(steps)})")
        if not steps:
            raise UserError(f"no checkpoint in {self.directory}")
        damaged: list[tuple[int, str]] = []
        for candidate in [step] if step is not None else sorted(steps, reverse=True):
            reason = self.damage(candidate)
            if reason is None:
                try:
                    value = read(candidate)
                except UserError:
                    raise
                except Exception as e:  # Orbax and TensorStore raise many kinds of errors on a damaged file
                    reason = _read_failure(e, os.path.join(self.directory, str(candidate)))
                else:
                    if damaged:
                        kept = self._set_aside([s for s, _ in damaged]) if resuming else ()
                        _warn_damaged(_damaged(self.directory, damaged), candidate, kept)
                    return candidate, value
            damaged.append((candidate, reason))
        if step is not None:
            raise UserError(_damaged(self.directory, damaged))
        raise UserError(
            f"no readable checkpoint: {_damaged(self.directory, damaged)}; start afresh in a new workdir "
            "(or move the checkpoints away)"
        )

    def _set_aside(self, steps: list[int]) -> tuple[str, ...]:
        """Renames damaged steps out of Orbax's sight, so that the run can save them again; returns
        their new paths."""
        kept = tuple(_free_name(os.path.join(self.directory, f"{step}{DAMAGED_SUFFIX}")) for step in steps)
        if jax.process_index() == 0:
            for step, path in zip(steps, kept):
                os.rename(os.path.join(self.directory, str(step)), path)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("dflash_jax: damaged checkpoints set aside")
        with _without_orbax_metadata_lines():
            self.manager.reload()
        return kept

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

    def resume(
        self, abstract_state: TrainState, iterator: DataIterator, check_meta: Callable[[dict[str, Any]], None]
    ) -> tuple[int, TrainState, dict[str, Any]]:
        """(step, state, metadata) of the newest readable checkpoint, restored onto `abstract_state`'s
        shardings, after `check_meta(metadata)` (a UserError for a config it does not fit), with
        `iterator` repositioned in place to where that step left it. Damaged newer steps are kept
        aside (`newest_readable`)."""

        def read(step: int) -> tuple[TrainState, dict[str, Any]]:
            meta = self.restore_meta(step)
            check_meta(meta)
            return self.restore_state(step, abstract_state), meta

        step, (state, meta) = self.newest_readable(read, resuming=True)
        # Once the step is chosen: a data iterator that refuses a changed data set is no damage.
        self.manager.restore(step, args=ocp.args.Composite(data=DataIteratorRestore(iterator)))
        return step, state, meta

    def restore_state(self, step: int, abstract_state: TrainState) -> TrainState:
        """The train state alone (export needs neither data nor metadata). Weights other than the
        model's that `abstract_state` describes are a one-line UserError: a sound checkpoint, of
        another model."""
        try:
            restored = self.manager.restore(
                step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state))
            )
        except ValueError as e:
            if STRUCTURE_MISMATCH not in str(e):
                raise
            raise UserError(
                f"the checkpoint of step {step} in {self.directory} holds other weights than the drafter its "
                f"config describes ({_mismatch(str(e))}): written by another version of dflash_jax? Export or "
                "resume it with that version"
            ) from None
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
        if step is not None:
            _remove_unfinished(self.directory, step)  # the partial save
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


def _unreadable_arrays(state_dir: str) -> str | None:
    """Why the arrays' database in `state_dir` cannot be read, from its index and the last byte of
    each stored value (milliseconds: a cut or missing data file shows); None if all are there.
    Found here rather than by Orbax's restore, whose failed read leaves the rest of its reads
    running into a closed event loop, each printing tracebacks."""
    try:
        store = tensorstore.KvStore.open({"driver": "ocdbt", "base": f"file://{state_dir}/"}).result()
        for key in store.list().result():
            try:
                store.read(key, byte_range=slice(-1, None)).result()
            except ValueError as e:  # "OUT_OF_RANGE: Requested byte range ...": say which value
                code, _, detail = _first_line(e).partition(": ")
                raise ValueError(f'{code}: Error reading "{key.decode()}" in state/: {detail}') from e
    except ValueError as e:  # TensorStore's error for a cut, missing or garbled file
        return _reading_failed(f"ValueError: {_first_line(e)}")
    return None


def _first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or ["no detail"])[0].split(" [tensorstore_spec")[0]


# Orbax's ValueError when a checkpoint's tree is not the one it is asked to restore into; each
# difference follows as "path:" then "- Source: ..." (the tree asked for) and "- Target: ..." (disk).
STRUCTURE_MISMATCH = "tree structures do not match"
_DIFFERENCE = re.compile(r"^(\S+):\n\s*- Source: (.*)\n\s*- Target: (.*)$", re.MULTILINE)


def _mismatch(message: str) -> str:
    """Orbax's list of differences, as the parameters (or, if none differ, the first entries) the
    checkpoint has that the model lacks and the other way round, cut short."""
    differences = _DIFFERENCE.findall(message)
    params = [d for d in differences if d[0].startswith("params.")] or differences[:1]
    extra = [path for path, source, _ in params if source == "MISSING"]
    missing = [path for path, _, target in params if target == "MISSING"]
    parts = []
    for label, paths in (("it has", extra), ("it lacks", missing)):
        if paths:
            parts.append(f"{label} {', '.join(paths[:3])}{', ...' if len(paths) > 3 else ''}")
    return "; ".join(parts) or "their trees differ"


def _read_failure(error: Exception, step_dir: str) -> str:
    """A restore's failure in a few words: its root cause's first line (TensorStore's says which
    file and bytes), without the step's path or TensorStore's spec, cut short."""
    while cause := error.__cause__ or error.__context__:
        error = cause
    return _reading_failed(f"{type(error).__name__}: {_first_line(error).replace(step_dir + os.sep, '')}")


def _reading_failed(text: str) -> str:
    return f"reading it failed ({text[:300]}{'...' if len(text) > 300 else ''})"


def _damaged(directory: str, damaged: list[tuple[int, str]]) -> str:
    """'the checkpoint of step 8 in DIR is damaged (why)', for one step or several."""
    if len(damaged) == 1:
        (step, reason), *_ = damaged
        return f"the checkpoint of step {step} in {directory} is damaged ({reason})"
    steps = ", ".join(str(step) for step, _ in damaged)
    reasons = "; ".join(f"step {step}: {reason}" for step, reason in damaged)
    return f"the checkpoints of steps {steps} in {directory} are damaged ({reasons})"


@functools.cache  # once per process: evaluate reads a workdir's checkpoints more than once
def _warn_damaged(damaged: str, used: int, kept: tuple[str, ...]) -> None:
    if kept:
        log.warning(
            "%s; resuming from step %d, the newest readable one; kept aside as %s", damaged, used, ", ".join(kept)
        )
    else:
        log.warning("%s; using step %d, the newest readable one", damaged, used)


class _OrbaxMetadataLines(logging.Filter):
    """Orbax's log lines about a step whose metadata file is missing or not JSON (it quotes the
    whole file): `RunCheckpoints.damage` says what is wrong with that step, in its one line."""

    PREFIXES = ("Metadata file does not exist", "Failed to read Metadata file", "Failed to json parse Metadata file")

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.PREFIXES)


@contextlib.contextmanager
def _without_orbax_metadata_lines():
    """Drops `_OrbaxMetadataLines` while Orbax lists a directory's steps (absl's logger: Orbax's)."""
    logger, quiet = logging.getLogger("absl"), _OrbaxMetadataLines()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


def _remove_unfinished(directory: str, step: int | None = None) -> None:
    """Removes the directories of unfinished saves in `directory`: `step`'s, or every step's."""
    for name in os.listdir(directory) if os.path.isdir(directory) else ():
        unfinished = UNFINISHED in name if step is None else name.startswith(f"{step}{UNFINISHED}")
        if unfinished:
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


def _remove_unfinished_saves(directory: str) -> None:
    """Removes the directories of saves that never finished (a run killed while it saved), before
    the run saves again: by process 0, the others waiting for it."""
    if jax.process_index() == 0:
        _remove_unfinished(directory)
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("dflash_jax: unfinished saves removed")


def _free_name(path: str) -> str:
    """`path`, or `path.1`, `path.2`... where an earlier damaged copy has the name."""
    candidate, n = path, 0
    while os.path.lexists(candidate):
        n += 1
        candidate = f"{path}.{n}"
    return candidate


class BestCheckpoint:
    """The drafter weights of the best acceptance length (tau) seen so far."""

    def __init__(self, directory: str, *, resumed_step: int | None = None):
        with _without_orbax_metadata_lines():
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
