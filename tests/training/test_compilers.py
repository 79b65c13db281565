"""The hardware's own compilers, without the hardware (training/planning/compilers.py): topologies by
size, the GPU target configs shipped, one-line errors; the slow tier compiles the tiny default
step with XLA:TPU (libtpu) for 4 TPU v5e chips and with XLA:GPU for 4 H200s, fused kernels
included, and checks the compiler's temporaries against the band the program itself allows."""

from __future__ import annotations

import pytest

from dflash_jax.errors import UserError
from dflash_jax.training.config.presets import load_config_file
from dflash_jax.training.config.run_config import resolve
from dflash_jax.training.planning import compilers, hardware, hlo
from dflash_jax.training.planning import memory as planning
from support import training_runs as testing


def test_topologies_by_size_as_the_clouds_offer_them():
    v5e, v5p, h200 = (hardware.ACCELERATORS[n] for n in ("tpu-v5e", "tpu-v5p", "h200"))
    assert [compilers.default_topology(v5e, n) for n in (1, 4, 8, 16, 32)] == ["1x1", "2x2", "2x4", "4x4", "4x8"]
    assert [compilers.default_topology(v5p, n) for n in (4, 8, 16, 64)] == ["2x2x1", "2x2x2", "2x2x4", "4x4x4"]
    assert [compilers.default_topology(h200, n) for n in (4, 8, 32)] == ["1x1x4", "1x1x8", "1x4x8"]
    assert (v5p.slice_name(4), v5e.slice_name(16), hardware.ACCELERATORS["tpu-v6e"].slice_name(8)) == (
        "v5p-8",
        "v5litepod-16",
        "v6e-8",
    )
    with pytest.raises(UserError, match="power of two of chips, not 12"):
        compilers.default_topology(v5e, 12)
    with pytest.raises(UserError, match=r"the smallest tpu-v5p slice has 4 chips \(v5p-8\), not 2"):
        compilers.default_topology(v5p, 2)
    with pytest.raises(UserError, match="not whole hosts of 8"):
        compilers.default_topology(h200, 12)
    with pytest.raises(UserError, match="is not sizes joined by 'x'"):
        compilers.topology_size("2by2")


def test_every_gpu_has_its_target_config_with_its_memory():
    """The GpuTargetConfigProto files ship with the package and give the HBM the plan compares with."""
    for acc in hardware.ACCELERATORS.values():
        if acc.compiler is hardware.XLA_GPU:
            assert 'platform_name: "CUDA"' in acc.target_config
    gib = {n: hardware.ACCELERATORS[n].hbm_bytes / hardware.GIB for n in ("h100", "h200", "b200", "tpu-v5e")}
    assert gib == {"h100": 80, "h200": 141, "b200": 180, "tpu-v5e": 16}


def test_a_missing_compiler_names_its_extra(monkeypatch):
    monkeypatch.setattr(compilers, "installed", lambda acc: False)
    with pytest.raises(UserError, match=r"XLA:GPU compiler is not installed: pip install 'dflash_jax\[gpu-compile\]'"):
        compilers.devices(hardware.ACCELERATORS["h200"], 8)
    with pytest.raises(UserError, match=r"pip install 'dflash_jax\[tpu-compile\]'"):
        compilers.devices(hardware.ACCELERATORS["tpu-v5p"], 4)


def _compile_tiny_step(name: str, num_devices: int) -> tuple[planning.Plan, str]:
    acc = hardware.ACCELERATORS[name]
    if not compilers.installed(acc):
        pytest.fail(compilers.missing(acc))  # .ci/run installs both compilers: missing is a failure
    setup = resolve(load_config_file(str(testing.REPO / "configs" / "default.py")), num_devices=num_devices)
    path = testing.REPO / f".plan-{name}.hlo"
    try:
        plan = planning.plan_train_step(setup, compilers.devices(acc, num_devices), hlo_path=str(path))
        return plan, path.read_text()
    finally:
        path.unlink(missing_ok=True)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tpu-v5e", "h200"])
def test_the_tiny_step_compiles_for_the_hardware(name):
    """Lowering or compiling errors fail; the plan is that compiler's, its temporaries within the
    program's band (`hlo.buffer_band`), and the attention kernels "auto" picks are in it, the
    target's and the drafter's, each stating its cost."""
    plan, text = _compile_tiny_step(name, 4)
    assert plan.platform == hardware.ACCELERATORS[name].compiler.platform.replace("cuda", "gpu")
    assert plan.num_devices == 4 and plan.fits(hardware.ACCELERATORS[name].hbm_bytes)
    lowest, highest = hlo.buffer_band(text)
    assert lowest <= plan.temporaries <= highest, (lowest, plan.temporaries, highest)
    assert plan.compiler_costs["flops"] > 0 and plan.kernels and plan.collectives
    if name == "h200":
        # the target's packed causal kernel and the drafter's block kernel, forward and backward
        assert text.count('custom_call_target="__gpu$xla.gpu.triton"') >= 3, "the Pallas kernels were not compiled"
    else:
        for part in ("fwd", "dq", "dkv"):  # the drafter's block attention, forward and backward
            assert f"dflash_block_attention_{part}_tpu" in text, part
    counted = {k.region for k in plan.kernels if k.opcode == "custom-call" and k.flops > 0}
    assert {"target attention", "drafter attention"} <= counted, f"kernels stating their cost: {counted}"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--hardware=tpu-v5e", "--topology=2x2", "--num_devices=8"], "is 4 devices, not 8"),
        (["--hardware=h200", "--num_slices=2"], "--num_slices=2 does not divide|--num_slices is for TPUs"),
        (["--hardware=cpu", "--topology=2x2"], "are for a compile by --hardware's own compiler"),
    ],
)
def test_bad_hardware_input_is_one_line(monkeypatch, args, message):
    from absl import flags

    from dflash_jax import plan

    monkeypatch.setattr(compilers, "installed", lambda acc: True)
    fv = flags.FlagValues()
    plan.define_flags(fv)
    fv(["plan", f"--config={testing.REPO / 'configs' / 'default.py'}", *args])
    with pytest.raises(UserError, match=message):
        plan.main([], fv)


