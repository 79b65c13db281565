"""Train-step time of this checkout against another git revision, interleaved in one process.

    python bench/train_step_ab.py --base=7abedf8                 # the default config, 30 rounds
    python bench/train_step_ab.py --base=HEAD~3 --rounds=50 --config=configs/default.py

On a shared machine two runs of `bench/train_step.py` differ by more than most changes do. Here
the base revision's package is extracted with `git archive` into a temporary directory and
renamed (`dflash_jax_base`), so both versions' train steps are compiled in the same process and
timed alternately, one step each per round on the same synthetic batches, with a 2048³ matmul
after every step. Both see the same disturbances; it prints the fastest and the median step of
each, their ratio, and each as a share of the fastest matmul (FLOPs as `bench/train_step.py`
counts them, with the checkout's count for both).
"""

from __future__ import annotations

import argparse
import importlib
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from train_step import MatmulPeak, compile_step, time_in_turn  # noqa: E402

from dflash_jax.training.flops import model_flops_per_step  # noqa: E402

BASE_PACKAGE = "dflash_jax_base"


def extract_base(revision: str, into: Path) -> None:
    """The package at `revision`, importable as BASE_PACKAGE from `into`."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", revision, "dflash_jax"], capture_output=True)
    if archive.returncode:
        raise SystemExit(f"git archive {revision}: {archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    (into / "dflash_jax").rename(into / BASE_PACKAGE)
    for path in (into / BASE_PACKAGE).rglob("*.py"):
        path.write_text(re.sub(r"\bdflash_jax\b", BASE_PACKAGE, path.read_text()))


def resolved_setup(package: str, config_path: str):
    """The config file resolved by `package`'s own config code (each revision its own schema)."""
    config = importlib.import_module(f"{package}.training.run_config")
    return config.resolve(config.load_config_file(config_path), num_devices=jax.device_count())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="git revision to compare the checkout with")
    parser.add_argument("--config", default=str(REPO / "configs" / "default.py"))
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()

    setup = resolved_setup("dflash_jax", args.config)
    flops = model_flops_per_step(setup, setup.data.global_batch_rows, setup.data.seq_len)
    with tempfile.TemporaryDirectory() as tmp:
        extract_base(args.base, Path(tmp))
        sys.path.insert(0, tmp)
        runs = {
            name: compile_step(resolved_setup(package, args.config), 4, package)
            for name, package in ((args.base, BASE_PACKAGE), ("checkout", "dflash_jax"))
        }
    peak = MatmulPeak(jnp.dtype(setup.compute_dtype))
    peak.measure(10)
    times = time_in_turn(runs, args.rounds, after_each=peak.measure)
    peak_flops = peak.flops * jax.device_count()
    print(f"{args.rounds} rounds, {flops / 1e9:.1f} GFLOP/step, matmul peak {peak_flops / 1e9:.1f} GFLOP/s")
    for name, t in times.items():
        best, median = min(t), float(np.median(t))
        print(
            f"{name:>12s}  fastest {best * 1e3:7.1f} ms ({100 * flops / best / peak_flops:4.1f}% of peak)  "
            f"median {median * 1e3:7.1f} ms ({100 * flops / median / peak_flops:4.1f}%)"
        )
    base, new = (np.asarray(t) for t in times.values())
    print(
        f"checkout / {args.base}: fastest {new.min() / base.min():.3f}, median {np.median(new) / np.median(base):.3f}"
    )


if __name__ == "__main__":
    main()
