"""bench/device_check.sh --tiny runs on CPU and prints one JSON line with every figure."""

from __future__ import annotations

import json
import pathlib
import subprocess

import pytest

pytestmark = pytest.mark.slow  # the device check's script, on CPU

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_device_check_tiny_prints_one_json_line():
    result = subprocess.run(
        [
            "bash",
            str(ROOT / "bench" / "device_check.sh"),
            "--tiny",
            "--compile_for=h200",
            "--parts=parity,step,predict,decode",
        ],
        capture_output=True,
        text=True,
        timeout=1200,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1, result.stdout
    report = json.loads(lines[0])
    assert report["shapes"] == "tiny" and report["attention_auto"] == "xla"
    parity = report["parity"]
    assert set(parity) == {"fused_float32", "fused_bfloat16", "xla_bfloat16"}
    for name, errors in parity.items():
        assert set(errors) == {"target_features", "drafter_hidden", "drafter_grads"}
        bound = 1e-4 if name.endswith("float32") else 5e-2  # relative to the fp32 XLA reference
        assert all(0 <= e < bound for e in errors.values()), (name, errors)
    step = report["train_step"]
    for impl in ("fused", "xla"):
        assert step[impl]["tokens_per_s"] > 0 and step[impl]["model_tflop_per_step"] > 0
        assert step[impl]["mfu"] is None  # no known peak for a CPU
        # the roofline estimate for this CPU (measured) beside the measured step
        assert step[impl]["predicted_step_s"] > 0 and step[impl]["predicted_over_measured"] > 0
        # what XLA:GPU, compiling the same step for an H200 without one, predicts beside it
        assert step[impl]["compiled_for"] == "h200"
        assert step[impl]["compiled_peak_memory_gb"] > 0 and step[impl]["compiled_step_s"] > 0
    # the predict part (no step run) compiles the same two programs: the same figures
    for impl in ("fused", "xla"):
        predicted = report["predict"][impl]
        assert predicted == {k: step[impl][k] for k in predicted}, (predicted, step[impl])
    assert report["matmul_peak_tflops"] > 0
    assert report["decode"]["cost_ratio"] > 0
