"""Drafter weights between a run and the serving format: export a run's drafter, load one back.

An export directory is `config.json` + `model.safetensors` (docs/design.md §5), ours or a
released DFlash drafter. A training workdir is read from its Orbax checkpoint and cast to the
requested dtype exactly as the export casts, so a workdir and its export decode identically.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from flax import nnx
from jax.experimental import multihost_utils

from dflash_jax.errors import UserError
from dflash_jax.models.drafter import DFlashDrafter
from dflash_jax.models.drafter_config import DrafterConfig
from dflash_jax.models.formats.hf import SafetensorsReader, export_drafter, load_drafter, read_drafter_config
from dflash_jax.training.checkpoint import RunCheckpoints, ema_decay_of, optimizer_of
from dflash_jax.training.mesh import make_mesh
from dflash_jax.training.optim.ema import served_params
from dflash_jax.training.optim.optimizer import OptimizerConfig, make_optimizer
from dflash_jax.training.step import abstract_train_state, drafter_graph
from dflash_jax.training.workdir import Workdir


def export_params(
    cfg: DrafterConfig, params: nnx.State, out_dir: str, *, dtype=jnp.bfloat16, workdir: Workdir | None = None
) -> str:
    """Gathers (possibly multi-host sharded) drafter weights; process 0 writes the export, with
    the token frequencies of `workdir`'s run (decoding/draft_vocab.py) where it has them."""
    host_params = multihost_utils.process_allgather(params, tiled=True)
    if jax.process_index() == 0:
        drafter = nnx.merge(drafter_graph(cfg, jnp.float32), host_params)
        extra = [workdir.token_frequencies] if workdir else []
        export_drafter(drafter, out_dir, dtype=dtype, extra_files=extra)
    return out_dir


def restore_params(workdir: Workdir, step: int | None = None) -> tuple[DrafterConfig, nnx.State]:
    """The drafter config and fp32 weights of a run's checkpoint (default: the newest readable
    one, training/checkpoint.py): its weight average where the run kept one."""

    def read(step: int) -> tuple[DrafterConfig, nnx.State]:
        meta = checkpoints.restore_meta(step)
        cfg = DrafterConfig.from_hf(meta["drafter_config"])
        # Only the structure of the optimizer state matters for restoring, not its schedule.
        abstract = abstract_train_state(
            cfg,
            make_optimizer(
                OptimizerConfig(optimizer=optimizer_of(meta), ema_decay=ema_decay_of(meta)),
                1,
                cfg.kind_spec.adam_params,
            ),
            seed=0,
            compute_dtype=jnp.float32,
            mesh=make_mesh(-1, 1),
        )
        state = checkpoints.restore_state(step, abstract)
        return cfg, served_params(state.params, state.opt_state)

    checkpoints = RunCheckpoints.reading_only(workdir.checkpoints)
    try:
        return checkpoints.newest_readable(read, step=step)[1]
    finally:
        checkpoints.close()


def run_meta(workdir: Workdir, step: int | None = None) -> dict:
    """The metadata (the run's config, the drafter's config.json) of a run's checkpoint: `step`'s,
    or the newest readable one's."""
    checkpoints = RunCheckpoints.reading_only(workdir.checkpoints)
    try:
        return checkpoints.newest_readable(checkpoints.restore_meta, step=step)[1]
    finally:
        checkpoints.close()


def export_checkpoint(
    workdir: Workdir, *, step: int | None = None, out_dir: str | None = None, dtype=jnp.bfloat16
) -> str:
    cfg, params = restore_params(workdir, step)
    return export_params(cfg, params, out_dir or workdir.export, dtype=dtype, workdir=workdir)


def is_export_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "config.json"))


def load_any_drafter(
    path: str, *, step: int | None = None, param_dtype=jnp.bfloat16, compute_dtype=jnp.bfloat16
) -> DFlashDrafter:
    """A drafter from an export directory or from a training workdir's checkpoint."""
    workdir = _run_holding(path, step)
    if workdir is None:
        return load_drafter(path, param_dtype=param_dtype, compute_dtype=compute_dtype)
    cfg, params = restore_params(workdir, step)
    graphdef, _ = nnx.split(
        nnx.eval_shape(
            lambda: DFlashDrafter(cfg, param_dtype=param_dtype, compute_dtype=compute_dtype, rngs=nnx.Rngs(0))
        )
    )
    return nnx.merge(graphdef, jax.tree.map(lambda x: x.astype(param_dtype), params))


def any_drafter_config(path: str, step: int | None = None) -> DrafterConfig:
    """The config of the drafter `load_any_drafter` loads, read without its weights (an export's
    weights files have their headers checked: a damaged one is one line before any model loads)."""
    workdir = _run_holding(path, step)
    if workdir is None:
        SafetensorsReader(path)
        return read_drafter_config(path)
    return DrafterConfig.from_hf(run_meta(workdir, step)["drafter_config"])


def _run_holding(path: str, step: int | None) -> Workdir | None:
    """The training workdir a drafter path is, or None for an export directory."""
    if is_export_dir(path):
        if step is not None:
            raise UserError(f"{path} is an export directory; a checkpoint step only applies to workdirs")
        return None
    workdir = Workdir.at(path)
    if not workdir.has_checkpoints():
        raise UserError(
            f"{path} is neither a drafter export directory (config.json + model.safetensors) nor a "
            "training workdir (checkpoints/)"
        )
    return workdir
