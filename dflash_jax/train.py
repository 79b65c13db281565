r"""Train a DFlash drafter against a frozen target LLM.

    dflash-jax train                                    # configs/default.py: tiny, CPU, minutes
    dflash-jax train --config=configs/qwen3.py:8b --config.target.path=Qwen/Qwen3-8B \
        --config.data.train=/data/train.jsonl --config.workdir=/ckpt/run1

(`python train.py` in a checkout is the same command.) target.path is a model directory or a
Hugging Face hub id (org/name[@revision], through the hub cache). Any field can be overridden
(`--config.train.learning_rate=3e-4`); `--print_config` prints every field with its value and
meaning, and `dflash-jax list-configs` the bundled config files and their variants. Rerunning
with the same workdir resumes. Exit status: 0 finished, 1 error, 75 stopped on request after
saving (rerun to resume).
"""

from __future__ import annotations

import jax
from absl import flags

from dflash_jax import bundled, cli
from dflash_jax.training.acceptance_eval import final_evaluation
from dflash_jax.training.config import run_config
from dflash_jax.training.loop import train
from dflash_jax.training.mesh import initialize_distributed
from dflash_jax.training.summary import summary


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    cli.define_config(str(bundled.DEFAULT_CONFIG), flag_values=flag_values)


def main(argv, f: flags.FlagValues = flags.FLAGS) -> int:  # cli.run has refused stray arguments already
    del argv
    config = f.config
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
        evaluation = final_evaluation(setup)
        print(summary(setup.workdir, setup.drafter.kind_spec, evaluation, already_finished=outcome.already_finished))
    return 0


def run() -> None:
    """The command: `dflash-jax train`, or `python train.py` in a checkout."""
    cli.run(main, define_flags)


if __name__ == "__main__":
    run()
