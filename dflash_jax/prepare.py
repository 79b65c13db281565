r"""Build (or check) the tokenized data cache of a training config, and plan its epochs.

    dflash-jax prepare --config=configs/qwen3.py:8b \
        --config.target.path=/models/Qwen3-8B --config.data.train=/data/train.jsonl

Training runs the same step itself when the cache is missing or stale; running it beforehand
keeps the tokenization (all CPU cores) off the accelerators' clock. Reads `config.data` and the
tokenizer and chat template in `config.target.path`; prints the cache summary, the rows skipped
by reason, and the steps of each epoch (the config's `train.num_epochs`, or --num_epochs).
"""

from __future__ import annotations

from absl import flags

from dflash_jax import cli
from dflash_jax.data.build import summarize
from dflash_jax.data.pipeline import DataPipeline
from dflash_jax.training.config.run_config import resolve_data

RENAMED_FLAGS = {"epochs": "num_epochs"}


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    fv = dict(flag_values=flag_values)
    cli.define_config(**fv)
    flags.DEFINE_bool("rebuild", False, "Rebuild the cache even if it is up to date.", **fv)
    flags.DEFINE_integer(
        "num_epochs",
        None,
        "Epochs to plan, to print their step counts (default: the config's train.num_epochs).",
        lower_bound=1,
        **fv,
    )
    flags.mark_flags_as_required(["config"], **fv)


def main(argv, f: flags.FlagValues = flags.FLAGS):
    del argv
    data_config, target_path = resolve_data(f.config)
    data = DataPipeline.from_config(data_config, target_path, rebuild=f.rebuild)
    num_epochs = f.num_epochs or f.config.train.num_epochs
    steps = [data.steps_in_epoch(e) for e in range(num_epochs)]
    print(f"tokenized cache: {data.cache.directory}")
    print(summarize(data.cache.manifest))
    print(f"steps per epoch ({data_config.global_batch_rows} x {data_config.seq_len}): {steps}, total {sum(steps)}")


def run() -> None:
    """The command: `dflash-jax prepare`, or `python -m dflash_jax.prepare`."""
    cli.run(main, define_flags, renamed=RENAMED_FLAGS)


if __name__ == "__main__":
    run()
