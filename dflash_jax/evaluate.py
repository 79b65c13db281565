r"""Measure a DFlash drafter as a serving engine would: acceptance length and speed-up.

    python -m dflash_jax.evaluate --target=assets/tiny-qwen3 --drafter=runs/default/export \
        [--prompts=heldout_prompts,my_prompts.jsonl] [--num_prompts=32] [--max_new_tokens=256] \
        [--batch_size=1] [--temperature=0] [--out_dir=eval_results]
    python -m dflash_jax.evaluate --target=Qwen/Qwen3-8B --drafter=z-lab/Qwen3-8B-DFlash-b16 \
        --prompts=gsm8k,math500,humaneval,mbpp,mt-bench

--target is a Hugging Face model directory or hub id (org/name[@revision], from the hub cache:
HF_HUB_OFFLINE=1 works once it is there). --drafter is an export directory or hub id (ours or a
released DFlash drafter) or a training workdir (latest checkpoint, or --drafter_step). --prompts
lists bundled held-out sets (heldout_prompts, stdlib_heldout), JSONL files of chat rows, and the
standard benchmarks gsm8k, math500, humaneval, mbpp and mt-bench (multi-turn), read from the hub
cache in their published formats, or NAME=PATH for a local copy of one (e.g.
gsm8k=test-00000-of-00001.parquet). For every set, the same prompts are decoded by DFlash
speculative decoding and by the target alone (block size 1), after compiling both, and the run
reports τ (mean acceptance length), its histogram, per-slot acceptance rates, tokens/s, time per
output token and the speed ratio: a table on the terminal, `eval.json` and `eval.png` in
--out_dir.
"""

from __future__ import annotations

from absl import flags

from dflash_jax import cli
from dflash_jax.decoding import report
from dflash_jax.decoding.evaluation import write_outputs
from dflash_jax.decoding.sampling import SamplingConfig
from dflash_jax.errors import UserError
from dflash_jax.models.config import DTYPES
from dflash_jax.models.hub import resolve_model
from dflash_jax.training.evaluation import run_evaluation


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """The CLI's flags; defined when run as a program (tests use their own FlagValues, since
    several CLIs share flag names)."""
    fv = dict(flag_values=flag_values)
    flags.DEFINE_string(
        "target", None, "Hugging Face target directory or hub id org/name[@revision] (weights, tokenizer).", **fv
    )
    flags.DEFINE_string("drafter", None, "Drafter export directory or hub id, or a training workdir.", **fv)
    flags.DEFINE_integer("drafter_step", None, "Checkpoint step when --drafter is a workdir (default: latest).", **fv)
    flags.DEFINE_list(
        "prompts",
        ["heldout_prompts"],
        "Bundled sets (heldout_prompts, stdlib_heldout), chat JSONL paths, benchmarks (gsm8k, math500, "
        "humaneval, mbpp, mt-bench) or NAME=PATH for a local copy of a benchmark.",
        **fv,
    )
    flags.DEFINE_integer("num_prompts", 0, "Prompts per set (0: all).", **fv)
    flags.DEFINE_integer("max_new_tokens", 256, "Tokens generated per prompt at most (stop tokens end earlier).", **fv)
    flags.DEFINE_integer("batch_size", 1, "Prompts decoded together (speed-ups are usually quoted at 1).", **fv)
    flags.DEFINE_float("temperature", 0.0, "0: greedy (lossless); > 0: rejection sampling.", **fv)
    flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass (1: off).", **fv)
    flags.DEFINE_integer("top_k", 0, "Top-k sampling (0: off).", **fv)
    flags.DEFINE_integer("seed", 0, "Sampling seed.", **fv)
    flags.DEFINE_bool("enable_thinking", False, "Render prompts with thinking enabled (Qwen3 templates).", **fv)
    flags.DEFINE_enum("dtype", "bfloat16", sorted(DTYPES), "Weight and compute dtype of both models.", **fv)
    flags.DEFINE_string("out_dir", "eval_results", "Where eval.json and eval.png are written.", **fv)
    flags.mark_flags_as_required(["target", "drafter"], **fv)


def main(argv, f: flags.FlagValues = flags.FLAGS):
    del argv
    if f.max_new_tokens < 1 or f.batch_size < 1 or f.num_prompts < 0:
        raise UserError("--max_new_tokens and --batch_size must be >= 1, --num_prompts >= 0")
    try:
        sampling = SamplingConfig(f.temperature, top_p=f.top_p, top_k=f.top_k)
    except ValueError as e:
        raise UserError(str(e)) from None
    evaluation = run_evaluation(
        str(_model(f.target, "--target")),
        str(_model(f.drafter, "--drafter")),
        f.prompts,
        drafter_step=f.drafter_step,
        num_prompts=f.num_prompts,
        max_new_tokens=f.max_new_tokens,
        batch_size=f.batch_size,
        sampling=sampling,
        enable_thinking=f.enable_thinking,
        dtype=DTYPES[f.dtype],
        seed=f.seed,
    )
    write_outputs(evaluation, f.out_dir)
    print(report.table(evaluation["sets"]))
    print(f"wrote {f.out_dir}/eval.json and {f.out_dir}/eval.png")


def _model(spec: str, flag: str):
    try:
        return resolve_model(spec)
    except UserError as e:
        raise UserError(f"{flag}={e}") from None


if __name__ == "__main__":
    define_flags()
    cli.run(main)
