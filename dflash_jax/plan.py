"""Will this run fit? Compile the exact train step on shapes only, before renting the devices.

    dflash-jax plan --config=configs/qwen3.py:8b           # 8 devices, 80 GiB each
    dflash-jax plan --config=configs/qwen3.py:8b,fsdp --hbm_gb=141
    dflash-jax plan --config=configs/default.py --num_devices=2 --config.data.global_batch_rows=4
    dflash-jax plan --config=configs/qwen3.py:8b --hardware=h200 --epoch_tokens=2e9
    dflash-jax plan --config=configs/qwen3.py:8b --hardware=tpu-v5p --num_devices=4   # v5p-8
    dflash-jax plan --config=configs/default.py --hardware=tpu-v5e --topology=2x2 --num_slices=2

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

`--hardware=NAME`, a GPU or TPU of `training/planning/hardware.py`, compiles with that hardware's own compiler
on this machine, without the hardware (`training/planning/compilers.py`: XLA:GPU deviceless, the fused
attention kernels in; libtpu on a slice `--topology`, `--num_slices` of them), and the mesh
search confirms its candidate with it; HBM is the part's unless `--hbm_gb` says otherwise.
Without that compiler (the extras gpu-compile, tpu-compile) it says so in one line and compiles
with XLA:CPU on simulated devices, as `--simulate` and `--hardware=cpu` always do.

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
from dflash_jax.training.planning import compilers
from dflash_jax.training.planning.hardware import ACCELERATORS, CPU, GIB, LIBTPU, NAMES

RENAMED_FLAGS = {"hlo_out": "hlo_output"}
DEFAULT_HBM_GB = 80.0  # --hardware=cpu: plan for an 80 GB GPU


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    fv = dict(flag_values=flag_values)
    cli.define_config(**fv)
    flags.DEFINE_integer(
        "num_devices", 8, "Devices to plan for (simulated on CPU when fewer are here).", lower_bound=1, **fv
    )
    hbm = ", ".join(f"{acc.name} {acc.hbm_bytes / GIB:g}" for acc in ACCELERATORS.values())
    flags.DEFINE_float(
        "hbm_gb", 0.0, f"Memory per device, GiB; 0 = the --hardware's ({hbm}; {CPU} {DEFAULT_HBM_GB:g}).", **fv
    )
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
        "hardware",
        "h100",
        NAMES,
        "The devices compiled for, by their own compiler without them (GPUs: XLA:GPU; TPUs: libtpu), and the speed "
        "is estimated for (cpu: XLA:CPU on simulated devices, this host's speed).",
        **fv,
    )
    flags.DEFINE_string(
        "topology",
        "",
        "Of one slice: GPUs 'slices x hosts x GPUs' (1x1x8), TPUs the chips' (2x2x1); '' = by size.",
        **fv,
    )
    flags.DEFINE_integer(
        "num_slices", 1, "TPU slices (multi-slice); --num_devices counts them all.", lower_bound=1, **fv
    )
    flags.DEFINE_bool(
        "simulate", False, "Compile with XLA:CPU on simulated devices even where --hardware's compiler is here.", **fv
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


def _rerun_on_the_cpu_backend() -> None:
    """Execute this command again with JAX's backend the CPU, as a deviceless compile needs,
    and XLA_FLAGS as the user set them (none of the simulation's XLA:CPU flags)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, "-m", "dflash_jax.plan", *sys.argv[1:]], env)


def main(argv, f: flags.FlagValues = flags.FLAGS) -> int:
    del argv
    if f.hbm_gb < 0:
        raise UserError(f"--hbm_gb={f.hbm_gb} must be > 0 (0: the hardware's)")
    acc = ACCELERATORS.get(f.hardware)
    real = acc is not None and not f.simulate and compilers.installed(acc)
    if (f.topology or f.num_slices > 1) and not real:
        raise UserError("--topology and --num_slices are for a compile by --hardware's own compiler (not --simulate)")
    n = f.num_devices
    if f.topology:
        n = compilers.topology_size(f.topology) * f.num_slices
        if f["num_devices"].present and f.num_devices != n:
            raise UserError(
                f"--topology={f.topology} x --num_slices={f.num_slices} is {n} devices, not {f.num_devices}"
            )
    if real:
        compilers.checked_topology(acc, n, f.topology, f.num_slices)  # bad input fails before the rerun
        if os.environ.get("JAX_PLATFORMS") != "cpu":
            _rerun_on_the_cpu_backend()
    elif (f.simulate or acc is None) and not os.environ.get(_SIMULATED):
        _rerun_on_simulated_devices(n)  # without probing this machine's accelerators first

    import jax

    on_cpu = not real
    if not real and (jax.device_count() < n or (jax.default_backend() == "cpu" and not os.environ.get(_SIMULATED))):
        _rerun_on_simulated_devices(n)
    if acc is not None and not real and not f.simulate:
        print(f"{compilers.missing(acc)}; compiling with XLA:CPU on simulated devices instead", flush=True)

    from dflash_jax.training.config.run_config import resolve
    from dflash_jax.training.config.targets import target_for_plan
    from dflash_jax.training.planning.memory import format_plan, plan_train_step
    from dflash_jax.training.planning.roofline import format_speed, hardware

    config = f.config
    target, source = target_for_plan(config, f.target_config)
    if config.drafter.mask_token_id == -1 and not config.target.path:
        config.drafter.mask_token_id = target.vocab_size - 1  # no tokenizer to look it up in; any id will do
    setup = resolve(config, num_devices=n, target=target, check_files=False)
    name = _config_argument()
    if real:
        if setup.mesh_shape[0] % f.num_slices:
            raise UserError(f"mesh data={setup.mesh_shape[0]} is not a multiple of --num_slices={f.num_slices}")
        devices = compilers.devices(acc, n, topology=f.topology, num_slices=f.num_slices)
        where = compilers.describe(acc, devices, num_slices=f.num_slices)
    else:
        devices, where = jax.devices()[:n], f"{n} simulated CPU devices (XLA:CPU)"
    print(f"compiling the train step of {name} for {source} on {where} ...", flush=True)
    plan = plan_train_step(setup, devices=devices, hlo_path=f.hlo_output)
    _, fsdp, tensor = setup.mesh_shape
    hbm = f.hbm_gb * GIB or (acc.hbm_bytes if acc else DEFAULT_HBM_GB * GIB)
    remat = dict(remat=setup.objective.remat, remat_policy=setup.objective.remat_policy)
    print(format_plan(plan, hbm, title=name, fsdp=fsdp, tensor=tensor, **remat))
    if plan.out_of_memory:
        print("  speed: none (the compiler refused the step)")
    else:
        hw = hardware(f.hardware, devices=n if on_cpu else 1)
        print(format_speed(plan, hw, epoch_tokens=f.epoch_tokens))
    if plan.fits(hbm):
        return 0
    per_host = f.devices_per_host if f["devices_per_host"].present or acc is None else acc.chips_per_host
    _search_fitting_mesh(config, target, setup, plan, hbm, per_host, acc if real else None)
    return cli.EXIT_ERROR


# Candidates the search compiles with the hardware's compiler before it gives the estimate alone.
MAX_CONFIRMING_COMPILES = 3


def _search_fitting_mesh(config, target, setup, plan, hbm: float, per_host: int, acc) -> None:
    """Print the fewest hosts the step fits on: the estimate's candidate (`smallest_fitting_mesh`),
    then, with `acc` (its compiler installed), that candidate compiled by it; a candidate it
    finds too big moves the search on to more hosts."""
    from dflash_jax.training.config.run_config import resolve
    from dflash_jax.training.planning.memory import format_mesh_choice, plan_train_step, smallest_fitting_mesh

    sizes = (lambda d: True) if acc is None or acc.compiler is not LIBTPU else _tpu_slice_size(acc)
    hosts = 1
    for _ in range(MAX_CONFIRMING_COMPILES):
        choice = smallest_fitting_mesh(setup, plan, hbm, devices_per_host=per_host, min_hosts=hosts, sizes=sizes)
        print(format_mesh_choice(choice, hbm), flush=True)
        if choice is None or acc is None:
            return
        devices = choice.hosts * choice.devices_per_host
        config.mesh.data, config.mesh.fsdp = 1, -1
        candidate = plan_train_step(
            resolve(config, num_devices=devices, target=target, check_files=False), compilers.devices(acc, devices)
        )
        verdict = "fits" if candidate.fits(hbm) else "DOES NOT FIT"
        print(
            f"  compiled by {acc.compiler.name} on {devices} devices: {candidate.peak / GIB:.1f} GiB per device, {verdict}"
        )
        if candidate.fits(hbm):
            return
        hosts = choice.hosts + 1


def _tpu_slice_size(acc):
    def fits_a_slice(devices: int) -> bool:
        try:
            compilers.default_topology(acc, devices)
        except UserError:
            return False
        return True

    return fits_a_slice


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
