"""`python train.py` in a checkout: the same command as `dflash-jax train` (dflash_jax/train.py).

    python train.py                                     # configs/default.py: tiny, CPU, minutes
    python train.py --config=configs/qwen3.py:8b --config.target.path=Qwen/Qwen3-8B \
        --config.data.train=/data/train.jsonl --config.workdir=/ckpt/run1
"""

from dflash_jax.train import run

if __name__ == "__main__":
    run()
