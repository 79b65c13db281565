"""Monitoring: rates and ETA over a log window, the JSONL log, TensorBoard events."""

from __future__ import annotations

import json
import sys

import numpy as np

from dflash_jax.training import monitoring
from dflash_jax.training.config.run_config import LogSettings
from dflash_jax.training.workdir import Workdir


def step_metrics(real_tokens: float, applied: bool = True) -> dict:
    return {
        "weighted_ce": np.float32(6.0 if applied else 0.0),
        "weight": np.float32(3.0 if applied else 0.0),
        "slot_hits": np.asarray([1.0, 0.0], np.float32),
        "slot_scored": np.asarray([2.0, 2.0], np.float32),
        "tau_sum": np.float32(3.0),
        "blocks": np.float32(2.0),
        "grad_norm_sum": np.float32(0.5 if applied else 0.0),
        "updates_applied": np.float32(applied),
        "real_tokens": np.float32(real_tokens),
        "padded_tokens": np.float32(100.0),
    }


def test_window_rates_eta_and_logs(tmp_path, monkeypatch):
    clock = iter([10.0, 12.0])  # construction, then the flush: 2 s for 4 steps
    monkeypatch.setattr(monitoring.time, "perf_counter", lambda: next(clock))
    monitor = monitoring.Monitor(
        Workdir.at(str(tmp_path)),
        LogSettings(every_steps=1, progress_bars=True, tensorboard=True, wandb=False, wandb_project=""),
        total_steps=10,
        start_step=0,
        run_config={},
    )
    monitor.start_epoch(
        0, step=0, steps_in_epoch=7, step_in_epoch=0, stats={"packing_fill": 0.97, "skipped_samples": 3}
    )
    for tokens, applied in [(90, True), (80, True), (70, False), (60, True)]:
        monitor.record(step_metrics(tokens, applied))
    out = monitor.flush(4, 0, {"learning_rate": 1e-3})
    monitor.close()

    assert out["steps_per_sec"] == 2.0
    assert out["tokens_per_sec"] == 150.0 and out["padded_tokens_per_sec"] == 200.0
    assert out["eta_seconds"] == 3.0  # 6 steps left at 2 steps/s, whatever the epochs' lengths
    assert out["loss"] == 2.0 and out["grad_norm"] == 0.5  # the skipped step does not count
    assert out["tau_train"] == 1.5 and out["acc_slot_1"] == 0.5 and out["acc_slot_2"] == 0.0
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(line["kind"], line["step"]) for line in lines] == [("epoch", 0), ("train", 4)]
    assert lines[0]["packing_fill"] == 0.97 and lines[0]["skipped_samples"] == 3
    assert lines[1]["learning_rate"] == 1e-3
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_wandb_without_the_package_only_warns(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    monitor = monitoring.Monitor(
        Workdir.at(str(tmp_path)),
        LogSettings(every_steps=1, progress_bars=False, tensorboard=False, wandb=True, wandb_project="p"),
        total_steps=1,
        start_step=0,
        run_config={},
    )
    monitor.close()
    assert "wandb is not installed" in caplog.text
