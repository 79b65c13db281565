"""The memory plan: `python -m dflash_jax.plan` on the tiny config, and what it reads from HLO."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap

import jax
import pytest

from dflash_jax.errors import ConfigError
from dflash_jax.training import step as step_lib
from dflash_jax.training.config.presets import load_config_file
from dflash_jax.training.config.run_config import resolve
from dflash_jax.training.config.targets import target_for_plan
from dflash_jax.training.mesh import make_mesh
from dflash_jax.training.planning import hlo as hlo_lib
from dflash_jax.training.planning import hlo_text
from dflash_jax.training.planning import memory as planning
from dflash_jax.training.planning.flops import model_flops_per_step, remat_flops_per_step
from support import training_runs as testing

HLO = textwrap.dedent(
    """
    HloModule jit_step, entry_computation_layout={()->()}

    %add (a: f32[], b: f32[]) -> f32[] {
      %a = f32[] parameter(0)
      %b = f32[] parameter(1)
      ROOT %sum = f32[] add(%a, %b)
    }

    %inner_cond (p: (s32[], f32[8,4])) -> pred[] {
      %p = (s32[], f32[8,4]{1,0}) parameter(0)
      %i = s32[] get-tuple-element(%p), index=0
      %n = s32[] constant(3)
      ROOT %lt = pred[] compare(%i, %n), direction=LT
    }

    %inner_body (p: (s32[], f32[8,4])) -> (s32[], f32[8,4]) {
      %p = (s32[], f32[8,4]{1,0}) parameter(0)
      %x = f32[8,4]{1,0} get-tuple-element(%p), index=1
      %ar = f32[8,4]{1,0} all-reduce(%x), channel_id=2, replica_groups=[2,4]<=[8], to_apply=%add, metadata={op_name="jit(step)/lm_head/reduce_sum"}
      ROOT %t = (s32[], f32[8,4]{1,0}) tuple(%i, %ar)
    }

    %outer_cond (p: (s32[], f32[8,4])) -> pred[] {
      %p = (s32[], f32[8,4]{1,0}) parameter(0)
      ROOT %lt = pred[] compare(%p, %p), direction=LT
    }

    %outer_body (p: (s32[], f32[8,4])) -> (s32[], f32[8,4]) {
      %p = (s32[], f32[8,4]{1,0}) parameter(0)
      %w = (s32[], f32[8,4]{1,0}) while(%p), condition=%inner_cond, body=%inner_body
      %g = bf16[1024,64]{1,0} all-gather(%y), channel_id=3, replica_groups=mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_0'}, dimensions={0}, metadata={op_name="jit(step)/target/dot_general"}
      ROOT %r = (s32[], f32[8,4]{1,0}) tuple(%w)
    }

    ENTRY %main (x: f32[8,4]) -> f32[8,4] {
      %x = f32[8,4]{1,0} parameter(0)
      %w = (s32[], f32[8,4]{1,0}) while(%x), condition=%outer_cond, body=%outer_body, backend_config={"known_trip_count":{"n":"16"}}
      %rs = f32[2,4]{1,0} reduce-scatter(%x), channel_id=4, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}, to_apply=%add
      ROOT %out = f32[8,4]{1,0} get-tuple-element(%w), index=1
    }
    """
)


def test_collectives_are_counted_through_loops():
    found = {(c.kind, c.region): c for c in planning.collectives(HLO)}
    # all-reduce inside a 3-iteration loop (trip count read from its condition) inside a loop the
    # compiler annotated with 16 iterations
    reduce = found[("all-reduce", "lm_head")]
    assert (reduce.count, reduce.bytes, reduce.group_size, reduce.trips) == (48, 8 * 4 * 4, 4, hlo_text.READ)
    gather = found[("all-gather", "target")]
    assert (gather.count, gather.bytes, gather.group_size) == (16, 1024 * 64 * 2, 4)
    scatter = found[("reduce-scatter", "other")]  # the whole buffer: one device's share x 4
    assert (scatter.count, scatter.bytes, scatter.group_size) == (1, 8 * 4 * 4, 4)


def fake_plan(**overrides) -> planning.Plan:
    fields = dict(
        mesh="data=8 x fsdp=1 x tensor=1",
        layout="data",
        platform="cpu",
        num_devices=8,
        rows=16,
        seq_len=3072,
        grad_accum_steps=1,
        bytes_per_device={"target": 60 * planning.GIB, "drafter": 0, "optimizer": 0, "batch": 0},
        arguments=60 * planning.GIB,
        outputs=0,
        aliased=0,
        temporaries=30 * planning.GIB,
        peak=90 * planning.GIB,
        model_flops=1e15,
        remat_flops=1e14,
        tokens=16 * 3072,
        block_tokens=16 * 512 * 16,
        collectives=(),
        compile_seconds=1.0,
    )
    return planning.Plan(**{**fields, **overrides})


def test_verdict_says_what_to_try():
    plan = fake_plan()
    assert not plan.fits(80 * planning.GIB)
    text = planning.verdict(plan, 80 * planning.GIB, fsdp=1, tensor=1, remat=False)
    assert text.startswith("DOES NOT FIT: 90.0 GiB > 72.0 GiB usable per device")
    for tip in (":fsdp", "mesh.tensor", "grad_accum_steps", "remat=True"):
        assert tip in text, tip
    assert planning.verdict(plan, 141 * planning.GIB, fsdp=1, tensor=1, remat=True).startswith("fits: 90.0 GiB")
    # Rematerialized layers that keep their matmuls' outputs: recomputing everything is the tip.
    keeping = planning.verdict(plan, 80 * planning.GIB, fsdp=1, tensor=1, remat=True, remat_policy="dots_saveable")
    assert "remat_policy=full" in keeping and "remat=True" not in keeping


def test_a_target_too_big_for_one_host_names_the_fewest_hosts_that_fit():
    """Kimi-K2.5's layers (five of its 61 here: 140 GB of bf16) on hosts of 8 x 16 GB with 2 GiB of
    activations and temporaries a device: one host is too small, two (data=1 x fsdp=2 x tensor=8,
    experts over fsdp x tensor) hold it."""
    config = load_config_file(str(testing.REPO / "configs" / "deepseek_v3.py"), "kimi-k2.5")
    target, _ = target_for_plan(config)
    target = dataclasses.replace(target, num_layers=5, layer_types=(), moe_layers=tuple(range(1, 5)))
    setup = resolve(config, num_devices=8, target=target, check_files=False)
    assert setup.mesh_shape == (1, 1, 8)
    one_host = 140e9 / 8
    plan = fake_plan(
        bytes_per_device={"target": int(one_host), "drafter": 0, "optimizer": 0, "batch": 0},
        peak=int(one_host + 2 * planning.GIB),
    )
    hbm = 16 * planning.GIB
    choice = planning.smallest_fitting_mesh(setup, plan, hbm, devices_per_host=8)
    assert (choice.hosts, choice.shape) == (2, (1, 2, 8))
    assert (choice.experts_per_device, choice.expert_axes) == (384 // 16, ("fsdp", "tensor"))
    assert 135e9 / 16 < choice.target_bytes < 145e9 / 16  # the non-expert weights split less
    # The 2 GiB follow the rows a device holds: half as many on twice the row groups.
    assert choice.peak == choice.target_bytes + 1 * planning.GIB <= planning.USABLE_FRACTION * hbm
    text = planning.format_mesh_choice(choice, hbm)
    assert "2 hosts x 8 devices = 16, data=1 x fsdp=2 x tensor=8 (experts over fsdp x tensor, 24 a device" in text
    assert "--num_devices=16" in text
    assert planning.smallest_fitting_mesh(setup, plan, hbm, devices_per_host=8, max_hosts=1) is None


@pytest.mark.parametrize(
    "variants, mesh",
    [("8b", (8, 1, 1)), ("4b,fsdp", (2, 4, 1)), ("32b", (2, 1, 4)), ("32b,fsdp", (1, 2, 4))],
)
def test_qwen3_sizes_plan_from_the_checked_in_configs(variants, mesh):
    config = load_config_file(str(testing.REPO / "configs" / "qwen3.py"), variants)
    target, source = target_for_plan(config)
    assert source.endswith(f"Qwen3-{variants.split(',')[0].upper()}.json")
    setup = resolve(config, num_devices=8, target=target, check_files=False)
    assert setup.mesh_shape == mesh


def test_no_target_to_plan_for_is_one_line():
    config = load_config_file(str(testing.REPO / "configs" / "default.py"))
    config.target.path = ""
    with pytest.raises(ConfigError, match="no target to plan for: set --target_config="):
        target_for_plan(config)


@pytest.mark.slow
def test_plan_command_on_the_tiny_config(tmp_path):
    """Two simulated devices, fsdp=2: the verdict, the per-device lines, and no all-gather of the
    LM head inside the cross-entropy loop (the vocab-parallel cross-entropy gathers rows)."""
    hlo = tmp_path / "step.hlo"
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "--xla_backend_optimization_level=0",  # compile faster; the plan is unchanged
    }
    env.pop("DFLASH_PLAN_SIMULATED_DEVICES", None)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "dflash_jax.plan",
            f"--config={testing.REPO / 'configs' / 'default.py'}",
            "--num_devices=2",
            "--config.mesh.fsdp=2",
            "--config.train.optimizer=adamw",  # the analytic FLOP count below has no Muon iterations
            "--simulate",  # XLA:CPU's plan even where XLA:GPU is installed (test_compilers.py compiles with it)
            f"--hlo_output={hlo}",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        cwd=testing.REPO,
    )
    out = result.stdout
    assert result.returncode == 0, out[-3000:] + result.stderr[-3000:]
    for line in ("mesh data=1 x fsdp=2 x tensor=1 (2 cpu devices), layout 'fsdp'", "target weights (frozen)"):
        assert line in out, out
    for word in ("optimizer state", "temporaries", "fits:", "model FLOPs per step", "tokens per step", "all-gather"):
        assert word in out, out
    for words in ("speed on h100 (roofline: 989.4 TFLOP/s", "tokens/s per device, MFU", "tokens per epoch:"):
        assert words in out, out
    # The roofline's matmul FLOPs, read from the compiled program with its loops' trip counts,
    # are the analytic count's (model + recomputed), per device.
    setup = resolve(load_config_file(str(testing.REPO / "configs" / "default.py")), num_devices=1)
    rows, seq_len = setup.data.global_batch_rows, setup.data.seq_len
    analytic = (model_flops_per_step(setup, rows, seq_len) + remat_flops_per_step(setup, rows, seq_len)) / 2
    kernels = hlo_lib.kernels(hlo.read_text())
    compiled_flops = sum(k.flops * k.count for k in kernels)
    assert 0.9 < compiled_flops / analytic < 1.1, (compiled_flops, analytic)
    # Each part's kernels are found by their named scopes, the drafter's through autodiff's wrappers
    # (`transpose(jvp(drafter))`): every part computes matmuls, the LM head and the drafter in both passes.
    flops = {r: sum(k.flops * k.count for k in kernels if k.region == r) for r in {k.region for k in kernels}}
    parts = ("target", "target attention", "drafter", "drafter attention", "lm_head")
    assert all(flops.get(p, 0) > 0 for p in parts), flops
    assert sum(flops[p] for p in parts) > 0.95 * compiled_flops, flops
    assert "kernels by part: " in out and "drafter attention" in out, out
    # the tiny target ties its embeddings: LM head = embedding table, vocab 4096 x hidden 256
    lm_head_bytes = 4096 * 256 * 4
    lm_head_gathers = [
        c for c in planning.collectives(hlo.read_text()) if c.region == "lm_head" and c.kind == "all-gather"
    ]
    assert lm_head_gathers, "no collectives named lm_head: the named scope is gone?"
    assert all(c.bytes < lm_head_bytes / 4 for c in lm_head_gathers), lm_head_gathers


def test_plan_and_device_check_trace_the_attention_they_name():
    """The plan and the device check's 'fused' and 'xla' rows build their steps through
    `build_train_step` with the setup's attention: the fused row must trace the Pallas kernels
    (target and drafter) and the xla row none, whatever the backend's 'auto' would pick."""
    setup = resolve(load_config_file(str(testing.REPO / "configs" / "default.py")), num_devices=1)
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    kernels = {}
    for impl in ("xla", "fused"):
        chosen = setup.with_run(attention=impl)
        graphdef, target = planning.abstract_target(chosen, mesh)
        program = step_lib.build_train_step(chosen, mesh, graphdef, target, total_steps=10)
        traced = program.step.trace(program.abstract_state, target, planning.abstract_batch(chosen, mesh))
        kernels[impl] = str(traced.jaxpr).count("pallas_call")
    assert kernels["xla"] == 0
    assert kernels["fused"] >= 2, kernels  # the target's packed causal kernel and the drafter's block kernel


