"""Load a drafter for decoding from an export directory or from a training workdir.

An export directory (`config.json` + `model.safetensors`, DESIGN §2, ours or a released one)
is read by `models.hf.load_drafter`. A training workdir is restored from its Orbax checkpoint
and cast to `param_dtype` exactly as `export` casts, so a workdir and its bf16 export decode
with identical weights.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from flax import nnx

from dflash_jax.models.drafter import DFlashDrafter
from dflash_jax.models.hf import load_drafter


def is_export_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "config.json"))


def is_workdir(path: str) -> bool:
    return os.path.isdir(os.path.join(path, "checkpoints"))


def load_any_drafter(path: str, *, step: int | None = None, param_dtype=jnp.bfloat16,
                     compute_dtype=jnp.bfloat16) -> DFlashDrafter:
    if is_export_dir(path):
        if step is not None:
            raise ValueError(f"{path} is an export directory; a checkpoint step only applies to workdirs")
        return load_drafter(path, param_dtype=param_dtype, compute_dtype=compute_dtype)
    if is_workdir(path):
        return restore_workdir_drafter(path, step=step, param_dtype=param_dtype, compute_dtype=compute_dtype)
    raise FileNotFoundError(
        f"{path} is neither a drafter export directory (config.json + model.safetensors) nor a "
        "training workdir (checkpoints/)"
    )


def restore_workdir_drafter(workdir: str, *, step: int | None, param_dtype, compute_dtype) -> DFlashDrafter:
    """The drafter of a workdir's latest (or given) checkpoint."""
    # Training modules pull in Orbax and Grain; only workdir inputs need them.
    from dflash_jax.export import restore_params

    cfg, params = restore_params(workdir, step)
    graphdef, _ = nnx.split(nnx.eval_shape(
        lambda: DFlashDrafter(cfg, param_dtype=param_dtype, compute_dtype=compute_dtype, rngs=nnx.Rngs(0))
    ))
    return nnx.merge(graphdef, jax.tree.map(lambda x: x.astype(param_dtype), params))
