"""Export a training run's drafter in the serving format (docs/design.md §5).

    dflash-jax export --workdir=runs/default [--step=N] [--output=DIR] [--dtype=bfloat16]
    dflash-jax export --workdir=runs/default --format=gguf [--target=FILE.gguf] [--draft_vocab=2048]

reads the latest (or given) checkpoint of a training run and writes `config.json` +
`model.safetensors` to `<workdir>/export/` (or --output). Training does the same at its end.
--format=gguf also writes `drafter.gguf` there, the file llama.cpp's `llama-server` loads beside
the GGUF --target (the kind's `--spec-type`, models/formats/gguf_export.py), with
that target's vocabulary (default --target: the run's own); a Hugging Face Qwen3 or Llama target (the
default run's tiny-qwen3) is first written beside it as `target.gguf` (models/formats/gguf_target.py).
--draft_vocab=N gives that file its own LM head of the N tokens training used most (the export's
token_frequencies.json) and llama.cpp's `d2t` map: the engine drafts as `evaluate --draft_vocab=N`.
The README ("Serving") gives the llama.cpp, SGLang and vLLM commands.
"""

from __future__ import annotations

import os
from pathlib import Path

from absl import flags

from dflash_jax import cli
from dflash_jax.decoding.draft_vocab import draft_token_ids
from dflash_jax.errors import UserError
from dflash_jax.models import families
from dflash_jax.models.architecture import DTYPES
from dflash_jax.models.drafter_format import kind_of
from dflash_jax.models.formats.gguf_export import llama_cpp_problems, served_kind, write_drafter_gguf
from dflash_jax.models.formats.gguf_target import served_gguf
from dflash_jax.models.formats.hf import read_config, replace_problem
from dflash_jax.models.formats.hub import resolve_model
from dflash_jax.training.drafters import export_checkpoint, run_meta
from dflash_jax.training.workdir import Workdir, check_writable, existing_workdir

RENAMED_FLAGS = {"out": "output"}


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    fv = dict(flag_values=flag_values)
    flags.DEFINE_string("workdir", None, "The training run's workdir.", **fv)
    flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).", **fv)
    flags.DEFINE_string("output", None, "Output directory (default: <workdir>/export).", **fv)
    flags.DEFINE_enum("dtype", "bfloat16", sorted(DTYPES), "Dtype of the exported weights.", **fv)
    flags.DEFINE_enum(
        "format", "hf", ["hf", "gguf"], "hf: config.json + model.safetensors; gguf: also drafter.gguf.", **fv
    )
    flags.DEFINE_string(
        "target",
        None,
        "--format=gguf: the target's GGUF file, or a Qwen3 or Llama model written as GGUF (default: the run's target).",
        **fv,
    )
    flags.DEFINE_integer(
        "draft_vocab",
        0,
        "--format=gguf: draft among the N tokens training used most (llama.cpp's reduced draft vocabulary; 0: all).",
        lower_bound=0,
        **fv,
    )
    flags.mark_flags_as_required(["workdir"], **fv)


def main(argv, f: flags.FlagValues = flags.FLAGS):
    del argv
    check_gguf_flags(f)
    workdir = existing_workdir(f.workdir, "--workdir")  # checked here: opening the checkpoints would create it
    if f.output:
        check_writable(f.output, "--output")
    if problem := replace_problem(f.output or workdir.export):
        raise UserError(f"--output={problem}: name a new or empty directory")
    target = _gguf_target(workdir, f) if f.format == "gguf" else None  # its problems, before anything is written
    out = export_checkpoint(workdir, step=f.step, out_dir=f.output, dtype=DTYPES[f.dtype])
    exported = read_config(out)
    print(f"exported drafter to {out} ({kind_of(exported).served_by()})")
    if target is not None:
        target_gguf = served_gguf(target, os.path.join(out, "target.gguf"))
        draft_tokens = draft_token_ids(out, f.draft_vocab) if f.draft_vocab else None
        gguf_file = write_drafter_gguf(out, target_gguf, os.path.join(out, "drafter.gguf"), draft_tokens)
        print(f"wrote {gguf_file} ({served_kind(exported).llama_cpp.spec_type}) for the target {target_gguf}")


def check_gguf_flags(f: flags.FlagValues) -> None:
    """The GGUF file's flags are refused without --format=gguf (they would change nothing)."""
    given = [f"--{name}" for name in ("target", "draft_vocab") if f[name].value != f[name].default]
    if given and f.format != "gguf":
        raise UserError(f"{' and '.join(given)} apply to --format=gguf only (the llama.cpp file)")


def _gguf_target(workdir: Workdir, f: flags.FlagValues) -> Path:
    """--target, or the one the run was trained against, once llama.cpp is known to serve the
    run's drafter (the checkpoint's config.json) beside it."""
    meta = run_meta(workdir, f.step)
    target = resolve_model(f.target or meta["config"]["target"]["path"])
    num_layers = families.target_config(read_config(target)).num_layers
    if problems := llama_cpp_problems(meta["drafter_config"], num_layers):
        raise UserError(f"--format=gguf: llama.cpp cannot serve the drafter of {workdir.root}: {'; '.join(problems)}")
    return target


def run() -> None:
    """The command: `dflash-jax export`, or `python -m dflash_jax.export`."""
    cli.run(main, define_flags, renamed=RENAMED_FLAGS)


if __name__ == "__main__":
    run()