@pytest.mark.slow
def test_a_mesh_over_two_tpu_slices_spans_them_with_its_data_axis():
    """Multi-slice (--num_slices): the data axis crosses the slices, the rest stays inside one."""
    from dflash_jax.training.mesh import make_mesh

    devices = compilers.devices(hardware.ACCELERATORS["tpu-v5e"], 8, topology="2x2", num_slices=2)
    mesh = make_mesh(-1, 1, 1, devices=devices)
    assert [d.slice_index for d in mesh.devices.reshape(-1)] == [0, 0, 0, 0, 1, 1, 1, 1]


@pytest.mark.slow
def test_a_mesh_axis_no_physical_axes_multiply_to_splits_them():
    """gpt-oss-120b's fsdp=8 on a TPU v6e-16 (a 4x4 torus): no product of physical axes is 8."""
    from dflash_jax.training.mesh import make_mesh

    devices = compilers.devices(hardware.ACCELERATORS["tpu-v6e"], 16)
    mesh = make_mesh(2, 8, 1, devices=devices)
    assert mesh.devices.shape == (2, 8, 1)
    assert sorted(d.id for d in mesh.devices.reshape(-1)) == sorted(d.id for d in devices)


_ROWS, _K, _N, _GROUPS = 512, 256, 384, 8
_GROUPED_MATMUL_FLOPS = 2 * _ROWS * _K * _N


def _grouped_matmul_args(part: str, num_devices: int) -> list:
    """x [R, K], w [E, K, N], group_sizes [E] placed on one device of `part`'s topology."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    device = compilers.devices(hardware.ACCELERATORS[part], num_devices)[:1]
    placed = NamedSharding(Mesh(device, ("x",)), PartitionSpec())
    shapes = (((_ROWS, _K), jnp.bfloat16), ((_GROUPS, _K, _N), jnp.bfloat16), ((_GROUPS,), jnp.int32))
    return [jax.ShapeDtypeStruct(shape, dtype, sharding=placed) for shape, dtype in shapes]


@pytest.mark.slow
def test_the_moe_grouped_matmul_counts_its_flops_on_tpu():
    """XLA:TPU calls a Mosaic kernel for `jax.lax.ragged_dot`: the roofline counts 2·M·K·N for it."""
    import jax

    text = jax.jit(jax.lax.ragged_dot).lower(*_grouped_matmul_args("tpu-v5e", 4)).compile().as_text()
    assert "tpu_custom_call" in text
    assert sum(kernel.flops * kernel.count for kernel in hlo.kernels(text)) == _GROUPED_MATMUL_FLOPS


@pytest.mark.slow
def test_the_moe_grouped_matmul_is_a_triton_kernel_counted_by_its_rows_on_gpu():
    """XLA:GPU would multiply every row by every expert's matrix (a dense dot); 'auto' runs the
    project's Triton kernel there, and the roofline counts it 2·M·K·N, like a ragged_dot."""
    import jax

    from dflash_jax.models import kernels
    from dflash_jax.models.layers.moe import grouped_matmul

    with kernels.compiled_for_gpu():
        text = jax.jit(grouped_matmul).lower(*_grouped_matmul_args("h200", 8)).compile().as_text()
    assert 'custom_call_target="__gpu$xla.gpu.triton"' in text
    assert sum(kernel.flops * kernel.count for kernel in hlo.kernels(text)) == _GROUPED_MATMUL_FLOPS


def test_a_tpu_out_of_memory_refusal_is_a_plan_that_does_not_fit():
    """libtpu refuses a step over its HBM; the plan reads the figures from its message."""
    gib = hardware.GIB
    placed = {"target": 15 * gib, "drafter": gib, "optimizer": 2 * gib, "batch": 0}
    common = dict(mesh="data=4", layout="data", platform="tpu", num_devices=4, rows=16, seq_len=3072)
    common |= dict(grad_accum_steps=1, bytes_per_device=placed, model_flops=1.0, remat_flops=0.0, tokens=1)
    common |= dict(block_tokens=1, compile_seconds=1.0)
    refusal = (
        "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries (32.00G) "
        "exceeds available HBM (15.75G)."
    )
    plan = planning._refused_plan(refusal, common)
    assert (plan.arguments, plan.temporaries, plan.peak) == (18 * gib, 32 * gib, 50 * gib)
    verdict = planning.verdict(plan, 16 * gib, fsdp=1, tensor=1, remat=True)
    assert verdict.startswith("DOES NOT FIT: 50.0 GiB > 14.4 GiB usable per device (by 35.6 GiB)")
    assert "(the compiler: Ran out of memory on HBM, the total memory required" in verdict
    used = "RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space hbm. Used 20.50G of 15.75G hbm."
    assert planning._refused_plan(used, common).peak == int(20.5 * gib)
