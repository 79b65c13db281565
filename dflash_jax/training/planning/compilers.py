"""The compilers of the hardware a run rents, run on this machine without that hardware.

`ACCELERATORS` names the parts: platform, HBM, roofline figures (`training/planning/roofline.py`), and
the package extra that installs their compiler. `devices(acc, n)` gives the n devices of a
topology of that part to build the `Mesh` on; `jit(...).lower(...).compile()` over them runs
that hardware's compiler, not XLA:CPU (docs/design.md §10):

* GPUs: XLA:GPU compiles deviceless for a `GpuTargetConfigProto` (the text files in
  `gpu_targets/`, written from NVIDIA's published specifications) on a topology of
  slices x hosts x GPUs. It raises no out-of-memory error (compare the memory plan with
  `hbm_bytes`) and `cost_analysis()` is None (`cost_analysis` runs XLA's HloCostAnalysis on the
  optimized module instead, `planning.compiler_costs`).
* TPUs: libtpu compiles for a named slice topology ("v5p:2x2x1"), several slices with
  `num_slices`; it raises RESOURCE_EXHAUSTED when the step does not fit the chip's HBM.

Both run in a process whose JAX backend is the CPU (JAX_PLATFORMS=cpu: no GPU or TPU to open).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
from pathlib import Path

from dflash_jax.errors import UserError
from dflash_jax.training.planning import roofline

GIB = 2**30
GPU_TARGETS = Path(__file__).with_name("gpu_targets")


@dataclasses.dataclass(frozen=True)
class Accelerator:
    name: str  # --hardware
    platform: str  # "cuda" | "tpu": the compiler's
    hbm_bytes: int  # per device
    chips_per_host: int
    extra: str  # pip install 'dflash_jax[extra]' installs the compiler
    generation: str = ""  # TPU: the topology names' prefix ("v5p")
    cloud_prefix: str = ""  # TPU: the accelerator type's prefix as the cloud names slices ("v5litepod")
    cores_per_chip: int = 1  # TPU: the cloud counts v5p slices in TensorCores (v5p-8 = 4 chips)

    @property
    def hardware(self) -> roofline.Hardware:
        return roofline.hardware(self.name)

    @property
    def compiler(self) -> str:
        return "XLA:GPU" if self.platform == "cuda" else "XLA:TPU (libtpu)"

    def slice_name(self, chips: int) -> str:
        """What the cloud calls a slice of `chips` chips: 'v5p-8', 'v5litepod-16', 'v6e-8'."""
        return f"{self.cloud_prefix}-{chips * self.cores_per_chip}"


def _gpu(name: str) -> Accelerator:
    size = next(int(line.split(":")[1]) for line in target_config(name).splitlines() if "device_memory_size" in line)
    return Accelerator(name, "cuda", size, chips_per_host=8, extra="gpu-compile")


def target_config(name: str) -> str:
    """The GpuTargetConfigProto text of a GPU ('h200')."""
    return (GPU_TARGETS / f"{name}.txtpb").read_text()


# TPU HBM per chip (Google Cloud's system architecture pages): v5e 16 GiB, v5p 95 GiB, v6e 32 GiB.
ACCELERATORS = {
    **{name: _gpu(name) for name in ("h100", "h200", "b200")},
    "tpu-v5e": Accelerator("tpu-v5e", "tpu", 16 * GIB, 4, "tpu-compile", "v5e", "v5litepod"),
    "tpu-v5p": Accelerator("tpu-v5p", "tpu", 95 * GIB, 4, "tpu-compile", "v5p", "v5p", cores_per_chip=2),
    "tpu-v6e": Accelerator("tpu-v6e", "tpu", 32 * GIB, 4, "tpu-compile", "v6e", "v6e"),
}


def for_device_kind(kind: str) -> Accelerator | None:
    """The part a JAX device kind names ('NVIDIA H200', 'TPU v5 lite'); None for one not listed."""
    gpu = roofline.for_device_kind(kind)
    if gpu is not None:
        return ACCELERATORS[gpu.name]
    tpus = {"TPU v5 lite": "tpu-v5e", "TPU v5": "tpu-v5p", "TPU v6 lite": "tpu-v6e"}
    return ACCELERATORS.get(tpus.get(kind, ""))


def installed(acc: Accelerator) -> bool:
    """Whether this environment has `acc`'s compiler (the extra `acc.extra`)."""
    if acc.platform == "tpu":
        return importlib.util.find_spec("libtpu") is not None
    # ptxas comes from nvidia-cuda-nvcc-cu12 (the "-local" CUDA plugin finds it in site-packages).
    return all(importlib.util.find_spec(m) is not None for m in ("jax_cuda12_plugin", "nvidia.cuda_nvcc"))


def missing(acc: Accelerator) -> str:
    return f"the {acc.compiler} compiler is not installed: pip install 'dflash_jax[{acc.extra}]'"


def default_topology(acc: Accelerator, num_devices: int) -> str:
    """The topology of `num_devices` devices (one slice): GPUs 'slices x hosts x GPUs a host';
    TPUs the slice shapes the cloud offers (v5e/v6e 2-D, v5p 3-D), chips a power of two."""
    if acc.platform == "cuda":
        per_host = min(num_devices, acc.chips_per_host)
        if num_devices % per_host:
            raise UserError(f"{num_devices} {acc.name} GPUs are not whole hosts of {acc.chips_per_host}")
        return f"1x{num_devices // per_host}x{per_host}"
    if num_devices < 1 or num_devices & (num_devices - 1):
        raise UserError(f"a {acc.name} slice has a power of two of chips, not {num_devices}")
    dims = [1, 1] if acc.generation != "v5p" else [2, 2, 1]
    if acc.generation == "v5p" and num_devices < 4:
        raise UserError(f"the smallest {acc.name} slice has 4 chips (v5p-8), not {num_devices}")
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
    if acc.platform == "cuda" and num_slices != 1:
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

    if acc.platform == "cuda":
        desc = topologies.get_topology_desc(platform="cuda", target_config=target_config(acc.name), topology=topology)
    else:
        # Without these libtpu looks for a TPU VM's metadata server at start-up and logs errors.
        os.environ.setdefault("TPU_ACCELERATOR_TYPE", acc.slice_name(per_slice))
        os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
        # libtpu locks /tmp/libtpu_lockfile for the one process that may own the chips; a compile
        # owns none, and any JAX process of this environment may hold the lock (probing for TPUs).
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        name = f"{acc.generation}:{topology}"
        try:
            desc = topologies.get_topology_desc(topology_name=name, platform="tpu", num_slices=num_slices)
        except Exception as e:  # libtpu's message for a shape it does not make
            raise UserError(f"libtpu has no topology {name}: {str(e).splitlines()[0]}") from None
    return list(desc.devices)


def describe(acc: Accelerator, devs: list, *, num_slices: int = 1) -> str:
    """'8 NVIDIA H200 (XLA:GPU, 1 host)' or '8 TPU v5 (v5p-16, 2 hosts, XLA:TPU (libtpu))'."""
    n = len(devs)
    hosts = max(1, n // acc.chips_per_host)
    if acc.platform == "tpu":
        slices = f"{num_slices} x " if num_slices > 1 else ""
        where = f"{slices}{acc.slice_name(n // num_slices)}, {hosts} host{'s' * (hosts > 1)}"
    else:
        where = f"{hosts} host{'s' * (hosts > 1)} of {min(n, acc.chips_per_host)}"
    return f"{n} {devs[0].device_kind} ({where}; {acc.compiler})"
