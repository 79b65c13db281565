"""The closing summary of a finished run: how well the exported drafter drafts, and where it is.

The acceptance length and the DFlash / target-alone speed ratio are measured on the eval prompts
by `dflash_jax.evaluate` (real speculative decoding against the target) and kept in
`<workdir>/eval/`; a rerun of a finished run reads them back instead of decoding again.
"""

from __future__ import annotations

import json
import os

import ml_collections

from dflash_jax.decoding import report
from dflash_jax.evaluate import run_evaluation, write_outputs

REAL_MODEL_COMMAND = (
    "python train.py --config=configs/qwen3_8b.py --config.target.path=/models/Qwen3-8B \\\n"
    "    --config.data.train=/data/train.jsonl --config.workdir=/ckpt/run1"
)


def export_dir(workdir: str) -> str:
    return os.path.join(os.path.abspath(workdir), "export")


def final_evaluation(config: ml_collections.ConfigDict) -> dict | None:
    """Evaluate the final export on `config.eval.prompts` (None when there are no eval prompts)."""
    if not config.eval.prompts:
        return None
    export = export_dir(config.workdir)
    out_dir = os.path.join(os.path.abspath(config.workdir), "eval")
    saved = os.path.join(out_dir, "eval.json")
    weights = os.path.join(export, "model.safetensors")
    if os.path.isfile(saved) and os.path.getmtime(saved) >= os.path.getmtime(weights):
        with open(saved) as f:
            return json.load(f)
    evaluation = run_evaluation(
        config.target.path, export, [config.eval.prompts], num_prompts=config.eval.num_prompts,
        max_new_tokens=config.eval.max_new_tokens, dtype=config.target.dtype,
        enable_thinking=config.data.enable_thinking,
    )
    write_outputs(evaluation, out_dir)
    return evaluation


def summary(config: ml_collections.ConfigDict, evaluation: dict | None, *, already_finished: bool) -> str:
    lines = ["", "=" * 72]
    lines.append("dflash_jax: this run had already finished" if already_finished else "dflash_jax: training finished")
    if evaluation is not None:
        lines += ["", report.table(evaluation["sets"])]
        for name, result in evaluation["sets"].items():
            lines.append(
                f"{name}: acceptance length tau = {result['tau']:.2f} (block size "
                f"{evaluation['run']['block_size']}), DFlash vs target alone: {result['speedup']:.2f}x"
            )
        lines.append(f"evaluation: {os.path.join(os.path.abspath(config.workdir), 'eval')} (eval.json, eval.png)")
    lines += [
        f"drafter export (SGLang / vLLM / DFlash format): {export_dir(config.workdir)}",
        "",
        "the same with a real Qwen3 checkpoint:",
        "    " + REAL_MODEL_COMMAND,
        "=" * 72,
    ]
    return "\n".join(lines)
