"""Build (or check) the tokenized data cache of a training config, and plan its epochs.

    python -m dflash_jax.prepare --config=configs/qwen3.py:8b \
        --config.target.path=/models/Qwen3-8B --config.data.train=/data/train.jsonl

Training runs the same step itself when the cache is missing or stale; running it beforehand
keeps the tokenization (all CPU cores) off the accelerators' clock. Reads `config.data` and the
tokenizer and chat template in `config.target.path`; prints the cache summary, the rows skipped
by reason, and the steps of each epoch.
"""

from __future__ import annotations

from absl import flags
from ml_collections import config_flags

from dflash_jax import cli
from dflash_jax.data.build import summarize
from dflash_jax.data.pipeline import DataPipeline
from dflash_jax.errors import UserError
from dflash_jax.training.config import resolve_data

_CONFIG = config_flags.DEFINE_config_file("config", None, "Training config file.", lock_config=True)
_REBUILD = flags.DEFINE_bool("rebuild", False, "Rebuild the cache even if it is up to date.")
_EPOCHS = flags.DEFINE_integer("epochs", 1, "Epochs to plan, to print their step counts.")


def main(argv):
    del argv
    if _EPOCHS.value < 1:
        raise UserError(f"--epochs={_EPOCHS.value} must be at least 1")
    data_config, target_path = resolve_data(_CONFIG.value)
    data = DataPipeline.from_config(data_config, target_path, rebuild=_REBUILD.value)
    steps = [data.steps_in_epoch(e) for e in range(_EPOCHS.value)]
    print(f"tokenized cache: {data.cache.directory}")
    print(summarize(data.cache.manifest))
    print(f"steps per epoch ({data_config.global_batch_rows} x {data_config.seq_len}): {steps}, total {sum(steps)}")


if __name__ == "__main__":
    flags.mark_flag_as_required("config")
    cli.run(main)
