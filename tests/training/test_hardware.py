"""The hardware records (training/planning/hardware.py): each complete, found again by its name and
its JAX device kind, the only place the parts are named, and the source of the plan's help."""

from __future__ import annotations

import math
import re

import pytest

from dflash_jax.training.planning import hardware
from support.package_imports import PACKAGE

# The package modules that may name a part: its record, and the plan command's usage examples.
MAY_NAME_PARTS = {"training/planning/hardware.py", "plan.py"}


def _target_field(text: str, field: str) -> str:
    return re.search(rf"^\s*{field}: (.+)$", text, re.MULTILINE).group(1).strip('"')


@pytest.mark.parametrize("part", hardware.ACCELERATORS.values(), ids=hardware.ACCELERATORS)
def test_every_record_is_complete(part):
    assert part.compiler in (hardware.XLA_GPU, hardware.LIBTPU)
    assert min(part.matmul_flops, part.memory_bandwidth, part.link_bandwidth) > 0
    assert part.chips_per_host > 0 and part.hbm_bytes > 0 and part.device_kind
    if part.compiler is hardware.XLA_GPU:
        config = part.target_config  # what XLA:GPU compiles for states the record's figures
        assert _target_field(config, "platform_name") == "CUDA"
        assert float(_target_field(config, "memory_bandwidth")) == part.memory_bandwidth
        assert hardware.for_device_kind(_target_field(config, "name")) is part
        assert not (part.hbm_gib or part.generation or part.cloud_prefix)
    else:
        assert part.hbm_bytes == part.hbm_gib * hardware.GIB and not part.gpu_target
        assert part.generation and part.cloud_prefix and part.cores_per_chip >= 1
        chips = math.prod(part.smallest_slice)
        assert chips & (chips - 1) == 0, "slices double from the smallest: a power of two of chips"


def test_a_part_is_found_by_its_name_and_its_device_kind():
    for name, part in hardware.ACCELERATORS.items():
        assert part.name == name
        assert hardware.for_device_kind(part.device_kind) is part
        assert hardware.for_device_kind(f"{part.device_kind} 96GB HBM3") is part  # a kind says more of it
    assert hardware.NAMES == (*hardware.ACCELERATORS, hardware.CPU)
    kinds = {"NVIDIA H100 80GB HBM3": "h100", "NVIDIA H200": "h200", "TPU v5 lite": "tpu-v5e", "TPU v5": "tpu-v5p"}
    assert {kind: hardware.for_device_kind(kind).name for kind in kinds} == kinds
    # other forms and parts: another part's figures would be wrong for them
    for kind in ("NVIDIA H100 PCIe", "NVIDIA H200 NVL", "NVIDIA GH200 480GB", "NVIDIA A100-SXM4-80GB", "TPU v4"):
        assert hardware.for_device_kind(kind) is None, kind


def test_only_the_records_name_the_parts():
    """A part's name, TPU generation or cloud prefix in another module is a second table to keep."""
    words = {w for part in hardware.ACCELERATORS.values() for w in (part.name, part.generation, part.cloud_prefix)}
    pattern = re.compile("|".join(sorted(re.escape(w) for w in words if w)))
    naming = {
        str(path.relative_to(PACKAGE)): sorted(set(pattern.findall(path.read_text()))) for path in PACKAGE.rglob("*.py")
    }
    assert {module: found for module, found in naming.items() if found and module not in MAY_NAME_PARTS} == {}
    assert naming["training/planning/hardware.py"], "the pattern finds the records themselves"


def test_the_plan_help_lists_the_records():
    from absl import flags

    from dflash_jax import plan

    fv = flags.FlagValues()
    plan.define_flags(fv)
    assert fv["hardware"].parser.enum_values == list(hardware.NAMES)
    for part in hardware.ACCELERATORS.values():
        assert f"{part.name} {part.hbm_bytes / hardware.GIB:g}" in fv["hbm_gb"].help
