"""XLA flags for compiling on simulated CPU devices, as the plan does.

Jax-free on purpose: XLA reads its flags once, when jax starts, so a program sets them from here
before its first `import jax`.
"""

from __future__ import annotations

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"

# XLA:CPU's default scheduler orders for concurrency and ignores memory; a GPU's scheduler keeps
# memory in mind. The memory-minimizing one gives the closer plan (about half the temporaries).
# XLA:CPU computes bf16 matmuls in f32, and loop-invariant code motion then hoists the f32
# conversion of a scanned segment's whole stack of frozen weights out of its loop (twice the
# target's bytes resident), which a GPU's bf16 matmuls never ask for: without the pass each
# period converts its own weights, as each layer does unrolled.
PLAN_CPU_FLAGS = (
    "--xla_cpu_enable_concurrency_optimized_scheduler=false",
    "--xla_disable_hlo_passes=while-loop-invariant-code-motion",
)


def plan_xla_flags(num_devices: int, xla_flags: str = "") -> str:
    """`xla_flags` with its device count replaced by `num_devices` and the plan's CPU flags added
    where it does not set them itself."""
    kept = [f for f in xla_flags.split() if not f.startswith(DEVICE_COUNT_FLAG)]
    names = {f.split("=")[0] for f in kept}
    kept += [f for f in PLAN_CPU_FLAGS if f.split("=")[0] not in names]
    return " ".join([*kept, f"{DEVICE_COUNT_FLAG}={num_devices}"])
