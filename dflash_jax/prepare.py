"""Build (or check) the tokenized data cache of a training config.

    python -m dflash_jax.prepare --config=configs/qwen3_8b.py \
        --config.target.path=/models/Qwen3-8B --config.data.train=/data/train.jsonl

Training runs the same step itself when the cache is missing or stale; running it beforehand
keeps the tokenization (all CPU cores) off the accelerators' clock. Reads `config.data` and the
tokenizer and chat template in `config.target.path`.
"""

from absl import app, flags
from ml_collections import config_flags

from dflash_jax.data.build import summarize
from dflash_jax.data.pipeline import DataPipeline

_CONFIG = config_flags.DEFINE_config_file("config", None, "Training config file.", lock_config=True)
_REBUILD = flags.DEFINE_bool("rebuild", False, "Rebuild the cache even if it is up to date.")
_EPOCHS = flags.DEFINE_integer("epochs", 1, "Epochs to plan, to print their step counts.")


def main(argv):
    del argv
    config = _CONFIG.value
    data = DataPipeline.from_config(config.data, config.target.path, rebuild=_REBUILD.value)
    steps = [data.steps_in_epoch(e) for e in range(_EPOCHS.value)]
    print(f"tokenized cache: {data.cache.directory}")
    print(summarize(data.cache.manifest))
    print(f"steps per epoch ({config.data.global_batch_rows} x {config.data.seq_len}): {steps}, total {sum(steps)}")


if __name__ == "__main__":
    flags.mark_flag_as_required("config")
    app.run(main)
