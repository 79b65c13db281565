"""The training loop: resume, train, evaluate, checkpoint, stop cleanly, export.

Rerunning with the same workdir resumes from its latest checkpoint: weights, optimizer state,
step, RNG key and the data iterator's position, so the rest of the run is bitwise the run that
would have happened without the interruption. SIGTERM / SIGINT finish the current step, save
and return; a second SIGINT interrupts at once. Steps with a non-finite loss or gradient are
skipped by the step itself; too many in a row stop the run with an error, and since skipped
steps leave the weights untouched, no checkpoint ever holds a non-finite weight.
"""

from __future__ import annotations

import json
import logging
import os
import signal

import jax
import ml_collections
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from dflash_jax.data.pipeline import DataPipeline
from dflash_jax.export import export_params
from dflash_jax.models.hf import load_target
from dflash_jax.training import acceptance
from dflash_jax.training.checkpoint import BestCheckpoint, RunCheckpoints
from dflash_jax.training.config import resolve
from dflash_jax.training.mesh import batch_sharding, make_mesh
from dflash_jax.training.monitoring import Monitor
from dflash_jax.training.step import (
    abstract_train_state, drafter_graph, init_train_state, learning_rate_schedule,
    make_optimizer, make_train_step,
)

log = logging.getLogger(__name__)

# On CPU, too many queued sharded steps can deadlock the collectives: wait on a value this often.
MAX_STEPS_WITHOUT_SYNC = 10


class NonFiniteError(RuntimeError):
    """Too many consecutive steps had a non-finite loss or gradient."""


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


