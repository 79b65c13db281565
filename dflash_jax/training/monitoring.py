"""What a run reports: progress bars, TensorBoard, a JSONL log and (optionally) Weights & Biases.

Every step's additive metrics stay on device until a log line is due, so the host waits for the
device once per log line, not once per step. Throughput is measured between log points, after compilation.
Totals are exact (every epoch's step count is known when training starts), so the overall bar's
ETA stays right although epochs have different numbers of steps. Only process 0 writes.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

import jax
import numpy as np
import tqdm

from dflash_jax.training.config.run_config import LogSettings
from dflash_jax.training.objective import summarize
from dflash_jax.training.workdir import Workdir

log = logging.getLogger(__name__)


class Monitor:
    def __init__(
        self, workdir: Workdir, log_settings: LogSettings, *, total_steps: int, start_step: int, run_config: dict
    ):
        self.active = jax.process_index() == 0
        self.total_steps = total_steps
        self._pending: list[dict] = []
        self._last_time = time.perf_counter()
        self._overall = self._epoch_bar = None
        self._tensorboard = self._wandb = None
        if not self.active:
            return
        os.makedirs(workdir.root, exist_ok=True)
        _drop_lines_after(workdir.metrics, start_step)  # a resumed run logs those steps again
        self._jsonl = open(workdir.metrics, "a", buffering=1)
        if log_settings.progress_bars:
            self._overall = tqdm.tqdm(
                total=total_steps,
                initial=start_step,
                desc="train",
                unit="step",
                position=0,
                dynamic_ncols=True,
            )
        if log_settings.tensorboard:
            from tensorboardX import SummaryWriter

            # purge_step: TensorBoard drops the events of the steps a resumed run redoes.
            self._tensorboard = SummaryWriter(workdir.tensorboard, purge_step=start_step + 1 if start_step else None)
        if log_settings.wandb:
            self._wandb = _start_wandb(log_settings.wandb_project, workdir, run_config)

    def start_epoch(
        self, epoch: int, *, step: int, steps_in_epoch: int, step_in_epoch: int, stats: dict[str, Any]
    ) -> None:
        """A new epoch bar; the epoch's packing and data statistics are logged once, when the
        epoch really starts (not again when a run resumes inside it)."""
        if not self.active:
            return
        if step_in_epoch == 0:
            log.info("epoch %d: %d steps; %s", epoch, steps_in_epoch, _format(stats))
            self.write(stats, step=step, epoch=epoch, kind="epoch")
        if self._overall is not None:
            if self._epoch_bar is not None:
                self._epoch_bar.close()
            self._epoch_bar = tqdm.tqdm(
                total=steps_in_epoch,
                initial=step_in_epoch,
                desc=f"epoch {epoch}",
                unit="step",
                position=1,
                leave=False,
                dynamic_ncols=True,
            )

    def record(self, metrics: dict) -> None:
        """One step's additive metrics (device arrays, fetched later)."""
        self._pending.append(metrics)
        if self._overall is not None:
            self._overall.update(1)
            self._epoch_bar.update(1)

    def flush(self, step: int, epoch: int, extra: dict[str, float]) -> dict[str, float]:
        """Summarizes the steps since the last flush; returns what was logged."""
        sums = jax.tree.map(lambda *xs: np.sum(xs, axis=0), *jax.device_get(self._pending))
        steps = len(self._pending)
        self._pending.clear()
        now = time.perf_counter()
        elapsed = max(now - self._last_time, 1e-9)
        self._last_time = now
        applied = float(sums["updates_applied"])
        out = {
            **summarize(sums),
            "grad_norm": float(sums["grad_norm_sum"]) / max(applied, 1),
            "steps_per_sec": steps / elapsed,
            "tokens_per_sec": float(sums["real_tokens"]) / elapsed,
            "padded_tokens_per_sec": float(sums["padded_tokens"]) / elapsed,
            "fill": float(sums["real_tokens"]) / max(float(sums["padded_tokens"]), 1),
            "eta_seconds": (self.total_steps - step) * elapsed / steps,
            **extra,
        }
        if self.active:
            self.write(out, step=step, epoch=epoch)
            if self._overall is not None:
                self._overall.set_postfix(
                    loss=f"{out['loss']:.3f}",
                    tau=f"{out['tau_train']:.2f}",
                    tok_s=f"{out['tokens_per_sec']:.0f}",
                    pad_tok_s=f"{out['padded_tokens_per_sec']:.0f}",
                    refresh=False,
                )
            else:
                log.info("step %d/%d: %s", step, self.total_steps, _format(out))
        return out

    def write(self, values: dict[str, Any], *, step: int, epoch: int, kind: str = "train") -> None:
        """One JSONL line plus scalars under `kind/` in TensorBoard and W&B."""
        if not self.active:
            return
        self._jsonl.write(
            json.dumps({"kind": kind, "step": step, "epoch": epoch, "time": time.time(), **values}) + "\n"
        )
        scalars = {f"{kind}/{k}": v for k, v in values.items() if isinstance(v, (int, float))}
        if self._tensorboard is not None:
            for k, v in scalars.items():
                self._tensorboard.add_scalar(k, v, step)
            self._tensorboard.flush()
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def close(self) -> None:
        if not self.active:
            return
        for bar in (self._epoch_bar, self._overall):
            if bar is not None:
                bar.close()
        self._jsonl.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._wandb is not None:
            self._wandb.finish()


def _start_wandb(project: str, workdir: Workdir, run_config: dict):
    try:
        import wandb
    except ImportError:
        log.warning("log.wandb is on but wandb is not installed (pip install wandb); not logging to W&B")
        return None
    # The run id is kept in the workdir: a resumed run continues its W&B run, another workdir
    # (even one with the same name elsewhere) never does.
    return wandb.init(project=project, dir=workdir.root, config=run_config, id=workdir.wandb_run_id(), resume="allow")


def _drop_lines_after(path: str, step: int) -> None:
    """Keep only the log lines of steps up to `step` (the checkpoint a run resumes from)."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        lines = f.readlines()
    kept = [line for line in lines if _step_of(line) <= step]
    if len(kept) < len(lines):
        with open(path + ".tmp", "w") as f:
            f.writelines(kept)
        os.replace(path + ".tmp", path)


def _step_of(line: str) -> float:
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return float("inf")  # a line cut by a crash


def _format(values: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items())
