"""Train a DFlash drafter against a frozen target LLM.

    python train.py                                     # configs/default.py: tiny, CPU, minutes
    python train.py --config=configs/qwen3_8b.py --config.target.path=/models/Qwen3-8B \
        --config.data.train=/data/train.jsonl --config.workdir=/ckpt/run1

Any field can be overridden (`--config.train.learning_rate=3e-4`); rerunning with the same
workdir resumes. Config files take variants after a colon (`configs/qwen3_8b.py:b10`).
"""

import logging
import os
import sys

import jax
from absl import app
from ml_collections import config_flags

from dflash_jax.training import summary
from dflash_jax.training.config import ConfigError
from dflash_jax.training.loop import NonFiniteError, train
from dflash_jax.training.mesh import initialize_distributed
from dflash_jax.training.workdir_lock import WorkdirBusyError

_CONFIG = config_flags.DEFINE_config_file(
    "config", os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "default.py"),
    "Training config file (configs/*.py), optionally with a variant: file.py:variant.",
    lock_config=True,
)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    config = _CONFIG.value
    # JAX, Orbax and grain log every backend probe, save and read at INFO; keep ours, not theirs.
    for name in ("absl", "jax"):
        logging.getLogger(name).setLevel(logging.WARNING)
    initialize_distributed(
        config.distributed.coordinator_address, config.distributed.num_processes,
        config.distributed.process_id,
    )
    already_finished = os.path.isfile(os.path.join(summary.export_dir(config.workdir), "config.json"))
    try:
        train(config)
    except ConfigError as e:
        sys.exit(f"config error: {e}")
    except NonFiniteError as e:
        sys.exit(f"training stopped: {e}")
    except WorkdirBusyError as e:
        sys.exit(f"cannot start: {e}")
    # The export is written only when the last step is done; a run stopped early has none.
    if jax.process_index() == 0 and os.path.isfile(os.path.join(summary.export_dir(config.workdir), "config.json")):
        print(summary.summary(config, summary.final_evaluation(config), already_finished=already_finished))


if __name__ == "__main__":
    app.run(main)
