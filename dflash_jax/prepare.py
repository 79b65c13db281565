r"""Build (or check) the tokenized data cache of a training config, and plan its epochs.

    python -m dflash_jax.prepare --config=configs/qwen3.py:8b \
        --config.target.path=/models/Qwen3-8B --config.data.train=/data/train.jsonl

Training runs the same step itself when the cache is missing or stale; running it beforehand
keeps the tokenization (all CPU cores) off the accelerators' clock. Reads `config.data` and the
tokenizer and chat template in `config.target.path`; prints the cache summary, the rows skipped
by reason, and the steps of each epoch.
"""

from __future__ import annotations

from absl import flags

from dflash_jax import cli
from dflash_jax.data.build import summarize
from dflash_jax.data.pipeline import DataPipeline
from dflash_jax.training.run_config import resolve_data

_CONFIG = cli.define_config()
_REBUILD = flags.DEFINE_bool("rebuild", False, "Rebuild the cache even if it is up to date.")
_NUM_EPOCHS = flags.DEFINE_integer("num_epochs", 1, "Epochs to plan, to print their step counts.", lower_bound=1)


def main(argv):
    del argv
    data_config, target_path = resolve_data(_CONFIG.value)
    data = DataPipeline.from_config(data_config, target_path, rebuild=_REBUILD.value)
    steps = [data.steps_in_epoch(e) for e in range(_NUM_EPOCHS.value)]
    print(f"tokenized cache: {data.cache.directory}")
    print(summarize(data.cache.manifest))
    print(f"steps per epoch ({data_config.global_batch_rows} x {data_config.seq_len}): {steps}, total {sum(steps)}")


if __name__ == "__main__":
    flags.mark_flag_as_required("config")
    cli.run(main)
