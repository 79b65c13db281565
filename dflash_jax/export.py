"""Export a training run's drafter in the serving format (docs/design.md §5).

    dflash-jax export --workdir=runs/default [--step=N] [--output=DIR] [--dtype=bfloat16]

reads the latest (or given) checkpoint of a training run and writes `config.json` +
`model.safetensors` to `<workdir>/export/` (or --output). Training does the same at its end.
The README ("Serving") gives the SGLang and vLLM commands that serve it.
"""

from __future__ import annotations

from absl import flags

from dflash_jax import cli
from dflash_jax.errors import UserError
from dflash_jax.models.architecture import DTYPES
from dflash_jax.training.drafters import export_checkpoint
from dflash_jax.training.workdir import Workdir

RENAMED_FLAGS = {"out": "output"}


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    fv = dict(flag_values=flag_values)
    flags.DEFINE_string("workdir", None, "The training run's workdir.", **fv)
    flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).", **fv)
    flags.DEFINE_string("output", None, "Output directory (default: <workdir>/export).", **fv)
    flags.DEFINE_enum("dtype", "bfloat16", sorted(DTYPES), "Dtype of the exported weights.", **fv)
    flags.mark_flags_as_required(["workdir"], **fv)


def main(argv, f: flags.FlagValues = flags.FLAGS):
    del argv
    workdir = Workdir.at(f.workdir)
    if not workdir.has_checkpoints():  # checked here: opening the checkpoints would create the directory
        raise UserError(f"--workdir={f.workdir}: not a training workdir (no {workdir.checkpoints})")
    out = export_checkpoint(workdir, step=f.step, out_dir=f.output, dtype=DTYPES[f.dtype])
    print(f"exported drafter to {out}")


def run() -> None:
    """The command: `dflash-jax export`, or `python -m dflash_jax.export`."""
    cli.run(main, define_flags, renamed=RENAMED_FLAGS)


if __name__ == "__main__":
    run()
