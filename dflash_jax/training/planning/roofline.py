"""How long a step takes on named hardware: a roofline estimate from the compiled program.

Each kernel of one device's program (`training/planning/hlo.py`: its matmul FLOPs and the memory it reads
and writes, loop trip counts multiplied in) takes the longer of its matmul time at the device's
peak and its memory time at the device's bandwidth; collectives take their bytes on the wire
(a ring's share of the buffer) over the link bandwidth, not overlapped with compute. The step
time is the sum: an estimate of a well-run program, with no launch gaps, no overlap and peak
rates (compute-bound kernels rarely get more than 70-80% of peak, so real steps run longer).

`python -m dflash_jax.plan --hardware=NAME` prints it (`format_speed`), at a part's published peaks
(`training/planning/hardware.py`) or at this host's CPU's measured rates; `bench/train_step.py --roofline` and `bench/device_check.py` print it against
measured step times.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from dflash_jax.training.planning.hardware import ACCELERATORS, CPU, NAMES
from dflash_jax.training.planning.hlo import Collective, Kernel
from dflash_jax.training.planning.hlo_text import EXPECTED, UNKNOWN

if TYPE_CHECKING:
    from dflash_jax.training.planning.memory import Plan


@dataclasses.dataclass(frozen=True)
class Hardware:
    name: str
    matmul_flops: float  # FLOP/s of a dense matmul in the compute dtype, per device
    memory_bandwidth: float  # bytes/s, per device
    link_bandwidth: float  # bytes/s each way between devices, per device
    # A kernel moving at most `cache_bytes` runs at `cache_bandwidth` (a CPU's caches are a large
    # share of its memory; a GPU's L2 is left out, as rooflines do).
    cache_bytes: float = 0.0
    cache_bandwidth: float = 0.0


def hardware(name: str, *, devices: int = 1) -> Hardware:
    """The published peaks of a GPU or TPU chip, or this host's CPU measured (shared by `devices`
    simulated devices, as when the plan compiles for 8 devices on one host)."""
    if name == CPU:
        cpu = _measured_cpu()
        rates = ("matmul_flops", "memory_bandwidth", "link_bandwidth", "cache_bandwidth")
        return dataclasses.replace(cpu, **{f: getattr(cpu, f) / devices for f in rates})
    if name not in ACCELERATORS:
        raise ValueError(f"hardware {name!r} is not one of {', '.join(NAMES)}")
    part = ACCELERATORS[name]
    return Hardware(name, part.matmul_flops, part.memory_bandwidth, part.link_bandwidth)


def measure_cpu(repeats: int = 5) -> Hardware:
    """This host's CPU as XLA:CPU's kernels see it, best of `repeats` each (about a second):
    an fp32 matmul (XLA:CPU runs even bf16 matmuls in fp32); memory, an elementwise op writing a
    fresh 256 MB buffer, as the step's kernels write fresh temporaries; cache, the same op looped
    over a 2 MB array (4 MB moved per pass). Collectives between simulated devices are copies in
    memory."""
    import jax
    import jax.numpy as jnp

    cpu = jax.devices("cpu")[0]
    n, big, small, passes = 1024, 2**28, 2**21, 64
    matmul = jax.jit(lambda x: x @ x)
    scale = jax.jit(lambda x: x * 2.0)
    looped = jax.jit(lambda x: jax.lax.fori_loop(0, passes, lambda _, y: y * 1.0001, x))

    def best(f, shape) -> float:
        x = jax.device_put(jnp.ones(shape, jnp.float32), cpu)
        f(x).block_until_ready()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            f(x).block_until_ready()
            times.append(time.perf_counter() - start)
        return min(times)

    memory = 2 * big / best(scale, (big // 4,))
    return Hardware(
        CPU,
        matmul_flops=2 * n**3 / best(matmul, (n, n)),
        memory_bandwidth=memory,
        link_bandwidth=memory,
        cache_bytes=2 * small,
        cache_bandwidth=2 * small * passes / best(looped, (small // 4,)),
    )


_measured_cpu = functools.cache(measure_cpu)  # once per process


# Bytes each device sends per byte of the (whole) buffer, ring algorithms over a group of n.
def _wire_fraction(kind: str, n: int) -> float:
    if n <= 1:
        return 0.0 if kind != "collective-permute" else 1.0
    share = (n - 1) / n
    return {"all-reduce": 2 * share, "collective-permute": 1.0}.get(kind, share)


@dataclasses.dataclass(frozen=True)
class Estimate:
    hardware: Hardware
    matmul_flops: float  # per device and step, from the compiled program
    memory_bytes: float  # per device and step: what its kernels read and write
    wire_bytes: float  # per device and step: what its collectives send
    kernels_s: float  # Σ over kernels of max(matmul time, memory time)
    compute_bound_s: float  # the part of kernels_s spent in compute-bound kernels
    collectives_s: float
    opaque_runs: int  # runs of custom calls other than GEMMs (Pallas kernels): FLOPs not counted
    # matmul FLOPs inside loops of data-dependent length (an expert-parallel MoE's chunks of routed
    # pairs): counted at the trips the model expects (balanced routing), or once where it states none
    expected_flops: float = 0.0
    once_flops: float = 0.0

    @property
    def step_s(self) -> float:
        return self.kernels_s + self.collectives_s


def estimate(kernels: Sequence[Kernel], collectives: Sequence[Collective], hw: Hardware) -> Estimate:
    """The roofline time of one step of a program on `hw` (see the module docstring)."""
    kernels_s = compute_bound_s = 0.0
    for k in kernels:
        bandwidth = hw.cache_bandwidth if k.bytes <= hw.cache_bytes else hw.memory_bandwidth
        compute, memory = k.flops / hw.matmul_flops, k.bytes / bandwidth
        kernels_s += k.count * max(compute, memory)
        compute_bound_s += k.count * compute if compute >= memory else 0.0
    wire = sum(c.bytes * c.count * _wire_fraction(c.kind, c.group_size) for c in collectives)
    return Estimate(
        hardware=hw,
        matmul_flops=sum(k.flops * k.count for k in kernels),
        memory_bytes=sum(k.bytes * k.count for k in kernels),
        wire_bytes=wire,
        kernels_s=kernels_s,
        compute_bound_s=compute_bound_s,
        collectives_s=wire / hw.link_bandwidth,
        opaque_runs=sum(k.count for k in kernels if k.opcode == "custom-call" and not k.flops),
        expected_flops=sum(k.flops * k.count for k in kernels if k.trips == EXPECTED),
        once_flops=sum(k.flops * k.count for k in kernels if k.trips == UNKNOWN),
    )


def seconds_by_region(kernels: Sequence[Kernel], hw: Hardware) -> dict[str, float]:
    """The kernels' time on `hw` per part of the step (`hlo.region`), longest first."""
    parts: dict[str, list[Kernel]] = {}
    for k in kernels:
        parts.setdefault(k.region, []).append(k)
    seconds = {region: estimate(ks, [], hw).kernels_s for region, ks in parts.items()}
    return dict(sorted(seconds.items(), key=lambda kv: -kv[1]))