def train(config: ml_collections.ConfigDict) -> dict:
    """Runs (or resumes) training; returns the last logged metrics."""
    setup = resolve(config, num_devices=jax.device_count())
    workdir = os.path.abspath(config.workdir)
    mesh = make_mesh(*setup.mesh_shape)
    log.info(
        "mesh data=%d x fsdp=%d: %d devices in %d processes", *setup.mesh_shape,
        jax.device_count(), jax.process_count(),
    )
    data = DataPipeline.from_config(config.data, config.target.path)
    total_steps = data.total_steps(config.train.num_epochs)
    if config.train.max_steps:
        total_steps = min(total_steps, config.train.max_steps)
    tx = make_optimizer(setup.optimizer, total_steps)
    schedule = learning_rate_schedule(setup.optimizer, total_steps)
    target = load_target(
        config.target.path, param_dtype=setup.target_dtype, compute_dtype=setup.target_dtype, mesh=mesh
    )
    target_graphdef, target_params = nnx.split(target)
    iterator = data.iterator(sharding=batch_sharding(mesh))
    checkpoints = RunCheckpoints(
        workdir, every_steps=config.checkpoint.every_steps, keep=config.checkpoint.keep,
        async_save=config.checkpoint.async_save,
    )
    state_kw = dict(seed=config.seed, compute_dtype=setup.compute_dtype, mesh=mesh)
    latest = checkpoints.latest_step()
    if latest is None:
        state, best_tau = init_train_state(setup.drafter, tx, **state_kw), None
    else:
        state, meta = checkpoints.restore(latest, abstract_train_state(setup.drafter, tx, **state_kw), iterator)
        best_tau = meta["best_tau"]
        log.info("resumed from %s at step %d (epoch %d)", checkpoints.directory, latest, iterator.epoch)
    graphdef = drafter_graph(setup.drafter, setup.compute_dtype)
    step_fn = make_train_step(
        drafter_graphdef=graphdef, target_graphdef=target_graphdef, target_params=target_params,
        tx=tx, cfg=setup.objective, grad_accum_steps=config.train.grad_accum_steps, mesh=mesh,
        state_sharding=jax.tree.map(lambda x: x.sharding, state),
    )
    evaluate = _acceptance_eval(config)
    best = BestCheckpoint(workdir) if evaluate else None
    run_config = json.loads(config.to_json_best_effort())
    monitor = Monitor(
        workdir, total_steps=total_steps, start_step=int(state.step),
        progress_bars=config.log.progress_bars, tensorboard=config.log.tensorboard,
        wandb=config.log.wandb, wandb_project=config.log.wandb_project, run_config=run_config,
    )

    def meta() -> dict:
        return {
            "epoch": iterator.epoch, "best_tau": best_tau, "total_steps": total_steps,
            "drafter_config": setup.drafter.to_hf(), "config": run_config,
        }

    step, last_saved, epoch, logged, eval_metrics = int(state.step), latest, None, {}, {}
    sync_every = max(1, min(config.log.every_steps, MAX_STEPS_WITHOUT_SYNC))
    try:
        with StopSignals() as stop:
            while step < total_steps:
                if _epoch_of_next_batch(data, iterator) != epoch:
                    epoch = _epoch_of_next_batch(data, iterator)
                    step_in_epoch = iterator.step if iterator.epoch == epoch else 0
                    monitor.start_epoch(epoch, data.steps_in_epoch(epoch), step_in_epoch, epoch_statistics(data, epoch))
                state, metrics = step_fn(state, target_params, next(iterator))
                step += 1
                monitor.record(metrics)
                stopping = False
                if step % sync_every == 0 or step == total_steps:
                    streak, skipped = jax.device_get((state.nonfinite_streak, state.skipped_updates))
                    if streak >= config.train.max_nonfinite_streak:
                        raise NonFiniteError(
                            f"{streak} consecutive steps (up to step {step}) had a non-finite loss or "
                            f"gradient and were skipped ({skipped} in all); stopping. The latest "
                            f"checkpoint (step {last_saved}) holds finite weights: lower "
                            "train.learning_rate or check the data and the target weights"
                        )
                    stopping = stop.agreed()
                if evaluate and (step % config.eval.every_steps == 0 or step == total_steps):
                    eval_metrics = evaluate(target, nnx.merge(graphdef, state.params))
                    monitor.write(eval_metrics, step=step, epoch=epoch, kind="eval")
                    tau = eval_metrics["tau"]
                    if np.isfinite(tau) and (best_tau is None or tau > best_tau):
                        best_tau = tau
                        best.save(step, state.params, best_tau)
                        export_params(setup.drafter, state.params, os.path.join(workdir, "export_best"))
                if step % config.log.every_steps == 0 or step == total_steps or stopping:
                    extra = {
                        "learning_rate": float(schedule(step - int(state.skipped_updates))),
                        "skipped_updates": int(state.skipped_updates),
                        **({"tau": eval_metrics["tau"]} if eval_metrics else {}),
                    }
                    logged = monitor.flush(step, epoch, extra)
                if stopping:
                    log.warning("stopping at step %d on request", step)
                    break
                if checkpoints.save(step, state, meta(), iterator):
                    last_saved = step
            if last_saved != step:
                checkpoints.save(step, state, meta(), iterator, force=True)
            checkpoints.wait()
            if step >= total_steps:
                out = export_params(setup.drafter, state.params, os.path.join(workdir, "export"))
                log.info("training finished at step %d; drafter exported to %s", step, out)
    finally:
        monitor.close()
        checkpoints.close()
        if best is not None:
            best.close()
    return logged


def _epoch_of_next_batch(data: DataPipeline, iterator) -> int:
    if iterator.step >= data.steps_in_epoch(iterator.epoch):
        return iterator.epoch + 1
    return iterator.epoch


def epoch_statistics(data: DataPipeline, epoch: int) -> dict:
    """Packing fill of the epoch's plan and the samples the tokenized cache left out."""
    plan = data.plan(epoch)
    manifest = data.cache.manifest
    return {
        "packing_fill": float(data.cache.lengths.sum()) / (plan.num_rows * data.seq_len),
        "samples": int(data.cache.num_samples),
        "skipped_samples": int(sum(manifest.get("skipped", {}).values())),
        "truncated_samples": int(manifest.get("truncated", 0)),
    }


def _acceptance_eval(config: ml_collections.ConfigDict):
    """A function (target, drafter) -> acceptance stats, or None when evaluation is off."""
    if not config.eval.prompts or config.eval.every_steps <= 0:
        return None
    prompts = acceptance.load_prompts(
        config.eval.prompts, config.target.path, num_prompts=config.eval.num_prompts,
        enable_thinking=config.data.enable_thinking,
    )
    return acceptance.AcceptanceEval(
        prompts, acceptance.stop_tokens(config.target.path), max_new_tokens=config.eval.max_new_tokens
    )
