"""Train-step throughput: tokens/s, model FLOP/s and their share of a measured matmul peak.

    python bench/train_step.py                      # the default config and a "small" one
    python bench/train_step.py --configs=small --steps=10
    python bench/train_step.py --attention=xla      # force an attention implementation
    python bench/train_step.py --optimizers=adamw,muon   # each config once per optimizer
    python bench/train_step.py --configs=default:dflash,default:dflash2,default:dspark --interleave --steps=8
    python bench/train_step.py --configs=default:dflash,default:dflash+num_anchors=192 --interleave --steps=8
    python bench/train_step.py --configs=default --base=HEAD~3 --steps=30   # this checkout against a revision
    python bench/train_step.py --roofline             # the roofline estimate against the measured step

`--base=REV`: on a shared machine two runs differ by more than most changes do, so the package at
REV is extracted with `git archive` and renamed (`dflash_jax_base`), both versions' steps are
compiled in one process and timed in turn, one step each per round on the same batches, with a
2048³ matmul after every step; it prints each one's fastest and median step and their ratio.
`--roofline`: the roofline estimate of each compiled step (`dflash_jax/training/planning/roofline.py`) for
this CPU, its rates measured before and after the steps (the best of each), beside the fastest
measured step; the estimate aims at the measured time within 30%.

Each config runs the real jitted train step (frozen target forward, drafter forward/backward,
AdamW) on random weights and synthetic packed batches of the config's shapes, after one
compiling step. FLOPs are the model's matmul FLOPs per step as the XLA implementation (the CPU
path) computes them, counted analytically: forward, plus 2x for what is trained, 1x to
back-propagate through the frozen LM head; recomputation in the backward pass excluded. The
target's packed causal attention computes only the query x key tiles on or below the diagonal,
so those are what is counted (`attention.packed_causal_pairs`, S·(S + S/n)/2 per row and head
for n query tiles, not S²); the drafter's block attention computes every block against every
context position (masked), and is counted so. "achieved" is therefore a model FLOP/s of the work
actually done. The peak is a square matmul in the compute dtype on the same device, measured in
the same run: best of 10 before the steps and of one more after every timed step. Each step is
timed on its own and the fastest counts, as does the fastest matmul: on a shared machine both
are then taken at the moments other jobs disturbed least, interleaved, so their ratio holds while
the rates vary. "step by step" is the median over steps of each step's rate against the matmul
timed right after it: a second estimate, less sensitive to one lucky matmul.
"""

from __future__ import annotations

# First, so that the package's start-up (dflash_jax/startup.py) runs before jax loads.
import dflash_jax  # noqa: F401

# isort: split
import argparse
import dataclasses
import functools
import importlib
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from study import KINDS, apply_variant  # bench/study.py

from dflash_jax.data.synthetic import packed_batch
from dflash_jax.models.architecture import RopeConfig, TransformerConfig
from dflash_jax.models.layers import attention
from dflash_jax.training.config.presets import load_config_file
from dflash_jax.training.config.run_config import TrainSetup, resolve
from dflash_jax.training.optim.optimizer import OPTIMIZERS
from dflash_jax.training.planning import hlo, hlo_text, roofline
from dflash_jax.training.planning.flops import model_flops_per_step

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
DEFAULT_CONFIG = os.path.join(REPO, "configs", "default.py")
BASE_PACKAGE = "dflash_jax_base"
RATES = ("matmul_flops", "memory_bandwidth", "link_bandwidth", "cache_bandwidth")

# A Qwen3-style model small enough for a CPU, big enough that matmuls dominate.
SMALL_TARGET = TransformerConfig(
    vocab_size=32768,
    hidden_size=512,
    intermediate_size=1536,
    num_layers=8,
    num_heads=8,
    num_kv_heads=4,
    head_dim=64,
    rope=RopeConfig(1_000_000.0),
)


def small_config():
    c = load_config_file(DEFAULT_CONFIG)
    c.drafter.num_layers = 2
    c.drafter.block_size = 16
    c.drafter.mask_token_id = SMALL_TARGET.vocab_size - 1
    c.data.seq_len = 1024
    c.data.global_batch_rows = 2
    c.train.num_anchors = 128
    return c


