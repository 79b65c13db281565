"""Will this run fit? Compile the exact train step on shapes only, before renting the devices.

    dflash-jax plan --config=configs/qwen3.py:8b           # 8 devices, 80 GiB each
    dflash-jax plan --config=configs/qwen3.py:8b,fsdp --hbm_gb=141
    dflash-jax plan --config=configs/default.py --num_devices=2 --config.data.global_batch_rows=4
    dflash-jax plan --config=configs/qwen3.py:8b --hardware=h200 --epoch_tokens=2e9

Reads only the target's config.json: `--target_config`, else the config's `target.plan_config`
(configs/qwen3.py names the public Qwen3 configs checked in under configs/targets/), else the
one in `target.path`. No weights, no data. Lowers and compiles the train step a real run would
jit, on `--num_devices` devices (when this machine has fewer, the command reruns itself on as
many simulated CPU devices), and prints per device: target, drafter, optimizer and batch bytes,
temporaries and the total against `--hbm_gb` with a verdict, the model FLOPs and tokens of a
step, the collectives of the compiled program with their bytes per step, and how fast the step
runs on `--hardware` by a roofline estimate of the compiled program: step time, tokens/s per
device, MFU and the time of an epoch of `--epoch_tokens` (docs/design.md §8). Exit status 0
when the step fits, 1 when it does not; then it also names the fewest hosts of
`--devices_per_host` devices on which it fits (an estimate from the target's shardings:
`training.planning.smallest_fitting_mesh`).

The figures are the compiler's for the platform it compiled for: with simulated CPU devices they
are XLA:CPU's plan (with its memory-minimizing scheduler), which tracks but does not equal what
XLA:GPU allocates; in particular XLA:CPU computes bf16 matmuls in fp32, so converted fp32 copies
of weights and activations inflate its temporaries.
"""

from __future__ import annotations

import os
import sys

from absl import flags

from dflash_jax import cli
from dflash_jax.errors import UserError
from dflash_jax.simulated_devices import plan_xla_flags
from dflash_jax.training.roofline import HARDWARE_NAMES

RENAMED_FLAGS = {"hlo_out": "hlo_output"}


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """The command's flags; defined when run as a program (tests use their own FlagValues, since
    several commands share flag names)."""
    fv = dict(flag_values=flag_values)
    cli.define_config(**fv)
    flags.DEFINE_integer(
        "num_devices", 8, "Devices to plan for (simulated on CPU when fewer are here).", lower_bound=1, **fv
    )
    flags.DEFINE_float("hbm_gb", 80.0, "Memory per device, GiB (H100 80, H200 141).", **fv)
    flags.DEFINE_integer(
        "devices_per_host",
        8,
        "Devices a host has: when the step does not fit, the plan names how many hosts do.",
        lower_bound=1,
        **fv,
    )
    flags.DEFINE_string(
        "target_config",
        "",
        "The target's config.json (or its directory); '' = target.plan_config, else target.path.",
        **fv,
    )
    flags.DEFINE_enum(
        "hardware", "h100", HARDWARE_NAMES, "The devices the speed is estimated for (cpu: this host, measured).", **fv
    )
    flags.DEFINE_float("epoch_tokens", 1e9, "Token slots (packed rows x seq_len) of an epoch.", lower_bound=1, **fv)
    flags.DEFINE_string("hlo_output", "", "Also write the compiled program's HLO text to this file.", **fv)
    flags.mark_flags_as_required(["config"], **fv)


_SIMULATED = "DFLASH_PLAN_SIMULATED_DEVICES"


def _rerun_on_simulated_devices(n: int) -> None:
    """Execute this command again on n simulated CPU devices (XLA reads its flags at start-up)."""
    if os.environ.get(_SIMULATED):
        raise UserError(f"could not simulate {n} CPU devices (XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r})")
    env = dict(os.environ, JAX_PLATFORMS="cpu", **{_SIMULATED: str(n)})
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # XLA:CPU's "slow compile" alarms and partitioner notes
    env["XLA_FLAGS"] = plan_xla_flags(n, os.environ.get("XLA_FLAGS", ""))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "dflash_jax.plan", *sys.argv[1:]], env)


def main(argv, f: flags.FlagValues = flags.FLAGS) -> int:
    del argv
    n = f.num_devices
    if f.hbm_gb <= 0:
        raise UserError(f"--hbm_gb={f.hbm_gb} must be > 0")

    import jax

    on_cpu = jax.default_backend() == "cpu"
    if jax.device_count() < n or (on_cpu and not os.environ.get(_SIMULATED)):
        _rerun_on_simulated_devices(n)

    from dflash_jax.training.planning import (
        GIB,
        format_mesh_choice,
        format_plan,
        plan_train_step,
        smallest_fitting_mesh,
    )
    from dflash_jax.training.roofline import format_speed, hardware
    from dflash_jax.training.run_config import resolve, target_for_plan

    config = f.config
    target, source = target_for_plan(config, f.target_config)
    if config.drafter.mask_token_id == -1 and not config.target.path:
        config.drafter.mask_token_id = target.vocab_size - 1  # no tokenizer to look it up in; any id will do
    setup = resolve(config, num_devices=n, target=target, check_files=False)
    name = _config_argument()
    print(f"compiling the train step of {name} for {source} on {n} devices ...", flush=True)
    plan = plan_train_step(setup, devices=jax.devices()[:n], hlo_path=f.hlo_output)
    _, fsdp, tensor = setup.mesh_shape
    hbm = f.hbm_gb * GIB
    remat = dict(remat=setup.objective.remat, remat_policy=setup.objective.remat_policy)
    print(format_plan(plan, hbm, title=name, fsdp=fsdp, tensor=tensor, **remat))
    hw = hardware(f.hardware, devices=n if on_cpu else 1)
    print(format_speed(plan, hw, epoch_tokens=f.epoch_tokens))
    if plan.fits(hbm):
        return 0
    choice = smallest_fitting_mesh(setup, plan, hbm, devices_per_host=f.devices_per_host)
    print(format_mesh_choice(choice, hbm))
    return cli.EXIT_ERROR


def _config_argument() -> str:
    """The --config value as the user typed it (file and variants)."""
    for i, arg in enumerate(sys.argv):
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
        if arg == "--config" and i + 1 < len(sys.argv):
            return sys.argv[i + 1]
    return "config"


def run() -> None:
    """The command: `dflash-jax plan`, or `python -m dflash_jax.plan`."""
    cli.run(main, define_flags, renamed=RENAMED_FLAGS)


if __name__ == "__main__":
    run()
