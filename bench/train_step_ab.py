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
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # tests/support/
sys.path.insert(0, str(REPO / "bench"))
from train_step import MatmulPeak  # noqa: E402

from dflash_jax.training.config import load_config_file, resolve  # noqa: E402
from dflash_jax.training.flops import model_flops_per_step  # noqa: E402
from support.synthetic import packed_batch  # noqa: E402

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


def compiled_step(package: str, config_path: str, num_batches: int):
    """(step, state, target params, batches) of `package`'s train step on the config's shapes."""

    def module(name):
        return importlib.import_module(f"{package}.{name}")

    config, qwen3, sharding = module("training.config"), module("models.qwen3"), module("models.sharding")
    step_lib, mesh_lib = module("training.step"), module("training.mesh")
    setup = config.resolve(config.load_config_file(config_path), num_devices=jax.device_count())
    mesh = mesh_lib.make_mesh(*setup.mesh_shape)

    def new_target():
        return qwen3.Transformer(
            setup.target, param_dtype=setup.target_dtype, compute_dtype=setup.target_dtype, rngs=nnx.Rngs(0)
        )

    graphdef, abstract = nnx.split(nnx.eval_shape(new_target))
    target_params = jax.jit(
        lambda: nnx.split(new_target())[1], out_shardings=sharding.state_shardings(mesh, abstract)
    )()
    tx = step_lib.make_optimizer(setup.optimizer, 1000)
    state = step_lib.init_train_state(setup.drafter, tx, seed=0, compute_dtype=setup.compute_dtype, mesh=mesh)
    step = step_lib.make_train_step(
        drafter_graphdef=step_lib.drafter_graph(setup.drafter, setup.compute_dtype),
        target_graphdef=graphdef,
        target_params=target_params,
        tx=tx,
        cfg=setup.objective,
        grad_accum_steps=setup.run.grad_accum_steps,
        mesh=mesh,
        state_sharding=jax.tree.map(lambda x: x.sharding, state),
    )
    rows, seq_len = setup.data.global_batch_rows, setup.data.seq_len
    rng = np.random.default_rng(0)
    batches = [
        jax.device_put(
            packed_batch(rng, rows, seq_len, setup.target.vocab_size - 1, doc_len=(seq_len // 8, seq_len // 2)),
            mesh_lib.batch_sharding(mesh),
        )
        for _ in range(num_batches)
    ]
    state, metrics = step(state, target_params, batches[0])  # compiles
    jax.block_until_ready(metrics)
    return step, state, target_params, batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="git revision to compare the checkout with")
    parser.add_argument("--config", default=str(REPO / "configs" / "default.py"))
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()

    setup = resolve(load_config_file(args.config), num_devices=jax.device_count())
    flops = model_flops_per_step(setup, setup.data.global_batch_rows, setup.data.seq_len)
    with tempfile.TemporaryDirectory() as tmp:
        extract_base(args.base, Path(tmp))
        sys.path.insert(0, tmp)
        runs = {
            name: list(compiled_step(package, args.config, 4))
            for name, package in ((args.base, BASE_PACKAGE), ("checkout", "dflash_jax"))
        }
    peak = MatmulPeak(jnp.dtype(setup.compute_dtype))
    peak.measure(10)
    times = {name: [] for name in runs}
    for i in range(args.rounds):
        for name, run in runs.items():
            step, state, target_params, batches = run
            start = time.perf_counter()
            run[1], metrics = step(state, target_params, batches[i % len(batches)])
            jax.block_until_ready(metrics)
            times[name].append(time.perf_counter() - start)
            peak.measure()
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