def setups(names: list[str]) -> dict[str, TrainSetup]:
    out = {}
    for name in names:
        if name.partition(":")[0] == "default":  # `default:KIND[+field=value...]`: the default with that kind
            config = load_config_file(DEFAULT_CONFIG)
            kind, _, fields = name.partition(":")[2].partition("+")
            if kind:  # the kind as the kinds study trains it, then the fields a study varies
                apply_variant(config, KINDS[kind])
            if fields:
                apply_variant(config, fields)
            out[name] = resolve(config, num_devices=jax.device_count())
        elif name == "small":
            out[name] = resolve(small_config(), num_devices=jax.device_count(), target=SMALL_TARGET, check_files=False)
        else:
            raise SystemExit(f"unknown config {name!r} (default, default:KIND[+field=value...], small)")
    return out


class MatmulPeak:
    """FLOP/s of an n x n x n matmul in `dtype`: the best of every `measure()` so far."""

    def __init__(self, dtype, n: int = 2048):
        self.n = n
        self.a = jax.random.normal(jax.random.key(0), (n, n), dtype)
        self.matmul = jax.jit(lambda x, y: x @ y)
        self.matmul(self.a, self.a).block_until_ready()
        self.best = float("inf")
        self.last = float("inf")

    def measure(self, repeats: int = 1) -> float:
        for _ in range(repeats):
            start = time.perf_counter()
            self.matmul(self.a, self.a).block_until_ready()
            self.last = time.perf_counter() - start
            self.best = min(self.best, self.last)
        return self.flops

    @property
    def flops(self) -> float:
        return 2 * self.n**3 / self.best


def matmul_peak(dtype, n: int = 2048, repeats: int = 10) -> float:
    """FLOP/s of an n x n x n matmul, best of `repeats`."""
    return MatmulPeak(dtype, n).measure(repeats)


@dataclasses.dataclass
class CompiledStep:
    """A train step compiled and run once, with its state and synthetic batches."""

    step: Callable  # compiled ahead of time (`jax.stages.Compiled`)
    state: object
    target_params: object
    batches: list
    compile_seconds: float  # compiling and the first step

    def __call__(self, batch) -> dict:
        """One step on `batch`; its metrics, once they are computed."""
        self.state, metrics = self.step(self.state, self.target_params, batch)
        return jax.block_until_ready(metrics)


