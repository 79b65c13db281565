"""The training loop: resume, train, evaluate, checkpoint, stop cleanly, export.

Rerunning with the same workdir resumes from its latest readable checkpoint: weights, optimizer state,
step, RNG key and the data iterator's position, so the rest of the run is bitwise the run that
would have happened without the interruption. SIGTERM / SIGINT finish the current step, save
and return; a second SIGINT interrupts at once. Steps with a non-finite loss or gradient are
skipped by the step itself; too many in a row stop the run with an error, and since skipped
steps leave the weights untouched, no checkpoint ever holds a non-finite weight.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from dflash_jax.data.pipeline import DataPipeline
from dflash_jax.decoding.draft_vocab import by_frequency, most_frequent, write_frequencies
from dflash_jax.errors import UserError
from dflash_jax.models.drafter_config import DrafterConfig
from dflash_jax.models.formats.gguf_export import llama_cpp_problems
from dflash_jax.models.formats.hf import load_target
from dflash_jax.training.acceptance_eval import AcceptanceEval
from dflash_jax.training.checkpoint import BestCheckpoint, RunCheckpoints, changed_settings, optimizer_of
from dflash_jax.training.config.run_config import TrainSetup
from dflash_jax.training.drafters import export_params
from dflash_jax.training.mesh import batch_sharding, make_mesh
from dflash_jax.training.monitoring import Monitor
from dflash_jax.training.optim.ema import served_params
from dflash_jax.training.step import build_train_step

log = logging.getLogger(__name__)

# On CPU, too many queued sharded steps can deadlock the collectives: wait on a value this often.
MAX_STEPS_WITHOUT_SYNC = 10


class NonFiniteError(UserError):
    """Too many consecutive steps had a non-finite loss or gradient (a learning rate, data or
    target weights to fix, reported as one line)."""

    label = "training stopped"


class StopSignals:
    """Turns SIGTERM / SIGINT into a request to save and stop, agreed on by every process."""

    def __init__(self):
        self.requested = False
        self._previous = {}

    def __enter__(self) -> StopSignals:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        log.warning("received %s: saving a checkpoint and stopping", signal.Signals(signum).name)
        self.requested = True
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C interrupts

    def agreed(self) -> bool:
        """Whether any process was asked to stop (a collective: call it on every process)."""
        if jax.process_count() == 1:
            return self.requested
        return bool(multihost_utils.process_allgather(np.asarray(self.requested)).any())


@dataclasses.dataclass(frozen=True)
class RunOutcome:
    """How a call to `train` ended."""

    step: int  # the last step trained (and saved)
    total_steps: int
    finished: bool  # the run has trained every step and its export is in place
    already_finished: bool  # ... and it had before this call: nothing was trained
    metrics: dict  # the last logged training metrics


def train(setup: TrainSetup) -> RunOutcome:
    """Runs (or resumes) the run `setup` describes, holding its workdir's lock."""
    with setup.workdir.lock():
        run = TrainingRun(setup)
        try:
            return run.train()
        finally:
            run.close()


