"""The hardware a run can rent, one record each (`ACCELERATORS`): every fact the planner knows of a part.

A record names the part (`--hardware`), the compiler that builds for it (`XLA_GPU`, `LIBTPU`: the
package extra that installs it), its published peaks (the roofline's rates, `training/planning/roofline.py`),
its HBM, the JAX device kind that identifies it, and its topology (`training/planning/compilers.py`):
GPUs a target config for XLA:GPU and hosts of 8; TPUs a generation, the cloud's names of slices and
their smallest shape. Adding a part is adding its record (and, for a GPU, its target config).

`cpu` is the other `--hardware` name: XLA:CPU on simulated devices, at rates measured on this host
(`roofline.measure_cpu`), with no HBM of its own.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

GIB = 2**30
GPU_TARGETS = Path(__file__).with_name("gpu_targets")
CPU = "cpu"
# NVIDIA's PCIe and NVL forms of a part run at lower clocks and power than its SXM form (the figures here).
OTHER_GPU_FORMS = ("PCIe", "NVL")


@dataclasses.dataclass(frozen=True)
class Compiler:
    name: str
    platform: str  # JAX's platform of the devices it compiles for
    extra: str  # pip install 'dflash_jax[extra]' installs it
    modules: tuple[str, ...]  # what it is installed as, checked in order


# ptxas comes from nvidia-cuda-nvcc-cu12 (the "-local" CUDA plugin finds it in site-packages).
XLA_GPU = Compiler("XLA:GPU", "cuda", "gpu-compile", ("jax_cuda12_plugin", "nvidia.cuda_nvcc"))
LIBTPU = Compiler("XLA:TPU (libtpu)", "tpu", "tpu-compile", ("libtpu",))


@dataclasses.dataclass(frozen=True)
class Accelerator:
    name: str  # --hardware
    compiler: Compiler
    device_kind: str  # JAX's device_kind is this, or starts with it and a space (longest match wins)
    # Published peaks, per device: dense matmul FLOP/s in bf16 (no sparsity), HBM bytes/s, and link
    # bytes/s each way (half the bidirectional figure vendors quote).
    matmul_flops: float
    memory_bandwidth: float
    link_bandwidth: float
    chips_per_host: int
    hbm_gib: int = 0  # TPUs; a GPU's is its target config's device_memory_size
    gpu_target: str = ""  # GPUs: the GpuTargetConfigProto XLA:GPU compiles for, a file in gpu_targets/
    generation: str = ""  # TPUs: libtpu's topology names' prefix ("<generation>:2x2x1")
    cloud_prefix: str = ""  # TPUs: the cloud's slice names' prefix ("<cloud_prefix>-8")
    cores_per_chip: int = 1  # TPUs: the cloud counts a slice's TensorCores when a chip has two
    smallest_slice: tuple[int, ...] = (1, 1)  # TPUs: the cloud's smallest slice shape; larger ones grow from it

    @property
    def target_config(self) -> str:
        """The GpuTargetConfigProto text of a GPU."""
        return (GPU_TARGETS / self.gpu_target).read_text()

    @property
    def hbm_bytes(self) -> int:
        """Per device."""
        if self.gpu_target:
            return next(
                int(line.split(":")[1]) for line in self.target_config.splitlines() if "device_memory_size" in line
            )
        return self.hbm_gib * GIB

    def slice_name(self, chips: int) -> str:
        """What the cloud calls a TPU slice of `chips` chips."""
        return f"{self.cloud_prefix}-{chips * self.cores_per_chip}"


def _gpu(name: str, device_kind: str, *peaks: float) -> Accelerator:
    """An NVIDIA part, 8 to a host, compiled for its target config gpu_targets/<name>.txtpb."""
    return Accelerator(name, XLA_GPU, device_kind, *peaks, chips_per_host=8, gpu_target=f"{name}.txtpb")


def _tpu(
    generation: str, device_kind: str, *peaks: float, hbm_gib: int, cloud_prefix: str = "", **topology
) -> Accelerator:
    """A TPU generation, 4 chips to a host: `--hardware=tpu-<generation>`, the cloud's slices named
    `<cloud_prefix>-N` (the generation's name unless given)."""
    return Accelerator(
        f"tpu-{generation}",
        LIBTPU,
        device_kind,
        *peaks,
        chips_per_host=4,
        hbm_gib=hbm_gib,
        generation=generation,
        cloud_prefix=cloud_prefix or generation,
        **topology,
    )


# Each record: the part, JAX's device kind, then its published peaks per device: dense bf16 matmul
# FLOP/s, HBM bytes/s, link bytes/s each way.
ACCELERATORS = {
    part.name: part
    for part in (
        # NVIDIA H100 Tensor Core GPU datasheet, SXM5: 989.4 TFLOP/s bf16, HBM3 3.35 TB/s, NVLink 4 900 GB/s.
        _gpu("h100", "NVIDIA H100", 989.4e12, 3.35e12, 450e9),
        # NVIDIA H200 datasheet, SXM: the H100's compute, HBM3e 4.8 TB/s, NVLink 4 900 GB/s.
        _gpu("h200", "NVIDIA H200", 989.4e12, 4.8e12, 450e9),
        # NVIDIA HGX B200 datasheet, per GPU: 2.25 PFLOP/s bf16 dense (4.5 with sparsity), HBM3e 8 TB/s,
        # NVLink 5 1.8 TB/s.
        _gpu("b200", "NVIDIA B200", 2250e12, 8.0e12, 900e9),
        # TPUs per chip, from Google Cloud's system architecture page of each: bf16 peak, HBM bandwidth
        # and size, and the inter-chip interconnect (ICI) bandwidth, of which each way takes half.
        # v5e: 197 TFLOP/s, 819 GB/s, 16 GiB, ICI 1,600 Gbps.
        _tpu("v5e", "TPU v5 lite", 197e12, 819e9, 100e9, hbm_gib=16, cloud_prefix="v5litepod"),
        # v5p: 459 TFLOP/s, 2,765 GB/s, 95 GiB, ICI 4,800 Gbps; two TensorCores a chip (4 chips are a
        # "v5p-8"), and no slice smaller than 2x2x1.
        _tpu("v5p", "TPU v5", 459e12, 2765e9, 300e9, hbm_gib=95, cores_per_chip=2, smallest_slice=(2, 2, 1)),
        # v6e (Trillium): 918 TFLOP/s, 1,640 GB/s, 32 GiB, ICI 3,584 Gbps.
        _tpu("v6e", "TPU v6 lite", 918e12, 1640e9, 224e9, hbm_gib=32),
    )
}
NAMES = (*ACCELERATORS, CPU)  # --hardware


def for_device_kind(kind: str) -> Accelerator | None:
    """The part a JAX device kind names ('NVIDIA H100 80GB HBM3'); None for one not listed."""
    if any(form in kind for form in OTHER_GPU_FORMS):
        return None
    listed = [a for a in ACCELERATORS.values() if kind == a.device_kind or kind.startswith(a.device_kind + " ")]
    return max(listed, key=lambda a: len(a.device_kind), default=None)
