"""colab/quickstart.ipynb: committed clean, its real-model section guarded, and it runs end to end.

The run executes the notebook in a fresh kernel (nbclient) with tiny parameters injected after
its `parameters` cell, the way papermill would, and with the cells tagged `skip-in-test` (the
real-Qwen3 section: downloads, GPU training) dropped.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import nbformat
import pytest

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "colab" / "quickstart.ipynb"
SKIP_TAG = "skip-in-test"
MAX_STEPS = 4


def read_notebook() -> nbformat.NotebookNode:
    return nbformat.read(NOTEBOOK, as_version=4)


def tags(cell) -> list[str]:
    return cell.get("metadata", {}).get("tags", [])


def test_committed_notebook_is_clean_and_its_real_model_section_is_guarded():
    nb = read_notebook()
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code), "strip the notebook's outputs"
    assert [tags(c) for c in code].count(["parameters"]) == 1

    skipped = [c for c in code if SKIP_TAG in tags(c)]
    assert skipped, f"the real-Qwen3 section must be tagged {SKIP_TAG!r}"
    assert re.search(r"^RUN_REAL_MODEL = False\b", skipped[0].source, re.M)
    for cell in skipped:
        assert "if RUN_REAL_MODEL:" in cell.source, f"unguarded real-model cell:\n{cell.source}"
    # The skipped cells never run here: at least check that IPython can compile them.
    from IPython.core.inputtransformer2 import TransformerManager

    transformer = TransformerManager()
    for cell in skipped:
        compile(transformer.transform_cell(cell.source), "<skip-in-test cell>", "exec")


def kernel_env() -> dict:
    env = dict(os.environ)
    env.pop("MPLBACKEND", None)  # the kernel's inline backend must draw the figures
    env.update(
        JAX_PLATFORMS="cpu",
        # One device (a run may have set a multi-device XLA_FLAGS), and compiling without LLVM
        # optimization: the tiny model does not need it, and compilation is the test's main cost.
        XLA_FLAGS="--xla_backend_optimization_level=0",
        PYTHONUNBUFFERED="1",
    )
    return env


def text_of(outputs) -> str:
    parts = []
    for out in outputs:
        if out.output_type == "stream":
            parts.append(out.text)
        elif out.output_type in ("execute_result", "display_data"):
            parts.append(out.data.get("text/plain", ""))
    return "".join(parts)


@pytest.mark.slow
def test_quickstart_notebook_runs_end_to_end(tmp_path):
    from nbclient import NotebookClient

    nb = read_notebook()
    nb.cells = [c for c in nb.cells if SKIP_TAG not in tags(c)]
    params = next(i for i, c in enumerate(nb.cells) if "parameters" in tags(c))
    workdir = tmp_path / "run"
    injected = nbformat.v4.new_code_cell(
        f"MAX_STEPS = {MAX_STEPS}\nWORKDIR = {str(workdir)!r}\nEVAL_PROMPTS = 2\nMAX_NEW_TOKENS = 16\n"
        f"DATA_CACHE_DIR = {str(tmp_path / 'tokenized')!r}"
    )
    injected.metadata["tags"] = ["injected-parameters"]
    nb.cells.insert(params + 1, injected)

    client = NotebookClient(
        nb,
        timeout=900,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute(env=kernel_env())  # raises CellExecutionError, with the traceback, if a cell fails

    outputs = [out for c in nb.cells if c.cell_type == "code" for out in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = text_of(outputs)

    # Training ran in the temporary workdir, logged every step and exported the drafter.
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == list(range(1, MAX_STEPS + 1))
    export = json.loads((workdir / "export" / "config.json").read_text())
    assert export["architectures"] == ["DFlash2DraftModel"]  # the default kind
    assert f"step {MAX_STEPS}: loss" in text

    # τ printed, within 1..B; the figures drawn (training curves, acceptance plots).
    tau = re.search(r"τ = (\d+\.\d+) tokens per target forward pass", text)
    assert tau, text
    assert 1.0 <= float(tau.group(1)) <= export["block_size"]
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) >= 2

    # The step-by-step decode as HTML, and the lossless check.
    html = "".join(o.data["text/html"] for o in outputs if "text/html" in o.get("data", {}))
    assert 'class="dflash-decode"' in html
    steps = re.search(r"in 1 prefill \+ (\d+) verification steps", text)
    assert steps, text
    assert html.count('title="step:') == int(steps.group(1))
    assert "lossless check passed" in text


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