@dataclasses.dataclass(frozen=True)
class Speed:
    step_s: float
    tokens_per_s_per_device: float
    mfu: float  # model FLOPs / step time / peak, per device
    epoch_s: float  # steps to cover `epoch_tokens` x step time


def speed(est: Estimate, *, model_flops: float, tokens: int, devices: int, epoch_tokens: float) -> Speed:
    """What the estimate means for a run: `model_flops` and `tokens` per global step."""
    step = est.step_s
    return Speed(
        step_s=step,
        tokens_per_s_per_device=tokens / devices / step,
        mfu=model_flops / devices / step / est.hardware.matmul_flops,
        epoch_s=math.ceil(epoch_tokens / tokens) * step,
    )


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def format_speed(plan: Plan, hw: Hardware, *, epoch_tokens: float) -> str:
    """The plan's speed section."""
    est = estimate(plan.kernels, plan.collectives, hw)
    s = speed(
        est, model_flops=plan.model_flops, tokens=plan.tokens, devices=plan.num_devices, epoch_tokens=epoch_tokens
    )
    peak = f"{hw.matmul_flops / 1e12:,.1f} TFLOP/s, {hw.memory_bandwidth / 1e12:,.2f} TB/s memory"
    loops = []
    if est.expected_flops:
        loops.append(
            f"    {est.expected_flops / 1e12:,.1f} TFLOP of the matmuls are in loops of data-dependent length (an"
            " expert-parallel MoE's routed pairs), counted at the trips balanced routing needs"
        )
    if est.once_flops:
        loops.append(
            f"    {est.once_flops / 1e12:,.1f} TFLOP of the matmuls are in loops of data-dependent length counted"
            " for one iteration: the step is longer by the others"
        )
    return "\n".join(
        [
            f"  speed on {hw.name} (roofline: {peak}, {hw.link_bandwidth / 1e9:,.0f} GB/s links), per device:",
            f"    matmuls {est.matmul_flops / 1e12:,.1f} TFLOP, memory traffic {est.memory_bytes / 1e9:,.1f} GB,"
            f" collectives {est.wire_bytes / 1e9:,.2f} GB on the wire",
            f"    kernels {est.kernels_s:.3f} s ({est.compute_bound_s:.3f} s of it compute-bound)"
            f" + collectives {est.collectives_s:.3f} s = step {s.step_s:.3f} s",
            "    kernels by part: "
            + ", ".join(
                f"{region} {t:.3f} s ({100 * t / max(est.kernels_s, 1e-12):.0f}%)"
                for region, t in seconds_by_region(plan.kernels, hw).items()
            ),
            f"    {s.tokens_per_s_per_device:,.0f} tokens/s per device, MFU {100 * s.mfu:.1f}%;"
            f" {epoch_tokens:,.0f} tokens per epoch: {_duration(s.epoch_s)}",
            *loops,
        ]
    )