class TrainingRun:
    """One run in its workdir: the models, the data, the checkpoints and the monitor."""

    def __init__(self, setup: TrainSetup):
        self.setup = setup
        self.workdir = workdir = setup.workdir
        mesh = make_mesh(*setup.mesh_shape)
        log.info(
            "mesh data=%d x fsdp=%d x tensor=%d: %d devices in %d processes",
            *setup.mesh_shape,
            jax.device_count(),
            jax.process_count(),
        )
        _warn_if_engines_cannot_serve(setup)
        self.data = DataPipeline.from_config(setup.data, setup.target_path)
        total = self.data.total_steps(setup.run.num_epochs)
        self.total_steps = min(total, setup.run.max_steps) if setup.run.max_steps else total
        self.target = load_target(
            setup.target_path,
            param_dtype=setup.target_dtype,
            compute_dtype=setup.target_dtype,
            mesh=mesh,
            attention=setup.run.attention,
            scan_layers=setup.run.scan_layers,
        )
        draft_tokens = self._count_trained_tokens()
        target_graphdef, self.target_params = nnx.split(self.target)
        program = build_train_step(setup, mesh, target_graphdef, self.target_params, total_steps=self.total_steps)
        self.schedule, self.drafter_graphdef, self.step_fn = program.schedule, program.drafter_graphdef, program.step
        self.iterator = self.data.iterator(sharding=batch_sharding(mesh))
        self.checkpoints = RunCheckpoints(
            workdir.checkpoints,
            every_steps=setup.checkpoint.every_steps,
            keep=setup.checkpoint.keep,
            async_save=setup.checkpoint.async_save,
        )
        self.last_saved = self.checkpoints.latest_step()
        if self.last_saved is None:
            self.state, self.best_tau = program.init_state(), None
        else:
            # The newest readable checkpoint: a damaged newer one is kept aside, its steps redone.
            self.last_saved, self.state, meta = self.checkpoints.resume(
                program.abstract_state, self.iterator, lambda meta: _check_resumable(meta, setup)
            )
            self.best_tau = meta["best_tau"]
            log.info("resumed from %s at step %d", self.checkpoints.directory, self.last_saved)
            # Rerunning "the same command" after an edit or an upgrade trains on with other settings.
            if changes := changed_settings(meta, setup.config_dict):
                log.warning("resuming with settings other than the checkpoint's: %s", changes)
        self.evaluate = AcceptanceEval.for_setup(setup, draft_tokens) if setup.eval.during_training else None
        self.best = BestCheckpoint(workdir.best_checkpoint, resumed_step=self.last_saved) if self.evaluate else None
        self.monitor = Monitor(
            workdir,
            setup.log,
            total_steps=self.total_steps,
            start_step=int(self.state.step),
            run_config=setup.config_dict,
        )
        self.step = int(self.state.step)
        self.epoch = None
        self.eval_metrics: dict = {}

    def _count_trained_tokens(self) -> np.ndarray | None:
        """Writes the workdir's token frequencies (process 0, once); returns the draft vocabulary
        `eval.draft_vocab` asks for (None for the whole vocabulary)."""
        path, size = self.workdir.token_frequencies, self.setup.eval.draft_vocab
        write = jax.process_index() == 0 and not os.path.isfile(path)
        if not (write or size):
            return None
        counts = self.data.trained_token_counts(self.target.cfg.vocab_size)
        if write:
            write_frequencies(path, counts, source=f"data {self.data.cache.manifest['content_sha256'][:16]}")
        return most_frequent(by_frequency(counts), size, path) if size else None

    @property
    def served_params(self):
        """The weights evaluated and exported (the weight average where train.ema_decay > 0)."""
        return served_params(self.state.params, self.state.opt_state)

    def train(self) -> RunOutcome:
        logged = {}
        start_step = self.step
        already_finished = start_step >= self.total_steps and self.workdir.is_finished(self.total_steps)
        sync_every = max(1, min(self.setup.log.every_steps, MAX_STEPS_WITHOUT_SYNC))
        with StopSignals() as stop:
            while self.step < self.total_steps:
                self._start_epoch_if_new()
                self.state, metrics = self.step_fn(self.state, self.target_params, next(self.iterator))
                self.step += 1
                self.monitor.record(metrics)
                self.checkpoints.check_for_errors()  # a failed asynchronous save stops the run now
                stopping = False
                if self.step % sync_every == 0 or self.step == self.total_steps:
                    self._check_finite()  # also waits for the step: see MAX_STEPS_WITHOUT_SYNC
                    stopping = stop.agreed()
                if self.evaluate and self._due(self.setup.eval.every_steps):
                    self._evaluate()
                if self._due(self.setup.log.every_steps) or stopping:
                    logged = self._log()
                if stopping:
                    log.warning("stopping at step %d on request", self.step)
                    break
                if self.checkpoints.save(self.step, self.state, self._meta(), self.iterator):
                    self.last_saved = self.step
        if self.last_saved != self.step:
            self.checkpoints.save(self.step, self.state, self._meta(), self.iterator, force=True)
        self.checkpoints.wait()
        if already_finished:
            log.info("this run had already finished at step %d; its drafter is in %s", self.step, self.workdir.export)
        elif self.step >= self.total_steps:
            export_params(self.setup.drafter, self.served_params, self.workdir.export, workdir=self.workdir)
            if jax.process_index() == 0:
                self.workdir.mark_finished(self.step)
            log.info("training finished at step %d; drafter exported to %s", self.step, self.workdir.export)
        return RunOutcome(
            step=self.step,
            total_steps=self.total_steps,
            finished=self.step >= self.total_steps,
            already_finished=already_finished,
            metrics=logged,
        )

    def close(self) -> None:
        self.monitor.close()
        self.checkpoints.close()
        if self.best is not None:
            self.best.close()

    def _due(self, every: int) -> bool:
        return self.step % every == 0 or self.step == self.total_steps

    def _start_epoch_if_new(self) -> None:
        epoch = _epoch_of_next_batch(self.data, self.iterator)
        if epoch != self.epoch:
            self.epoch = epoch
            step_in_epoch = self.iterator.step if self.iterator.epoch == epoch else 0
            self.monitor.start_epoch(
                epoch,
                step=self.step,
                steps_in_epoch=self.data.steps_in_epoch(epoch),
                step_in_epoch=step_in_epoch,
                stats=epoch_statistics(self.data, epoch),
            )

    def _check_finite(self) -> None:
        streak, skipped = jax.device_get((self.state.nonfinite_streak, self.state.skipped_updates))
        if streak >= self.setup.run.max_nonfinite_streak:
            raise NonFiniteError(
                f"{streak} consecutive steps (up to step {self.step}) had a non-finite loss or "
                f"gradient and were skipped ({skipped} in all); stopping. The latest checkpoint "
                f"(step {self.last_saved}) holds finite weights: lower train.learning_rate or "
                "check the data and the target weights"
            )

    def _evaluate(self) -> None:
        """Acceptance by speculative decoding; a new best tau is kept and exported. Decoding runs
        the target's layers one by one: scanned layers are unstacked for it and stacked again."""
        scanned = self.setup.run.scan_layers
        target = self.target.relayout(scan_layers=False) if scanned else self.target
        try:
            self.eval_metrics = self.evaluate(target, nnx.merge(self.drafter_graphdef, self.served_params))
        finally:
            if scanned:
                self.target = target.relayout(scan_layers=True)
                self.target_params = nnx.state(self.target)
        self.monitor.write(self.eval_metrics, step=self.step, epoch=self.epoch, kind="eval")
        tau = self.eval_metrics["tau"]
        if np.isfinite(tau) and (self.best_tau is None or tau > self.best_tau):
            self.best_tau = tau
            self.best.save(self.step, self.served_params, tau)
            export_params(self.setup.drafter, self.served_params, self.workdir.export_best, workdir=self.workdir)

    def _log(self) -> dict:
        skipped = int(self.state.skipped_updates)
        extra = {
            # The rate of the latest applied update.
            "learning_rate": float(self.schedule(max(self.step - skipped - 1, 0))),
            "skipped_updates": skipped,
        }
        if self.eval_metrics:
            extra["tau"] = self.eval_metrics["tau"]
        return self.monitor.flush(self.step, self.epoch, extra)

    def _meta(self) -> dict:
        return {
            "epoch": self.iterator.epoch,
            "best_tau": self.best_tau,
            "total_steps": self.total_steps,
            "drafter_config": self.setup.drafter.to_hf(),
            "config": self.setup.config_dict,
        }


