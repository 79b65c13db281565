r"""Train a DFlash drafter against a frozen target LLM.

    python train.py                                     # configs/default.py: tiny, CPU, minutes
    python train.py --config=configs/qwen3.py:8b --config.target.path=Qwen/Qwen3-8B \
        --config.data.train=/data/train.jsonl --config.workdir=/ckpt/run1

target.path is a model directory or a Hugging Face hub id (org/name[@revision], through the hub
cache). Any field can be overridden (`--config.train.learning_rate=3e-4`); every field, its
default and its meaning are in the section dataclasses of dflash_jax/training/sections.py (the
data section: dflash_jax/data/settings.py). Rerunning with the same workdir resumes. Exit status:
0 finished, 1 error, 75 stopped on request after saving (rerun to resume); see dflash_jax/cli.py.
"""

import os

import jax

from dflash_jax import cli
from dflash_jax.training import run_config
from dflash_jax.training.acceptance_eval import final_evaluation
from dflash_jax.training.loop import train
from dflash_jax.training.mesh import initialize_distributed
from dflash_jax.training.summary import summary

_CONFIG = cli.define_config(os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "default.py"))


def main(argv) -> int:  # cli.run has refused stray arguments already
    config = _CONFIG.value
    dist = run_config.resolve_distributed(config)
    initialize_distributed(dist.coordinator_address, dist.num_processes, dist.process_id)
    setup = run_config.resolve(config, num_devices=jax.device_count())  # before anything touches disk
    outcome = train(setup)
    if not outcome.finished:
        if jax.process_index() == 0:
            print(
                f"stopped at step {outcome.step} of {outcome.total_steps} after saving a checkpoint; "
                "run the same command again to resume"
            )
        return cli.EXIT_STOPPED
    if jax.process_index() == 0:
        print(summary(setup.workdir, final_evaluation(setup), already_finished=outcome.already_finished))
    return 0


if __name__ == "__main__":
    cli.run(main)
