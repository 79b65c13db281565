"""Checkpoints of a run: train state, run metadata and the data iterator, saved together.

One Orbax step directory holds three items: `state` (the `TrainState` arrays: drafter weights,
optimizer state, step, RNG key, skip counters), `meta` (JSON: epoch, best acceptance so far,
the drafter's export config and the resolved run config) and `data` (the data iterator's
position). Orbax writes a step into a temporary directory and renames it only once complete,
so an interrupted or failed save never shows up as a step; `latest_step` only sees finished ones.

A second manager keeps the drafter weights with the best acceptance length (tau) measured
during training.
"""

from __future__ import annotations

from typing import Any

import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as save_policies

from dflash_jax.data.pipeline import DataIterator, DataIteratorRestore, DataIteratorSave
from dflash_jax.training.step import TrainState


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
        """Saves if `step` is on the save interval (or `force`); returns whether it did."""
        return self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                meta=ocp.args.JsonSave(meta),
                data=DataIteratorSave(iterator),
            ),
            force=force,
        )

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
        """Blocks until pending asynchronous saves are on disk (and raises if one failed)."""
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()


class BestCheckpoint:
    """The drafter weights of the best acceptance length (tau) seen so far."""

    def __init__(self, directory: str):
        self.manager = ocp.CheckpointManager(
            directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=1, enable_async_checkpointing=False),
        )

    def save(self, step: int, params, tau: float) -> None:
        self.manager.save(
            step,
            args=ocp.args.Composite(params=ocp.args.StandardSave(params), meta=ocp.args.JsonSave({"tau": tau})),
            force=True,
        )

    def close(self) -> None:
        self.manager.close()