def _warn_if_engines_cannot_serve(setup: TrainSetup) -> None:
    """One line per reason the engines cannot serve the drafter as configured: SGLang, vLLM and
    llama.cpp capture target layer i's feature at the input of layer i + 1, which the last layer
    does not have (docs/design.md §2); llama.cpp has limits of its own (models/formats/gguf_export.py)."""
    for problem in llama_cpp_problems(setup.drafter.to_hf(), setup.target.num_layers):
        log.warning("serving the export: %s", problem)  # each names the engines it rules out


def _check_resumable(meta: dict, setup: TrainSetup) -> None:
    """A checkpoint's weights only restore into the drafter that wrote them, and its optimizer
    state into the optimizer that did: a one-line UserError naming the settings that changed
    (restoring would only name the weights that differ)."""
    if "drafter_config" in meta:
        # Both as their config.json reads back: the drafter's shape, not its training-only fields.
        saved, now = (
            dataclasses.asdict(DrafterConfig.from_hf(c)) for c in (meta["drafter_config"], setup.drafter.to_hf())
        )
        if changed := changed_settings({"config": {"drafter": saved}}, {"drafter": now}, most=len(now)):
            raise UserError(
                f"{setup.workdir.checkpoints} holds another drafter ({changed}); resuming needs "
                "the drafter it was trained with (set those fields back), or a new workdir"
            )
    _check_same_optimizer(optimizer_of(meta), setup)


def _check_same_optimizer(saved: str, setup: TrainSetup) -> None:
    """A checkpoint's optimizer state (`saved`'s) only restores into the optimizer that wrote it."""
    if saved != setup.optimizer.optimizer:
        raise UserError(
            f"{setup.workdir.checkpoints} was trained with train.optimizer={saved}; resuming needs the "
            f"same optimizer (this config: {setup.optimizer.optimizer}), or a new workdir"
        )


def _epoch_of_next_batch(data: DataPipeline, iterator) -> int:
    if iterator.step >= data.steps_in_epoch(iterator.epoch):
        return iterator.epoch + 1
    return iterator.epoch


def epoch_statistics(data: DataPipeline, epoch: int) -> dict:
    """Packing fill of the epoch's plan and the samples the tokenized cache left out."""
    plan = data.plan(epoch)
    manifest = data.cache.manifest
    return {
        "packing_fill": float(data.cache.lengths.sum()) / (plan.num_rows * data.settings.seq_len),
        "samples": int(data.cache.num_samples),
        "skipped_samples": int(sum(manifest.get("skipped", {}).values())),
        "truncated_samples": int(manifest.get("truncated", 0)),
    }
