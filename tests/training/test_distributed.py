"""Two local processes (2 simulated CPU devices each) train one drafter with jax.distributed, and
reach the parameters one process with 4 devices reaches."""

from __future__ import annotations

import json
import socket

import jax
import numpy as np
import pytest

from dflash_jax.training.drafters import restore_params
from dflash_jax.training.workdir import Workdir
from support import training_runs as testing

pytestmark = pytest.mark.slow  # two training processes

STEPS = 12  # one epoch of the tiny run
# Measured: at most 1.4e-6 apart after 12 steps, with weights of order 0.01-1.
TOLERANCE = 1e-5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


RUN = {"train.num_epochs": 1, "checkpoint.every_steps": 6}


def test_two_processes_train_together(tiny_run, compilation_cache, tmp_path):
    env = testing.subprocess_env(compilation_cache, devices=2)
    coordinator = f"127.0.0.1:{free_port()}"
    workdir = tmp_path / "run"
    procs = []
    try:
        for process_id in range(2):
            fields = testing.overrides(
                tiny_run,
                workdir,
                **RUN,
                **{
                    "distributed.coordinator_address": coordinator,
                    "distributed.num_processes": 2,
                    "distributed.process_id": process_id,
                },
            )
            procs.append(testing.start_training(fields, env, tmp_path / f"process{process_id}.log"))
        outputs = [testing.finish(p, tmp_path / f"process{i}.log", timeout=300) for i, p in enumerate(procs)]
    finally:
        for p in procs:
            if p.poll() is None:
                testing.kill(p)
    for p, output in zip(procs, outputs):
        assert p.returncode == 0, output[-3000:]
    assert "4 devices" in outputs[0] and "2 processes" in outputs[0]
    steps = [
        json.loads(line)["step"]
        for line in (workdir / "metrics.jsonl").read_text().splitlines()
        if json.loads(line)["kind"] == "train"
    ]
    assert steps == list(range(1, STEPS + 1))  # written once, by process 0
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["12", "6"]
    assert (workdir / "export" / "model.safetensors").is_file()

    # The same run in one process over the same 4 devices: the same rows in the same places, so
    # the same parameters. Not bitwise: XLA:CPU's cross-process all-reduce sums in another order
    # than its in-process one, and 12 updates carry that float32 rounding along.
    single = tmp_path / "single"
    log = tmp_path / "single.log"
    proc = testing.start_training(
        testing.overrides(tiny_run, single, **RUN), testing.subprocess_env(compilation_cache, devices=4), log
    )
    assert testing.finish(proc, log, timeout=300) and proc.returncode == 0, log.read_text()[-3000:]
    two = jax.device_get(restore_params(Workdir.at(str(workdir)))[1])
    one = jax.device_get(restore_params(Workdir.at(str(single)))[1])
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=TOLERANCE), two, one)