def compile_step(setup, num_batches: int, package: str = "dflash_jax") -> CompiledStep:
    """The real jitted train step of `package` on random weights and `num_batches` synthetic packed
    batches of the config's shapes; `setup` is resolved by that package. `package` is this
    checkout's or another revision's renamed copy (`--base`)."""

    def module(name):
        return importlib.import_module(f"{package}.{name}")

    parameters, step_lib, mesh_lib = module("models.parameters"), module("training.step"), module("training.mesh")
    mesh = mesh_lib.make_mesh(*setup.mesh_shape)
    new_target = functools.partial(step_lib.new_target, setup)
    graphdef, abstract = nnx.split(nnx.eval_shape(new_target))
    target_params = jax.jit(
        lambda: nnx.split(new_target())[1], out_shardings=parameters.param_shardings(mesh, abstract)
    )()
    program = step_lib.build_train_step(setup, mesh, graphdef, target_params, total_steps=1000)
    step, state = program.step, program.init_state()
    rows, seq_len = setup.data.global_batch_rows, setup.data.seq_len
    rng = np.random.default_rng(0)
    batches = [
        jax.device_put(
            packed_batch(rng, rows, seq_len, setup.target.vocab_size - 1, doc_len=(seq_len // 8, seq_len // 2)),
            mesh_lib.batch_sharding(mesh),
        )
        for _ in range(num_batches)
    ]
    start = time.perf_counter()
    executable = step.lower(state, target_params, batches[0]).compile()
    compiled = CompiledStep(executable, state, target_params, batches, compile_seconds=0.0)
    compiled(batches[0])
    compiled.compile_seconds = time.perf_counter() - start
    return compiled


def bench(
    setup: TrainSetup, steps: int, peak: MatmulPeak | None = None, hardware: roofline.Hardware | None = None
) -> dict:
    """Times `steps` train steps (the fastest counts); `peak` measures one matmul after each;
    with `hardware`, also the roofline estimate of the compiled step on it ('predicted', from its
    'kernels' and 'collectives')."""
    compiled = compile_step(setup, steps + 1)
    program = {}
    if hardware is not None:
        module = hlo_text.Module(compiled.step.as_text())
        program = {"kernels": hlo.kernels(module), "collectives": hlo.collectives(module)}
        program["predicted"] = roofline.estimate(program["kernels"], program["collectives"], hardware)
    rows, seq_len = setup.data.global_batch_rows, setup.data.seq_len
    flops = model_flops_per_step(setup, rows, seq_len)
    real_tokens, times, paired = 0.0, [], []
    for batch in compiled.batches[1:]:
        start = time.perf_counter()
        real_tokens += float(compiled(batch)["real_tokens"])
        times.append(time.perf_counter() - start)
        if peak is not None:
            peak.measure()
            paired.append((flops / times[-1]) / (2 * peak.n**3 / peak.last * jax.device_count()))
    seconds = min(times)  # per step
    return {
        "rows x seq_len": f"{rows} x {seq_len}",
        "compile_s": compiled.compile_seconds,
        "steps_per_s": 1 / seconds,
        "tokens_per_s": real_tokens / steps / seconds,
        "padded_tokens_per_s": rows * seq_len / seconds,
        "flops_per_step": flops,
        "flops_per_s": flops / seconds,
        # each step against the matmul timed right after it: robust to the machine's slow phases
        "paired_median": float(np.median(paired)) if paired else float("nan"),
        **program,
    }


def time_in_turn(
    compiled: dict[str, CompiledStep], rounds: int, after_each: Callable[[], object] = lambda: None
) -> dict[str, list[float]]:
    """Seconds of each compiled step, one step of each per round, in turn (`after_each` runs
    after every step, untimed): on a shared machine all see the same disturbances, so their
    ratios hold while the rates vary."""
    times = {name: [] for name in compiled}
    for r in range(rounds):
        for name, step in compiled.items():
            start = time.perf_counter()
            step(step.batches[r % len(step.batches)])
            times[name].append(time.perf_counter() - start)
            after_each()
    return times


def interleaved(chosen: dict[str, TrainSetup], rounds: int) -> None:
    """Every config's step compiled first, then timed in turn (`time_in_turn`). Prints each one's
    fastest and median step and both against the first config's."""
    times = time_in_turn({name: compile_step(setup, 2) for name, setup in chosen.items()}, rounds)
    first = next(iter(times.values()))
    print(f"interleaved, {rounds} rounds: {'fastest ms':>10s} {'median ms':>10s} {'÷ first':>8s} {'÷ first':>8s}")
    for name, t in times.items():
        print(
            f"{name:24s} {1e3 * min(t):10.1f} {1e3 * np.median(t):10.1f} "
            f"{min(t) / min(first):8.2f} {np.median(t) / np.median(first):8.2f}"
        )


def extract_base(revision: str, into: str) -> None:
    """The package at `revision`, importable as BASE_PACKAGE from `into`."""
    archive = subprocess.run(["git", "-C", REPO, "archive", revision, "dflash_jax"], capture_output=True)
    if archive.returncode:
        raise SystemExit(f"git archive {revision}: {archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", into], input=archive.stdout, check=True)
    os.rename(os.path.join(into, "dflash_jax"), os.path.join(into, BASE_PACKAGE))
    for path in Path(into, BASE_PACKAGE).rglob("*.py"):
        path.write_text(re.sub(r"\bdflash_jax\b", BASE_PACKAGE, path.read_text()))


def against_base(revision: str, setup: TrainSetup, config: str, rounds: int) -> None:
    """This checkout's step and `revision`'s (resolved by its own config code), timed in turn."""
    flops = model_flops_per_step(setup, setup.data.global_batch_rows, setup.data.seq_len)
    with tempfile.TemporaryDirectory() as tmp:
        extract_base(revision, tmp)
        sys.path.insert(0, tmp)
        base = importlib.import_module(f"{BASE_PACKAGE}.training.run_config")
        base_setup = base.resolve(base.load_config_file(config), num_devices=jax.device_count())
        runs = {revision: compile_step(base_setup, 4, BASE_PACKAGE), "checkout": compile_step(setup, 4)}
    peak = MatmulPeak(jnp.dtype(setup.compute_dtype))
    peak.measure(10)
    times = time_in_turn(runs, rounds, after_each=peak.measure)
    peak_flops = peak.flops * jax.device_count()
    print(f"{rounds} rounds, {flops / 1e9:.1f} GFLOP/step, matmul peak {peak_flops / 1e9:.1f} GFLOP/s")
    for name, t in times.items():
        best, median = min(t), float(np.median(t))
        print(
            f"{name:>12s}  fastest {best * 1e3:7.1f} ms ({100 * flops / best / peak_flops:4.1f}% of peak)  "
            f"median {median * 1e3:7.1f} ms ({100 * flops / median / peak_flops:4.1f}%)"
        )
    old, new = (np.asarray(t) for t in times.values())
    print(f"checkout / {revision}: fastest {new.min() / old.min():.3f}, median {np.median(new) / np.median(old):.3f}")


def best_rates(*measured: roofline.Hardware) -> roofline.Hardware:
    return dataclasses.replace(measured[0], **{f: max(getattr(m, f) for m in measured) for f in RATES})


def roofline_check(name: str, setup: TrainSetup, steps: int) -> None:
    """The roofline estimate of `setup`'s compiled step on this CPU beside its fastest step."""
    before = best_rates(*(roofline.measure_cpu() for _ in range(3)))
    r = bench(setup, steps, hardware=before)
    cpu = best_rates(before, *(roofline.measure_cpu() for _ in range(3)))
    est = roofline.estimate(r["kernels"], r["collectives"], cpu)
    measured = 1 / r["steps_per_s"]
    print(
        f"{name:8s} measured {measured:8.3f}s predicted {est.step_s:8.3f}s ratio {est.step_s / measured:6.2f}   "
        f"({est.compute_bound_s:.3f} s compute-bound + {est.kernels_s - est.compute_bound_s:.3f} s memory-bound; "
        f"{cpu.matmul_flops / 1e9:.1f} GFLOP/s, {cpu.memory_bandwidth / 1e9:.1f} GB/s, "
        f"{cpu.cache_bandwidth / 1e9:.0f} GB/s in cache; "
        f"{est.matmul_flops / 1e9:.1f} GFLOP and {est.memory_bytes / 1e9:.2f} GB per step)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="default,small")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per config (after one compiling step)")
    parser.add_argument("--attention", default="auto", choices=attention.IMPLEMENTATIONS)
    parser.add_argument("--optimizers", default="", help="comma-separated (adamw, muon); default: the config's")
    parser.add_argument("--interleave", action="store_true", help="time the configs' steps in turn, side by side")
    parser.add_argument("--base", default="", help="git revision to time against this checkout, in turn (one config)")
    parser.add_argument("--roofline", action="store_true", help="the roofline estimate beside the measured step")
    args = parser.parse_args()
    chosen = {name: setup.with_run(attention=args.attention) for name, setup in setups(args.configs.split(",")).items()}
    if args.optimizers:
        unknown = set(args.optimizers.split(",")) - set(OPTIMIZERS)
        if unknown:
            parser.error(f"--optimizers: {', '.join(sorted(unknown))} not one of {', '.join(OPTIMIZERS)}")
        chosen = {
            f"{name}/{optimizer}": setup.with_optimizer(optimizer)
            for name, setup in chosen.items()
            for optimizer in args.optimizers.split(",")
        }
    device = jax.devices()[0]
    resolved = attention.resolve_implementation(args.attention)
    print(f"devices: {jax.device_count()} x {device.device_kind} ({jax.default_backend()}); attention: {resolved}")
    if args.interleave:
        return interleaved(chosen, args.steps)
    if args.base:
        if args.configs != "default":
            parser.error("--base times configs/default.py: give --configs=default")
        return against_base(args.base, next(iter(chosen.values())), DEFAULT_CONFIG, args.steps)
    if args.roofline:
        for name, setup in chosen.items():
            roofline_check(name, setup, args.steps)
        return
    peaks = {}
    for name, setup in chosen.items():
        dtype = jnp.dtype(setup.compute_dtype)
        if dtype not in peaks:
            peaks[dtype] = MatmulPeak(dtype)
            peaks[dtype].measure(10)
        r = bench(setup, args.steps, peaks[dtype])
        peak = peaks[dtype].flops * jax.device_count()
        print(f"matmul peak ({dtype.name}, 2048^3, all devices): {peak / 1e9:.1f} GFLOP/s")
        print(
            f"{name:8s} rows x seq {r['rows x seq_len']:>10s}  compile {r['compile_s']:5.1f}s  "
            f"{r['steps_per_s']:7.3f} steps/s  {r['tokens_per_s']:9.0f} tokens/s "
            f"({r['padded_tokens_per_s']:.0f} padded)  {r['flops_per_step'] / 1e9:8.1f} GFLOP/step  "
            f"{r['flops_per_s'] / 1e9:7.2f} GFLOP/s = {100 * r['flops_per_s'] / peak:5.1f}% of matmul peak "
            f"(step by step: median {100 * r['paired_median']:.1f}%)"
        )


if __name__ == "__main__":
    main()
