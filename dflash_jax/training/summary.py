"""The closing summary of a finished run: how well the exported drafter drafts, and where it is."""

from __future__ import annotations

from dflash_jax.decoding import report
from dflash_jax.models.kind import Kind
from dflash_jax.training.workdir import Workdir

REAL_MODEL_COMMAND = (
    "dflash-jax train --config=configs/qwen3.py:8b --config.target.path=Qwen/Qwen3-8B \\\n"
    "    --config.data.train=/data/train.jsonl --config.workdir=/ckpt/run1"
)


def summary(workdir: Workdir, kind: Kind, evaluation: dict | None, *, already_finished: bool) -> str:
    lines = ["", "=" * 72]
    lines.append("dflash_jax: this run had already finished" if already_finished else "dflash_jax: training finished")
    if evaluation is not None:
        lines += ["", report.table(evaluation["sets"])]
        for name, result in evaluation["sets"].items():
            lines.append(
                f"{name}: acceptance length tau = {result['tau']:.2f} (block size "
                f"{evaluation['run']['block_size']}), DFlash vs target alone: {result['speedup']:.2f}x"
            )
        lines.append(f"evaluation: {workdir.eval} (eval.json, eval.png)")
    lines += [
        f"drafter export: {workdir.export} ({kind.served_by()})",
        "",
        "the same with a real Qwen3 checkpoint:",
        "    " + REAL_MODEL_COMMAND,
        "=" * 72,
    ]
    return "\n".join(lines)
