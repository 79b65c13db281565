"""The compilers of the hardware a run rents, run on this machine without that hardware.

`devices(acc, n)` gives the n devices of a topology of a part (`training/planning/hardware.py`'s
records) to build the `Mesh` on; `jit(...).lower(...).compile()` over them runs that hardware's
compiler, not XLA:CPU (docs/design.md §10):

* GPUs: XLA:GPU compiles deviceless for a `GpuTargetConfigProto` (the text files in
  `gpu_targets/`, written from NVIDIA's published specifications) on a topology of
  slices x hosts x GPUs. It raises no out-of-memory error (compare the memory plan with
  `hbm_bytes`) and `cost_analysis()` is None (`cost_analysis` runs XLA's HloCostAnalysis on the
  optimized module instead, `planning.compiler_costs`).
* TPUs: libtpu compiles for a named slice topology ("<generation>:2x2x1"), several slices with
  `num_slices`; it raises RESOURCE_EXHAUSTED when the step does not fit the chip's HBM.

Both run in a process whose JAX backend is the CPU (JAX_PLATFORMS=cpu: no GPU or TPU to open).
"""

from __future__ import annotations

import importlib.util
import math
import os

from dflash_jax.errors import UserError
from dflash_jax.training.planning.hardware import LIBTPU, XLA_GPU, Accelerator


def installed(acc: Accelerator) -> bool:
    """Whether this environment has `acc`'s compiler (the extra `acc.compiler.extra`)."""
    return all(importlib.util.find_spec(m) is not None for m in acc.compiler.modules)


def missing(acc: Accelerator) -> str:
    return f"the {acc.compiler.name} compiler is not installed: pip install 'dflash_jax[{acc.compiler.extra}]'"


def default_topology(acc: Accelerator, num_devices: int) -> str:
    """The topology of `num_devices` devices (one slice): GPUs 'slices x hosts x GPUs a host';
    TPUs the slice shapes the cloud offers, from the part's smallest, chips a power of two."""
    if acc.compiler is XLA_GPU:
        per_host = min(num_devices, acc.chips_per_host)
        if num_devices % per_host:
            raise UserError(f"{num_devices} {acc.name} GPUs are not whole hosts of {acc.chips_per_host}")
        return f"1x{num_devices // per_host}x{per_host}"
    if num_devices < 1 or num_devices & (num_devices - 1):
        raise UserError(f"a {acc.name} slice has a power of two of chips, not {num_devices}")
    dims, smallest = list(acc.smallest_slice), math.prod(acc.smallest_slice)
    if num_devices < smallest:
        raise UserError(
            f"the smallest {acc.name} slice has {smallest} chips ({acc.slice_name(smallest)}), not {num_devices}"
        )
    while math.prod(dims) < num_devices:  # the last smallest side doubles: 2x2 -> 2x4 -> 4x4, 2x2x1 -> 2x2x2
        dims[len(dims) - 1 - dims[::-1].index(min(dims))] *= 2
    return "x".join(str(d) for d in dims)


def topology_size(topology: str) -> int:
    try:
        return math.prod(int(d) for d in topology.split("x"))
    except ValueError:
        raise UserError(f"topology {topology!r} is not sizes joined by 'x' (e.g. 2x2x1)") from None


def checked_topology(acc: Accelerator, num_devices: int, topology: str = "", num_slices: int = 1) -> tuple[str, int]:
    """(the topology of one slice, devices a slice) for `num_devices` in all, or a UserError."""
    if acc.compiler is XLA_GPU and num_slices != 1:
        raise UserError("--num_slices is for TPUs; a GPU topology is 'slices x hosts x GPUs' (--topology)")
    if num_slices < 1 or num_devices % num_slices:
        raise UserError(f"--num_slices={num_slices} does not divide {num_devices} devices")
    per_slice = num_devices // num_slices
    topology = topology or default_topology(acc, per_slice)
    if topology_size(topology) != per_slice:
        raise UserError(f"topology {topology} has {topology_size(topology)} devices, not {per_slice} a slice")
    return topology, per_slice


def devices(acc: Accelerator, num_devices: int, *, topology: str = "", num_slices: int = 1) -> list:
    """The devices of `num_devices` (in all) of `acc` for its compiler: a `topology` of one
    slice ('' = `default_topology`), `num_slices` of them (TPUs)."""
    if not installed(acc):
        raise UserError(missing(acc))
    topology, per_slice = checked_topology(acc, num_devices, topology, num_slices)
    from jax.experimental import topologies

    if acc.compiler is XLA_GPU:
        desc = topologies.get_topology_desc(
            platform=acc.compiler.platform, target_config=acc.target_config, topology=topology
        )
    else:
        # Without these libtpu looks for a TPU VM's metadata server at start-up and logs errors.
        os.environ.setdefault("TPU_ACCELERATOR_TYPE", acc.slice_name(per_slice))
        os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
        # libtpu locks /tmp/libtpu_lockfile for the one process that may own the chips; a compile
        # owns none, and any JAX process of this environment may hold the lock (probing for TPUs).
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        name = f"{acc.generation}:{topology}"
        try:
            desc = topologies.get_topology_desc(
                topology_name=name, platform=acc.compiler.platform, num_slices=num_slices
            )
        except Exception as e:  # libtpu's message for a shape it does not make
            raise UserError(f"libtpu has no topology {name}: {str(e).splitlines()[0]}") from None
    return list(desc.devices)


def describe(acc: Accelerator, devs: list, *, num_slices: int = 1) -> str:
    """What `devs` are, as the devices and the cloud name them: '<n> <device kind> (<hosts>; <compiler>)'."""
    n = len(devs)
    hosts = max(1, n // acc.chips_per_host)
    if acc.compiler is LIBTPU:
        slices = f"{num_slices} x " if num_slices > 1 else ""
        where = f"{slices}{acc.slice_name(n // num_slices)}, {hosts} host{'s' * (hosts > 1)}"
    else:
        where = f"{hosts} host{'s' * (hosts > 1)} of {min(n, acc.chips_per_host)}"
    return f"{n} {devs[0].device_kind} ({where}; {acc.compiler.name})"