def test_plan_counts_each_kinds_heads():
    """model FLOPs of the default run per drafter kind: DFlash2 adds its convolutions' kernel
    projections (D -> 2·W·D/g, two per layer) and its selector (D -> r and every token's
    successor score, rank r) on every drafted slot; DSpark drafts on every slot (8 a block, not 7), reads
    the target's distribution there (one more LM-head pass) and adds its Markov projection
    (r -> V) and confidence head (D + r -> 1). Forward once, and twice more backward."""
    config = load_config_file(str(testing.REPO / "configs" / "default.py"))
    config.train.num_anchors = 64  # every kind the same blocks (0: each kind's own)
    flops = {}
    for kind in ("dflash", "dflash2", "dspark"):
        config.drafter.kind, config.train.loss = kind, "dflash"
        setup = resolve(config, num_devices=1, check_files=False)
        flops[kind] = planning.model_flops_per_step(setup, setup.data.global_batch_rows, setup.data.seq_len)
    d, v, r, rows, anchors, block = 256, 4096, 256, 4, 64, 8
    tokens, slots = rows * anchors * block, rows * anchors * (block - 1)
    convs = 2 * tokens * 2 * d * (2 * 2 * d // 16)  # one layer, two convolutions
    selector = 2 * slots * r * (d + v)
    assert flops["dflash2"] - flops["dflash"] == 3 * (convs + selector)
    spark_slots = rows * anchors * block
    lm_head = 2 * d * v
    markov_and_confidence = 2 * spark_slots * (r * v + d + r)
    # One more slot a block through the LM head (forward and dX), the target's LM head on every
    # slot, and the heads.
    expected = 2 * rows * anchors * lm_head + spark_slots * lm_head + 3 * markov_and_confidence
    assert flops["dspark"] - flops["dflash"] == expected
