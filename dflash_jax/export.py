"""Export a trained drafter in the DESIGN §2 format (what SGLang / vLLM load).

    python -m dflash_jax.export --workdir=runs/default [--step=N] [--out=DIR] [--dtype=bfloat16]

reads the latest (or given) checkpoint of a training run and writes `config.json` +
`model.safetensors` to `<workdir>/export/` (or --out). Training does the same at its end.
"""

from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp
from flax import nnx
from jax.experimental import multihost_utils

from dflash_jax.models.config import DTYPES, DrafterConfig
from dflash_jax.models.hf import export_drafter
from dflash_jax.training.checkpoint import RunCheckpoints
from dflash_jax.training.mesh import make_mesh
from dflash_jax.training.step import (
    OptimizerConfig,
    abstract_train_state,
    drafter_graph,
    make_optimizer,
)


def export_params(cfg: DrafterConfig, params: nnx.State, out_dir: str, *, dtype=jnp.bfloat16) -> str:
    """Gathers (possibly multi-host sharded) drafter weights; process 0 writes the export."""
    host_params = multihost_utils.process_allgather(params, tiled=True)
    if jax.process_index() == 0:
        export_drafter(nnx.merge(drafter_graph(cfg, jnp.float32), host_params), out_dir, dtype=dtype)
    return out_dir


def restore_params(workdir: str, step: int | None = None) -> tuple[DrafterConfig, nnx.State]:
    """The drafter config and weights of a run's checkpoint (default: the latest)."""
    checkpoints = RunCheckpoints(workdir, every_steps=1, keep=None, async_save=False)
    try:
        step = checkpoints.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {checkpoints.directory}")
        cfg = DrafterConfig.from_hf(checkpoints.restore_meta(step)["drafter_config"])
        # Only the structure of the optimizer state matters for restoring, not its schedule.
        abstract = abstract_train_state(
            cfg, make_optimizer(OptimizerConfig(), 1), seed=0, compute_dtype=jnp.float32,
            mesh=make_mesh(-1, 1),
        )
        return cfg, checkpoints.restore_state(step, abstract).params
    finally:
        checkpoints.close()


def export_checkpoint(workdir: str, *, step: int | None = None, out_dir: str | None = None, dtype=jnp.bfloat16) -> str:
    cfg, params = restore_params(workdir, step)
    return export_params(cfg, params, out_dir or os.path.join(workdir, "export"), dtype=dtype)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", required=True, help="the training run's workdir")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    parser.add_argument("--out", default=None, help="output directory (default: <workdir>/export)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    args = parser.parse_args(argv)
    out = export_checkpoint(args.workdir, step=args.step, out_dir=args.out, dtype=DTYPES[args.dtype])
    print(f"exported drafter to {out}")


if __name__ == "__main__":
    main()
