"""The roofline estimate: kernels read from HLO (loop trip counts, slices, updates in place) and
the arithmetic from kernels and collectives to step time, tokens/s, MFU and epoch time."""

from __future__ import annotations

import dataclasses
import math
import textwrap

import jax
import jax.numpy as jnp
import pytest

from dflash_jax.training.planning import hardware, hlo, hlo_text, roofline

# A loop of 16 iterations: slice row i of x, a matmul of it (fused with exp), and x updated in place
# at row i; then one matmul of the result.
LOOP_HLO = textwrap.dedent(
    """
    HloModule jit_step, entry_computation_layout={()->()}

    %fused_slice (param_0: f32[16,64], param_1: s32[]) -> f32[1,64] {
      %param_0 = f32[16,64]{1,0} parameter(0)
      %param_1 = s32[] parameter(1)
      %zero = s32[] constant(0)
      ROOT %ds = f32[1,64]{1,0} dynamic-slice(%param_0, %param_1, %zero), dynamic_slice_sizes={1,64}
    }

    %fused_dot (param_0: f32[1,64], param_1: f32[64,32]) -> f32[1,32] {
      %param_0 = f32[1,64]{1,0} parameter(0)
      %param_1 = f32[64,32]{1,0} parameter(1)
      %d = f32[1,32]{1,0} dot(%param_0, %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
      ROOT %e = f32[1,32]{1,0} exponential(%d)
    }

    %fused_update (param_0: f32[16,64], param_1: f32[1,64], param_2: s32[]) -> f32[16,64] {
      %param_0 = f32[16,64]{1,0} parameter(0)
      %param_1 = f32[1,64]{1,0} parameter(1)
      %param_2 = s32[] parameter(2)
      %zero = s32[] constant(0)
      %neg = f32[1,64]{1,0} negate(%param_1)
      ROOT %dus = f32[16,64]{1,0} dynamic-update-slice(%param_0, %neg, %param_2, %zero)
    }

    %cond (p: (s32[], f32[16,64], f32[64,32])) -> pred[] {
      %p = (s32[], f32[16,64]{1,0}, f32[64,32]{1,0}) parameter(0)
      %i = s32[] get-tuple-element(%p), index=0
      %n = s32[] constant(16)
      ROOT %lt = pred[] compare(%i, %n), direction=LT
    }

    %body (p: (s32[], f32[16,64], f32[64,32])) -> (s32[], f32[16,64], f32[64,32]) {
      %p = (s32[], f32[16,64]{1,0}, f32[64,32]{1,0}) parameter(0)
      %i = s32[] get-tuple-element(%p), index=0
      %x = f32[16,64]{1,0} get-tuple-element(%p), index=1
      %w = f32[64,32]{1,0} get-tuple-element(%p), index=2
      %row = f32[1,64]{1,0} fusion(%x, %i), kind=kLoop, calls=%fused_slice
      %y = f32[1,32]{1,0} fusion(%row, %w), kind=kOutput, calls=%fused_dot
      %x2 = f32[16,64]{1,0} fusion(%x, %row, %i), kind=kLoop, calls=%fused_update
      %one = s32[] constant(1)
      %i2 = s32[] add(%i, %one)
      ROOT %t = (s32[], f32[16,64]{1,0}, f32[64,32]{1,0}) tuple(%i2, %x2, %w)
    }

    ENTRY %main (a: f32[16,64], w: f32[64,32]) -> f32[16,32] {
      %a = f32[16,64]{1,0} parameter(0)
      %w = f32[64,32]{1,0} parameter(1)
      %z = s32[] constant(0)
      %t = (s32[], f32[16,64]{1,0}, f32[64,32]{1,0}) tuple(%z, %a, %w)
      %loop = (s32[], f32[16,64]{1,0}, f32[64,32]{1,0}) while(%t), condition=%cond, body=%body
      %out = f32[16,64]{1,0} get-tuple-element(%loop), index=1
      ROOT %m = f32[16,32]{1,0} dot(%out, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
    }
    """
)


def test_kernels_count_loops_slices_and_updates_in_place():
    found = {(k.opcode, k.flops, k.bytes): k.count for k in hlo.kernels(LOOP_HLO)}
    row, weights = 64 * 4, 64 * 32 * 4
    assert found == {
        # the slice fusion reads its row, not x (+ the s32 index); the update fusion reads the
        # new row and writes it in place: the same bytes, 32 runs merged
        ("fusion", 0.0, row + 4 + row): 32,
        # a [1,64] x [64,32] matmul: 2·32·64 FLOPs; reads row and weights, writes [1,32]
        ("fusion", 2.0 * 32 * 64, row + weights + 32 * 4): 16,
        ("add", 0.0, 12): 16,  # the loop counter
        ("compare", 0.0, 9): 17,  # the condition runs once more than the body
        ("dot", 2.0 * 16 * 32 * 64, 16 * 64 * 4 + weights + 16 * 32 * 4): 1,
    }


@pytest.mark.parametrize(
    "counter, start, step, runs",
    [("s32", 0, 1, 16), ("u32", 0, 2, 8), ("u32", 4, 2, 6), ("s32", 3, 5, 3)],
)
def test_a_loops_trip_count_follows_its_counters_start_and_step(counter, start, step, runs):
    """`i < 16` from `start` by `step`: XLA:TPU's windowed matmul loops count in u32 by 2 (a
    loop taken for 16 runs made its matmuls count twice)."""
    text = (
        LOOP_HLO.replace("%z = s32[] constant(0)", f"%z = s32[] constant({start})")
        .replace("%one = s32[] constant(1)", f"%one = s32[] constant({step})")
        .replace("s32[]", f"{counter}[]")
    )
    found = {k.opcode: k.count for k in hlo.kernels(text) if k.flops and k.opcode == "fusion"}
    assert found == {"fusion": runs}


def test_a_loop_of_data_dependent_length_is_counted_at_its_expected_trips_else_once():
    """`i < n` with n carried by the loop (the MoE's chunks of routed pairs): counted at the trips
    its `expected_trips=N` scope states, else once, and the estimate names the FLOPs counted so."""
    text = LOOP_HLO.replace("%n = s32[] constant(16)", "%n = s32[] get-tuple-element(%p), index=0")
    hw = roofline.Hardware("test", matmul_flops=1e12, memory_bandwidth=1e11, link_bandwidth=1e10)
    dot = 2.0 * 32 * 64

    def in_loop(program):
        return [(k.flops, k.count, k.trips) for k in hlo.kernels(program) if k.flops and k.opcode == "fusion"]

    assert in_loop(text) == [(dot, 1, hlo_text.UNKNOWN)]
    est = roofline.estimate(hlo.kernels(text), [], hw)
    assert (est.once_flops, est.expected_flops) == (dot, 0)

    scoped = text.replace(
        "condition=%cond, body=%body",
        'condition=%cond, body=%body, metadata={op_name="jit(step)/target/expected_trips=6/while"}',
    )
    assert in_loop(scoped) == [(dot, 6, hlo_text.EXPECTED)]
    est = roofline.estimate(hlo.kernels(scoped), [], hw)
    assert (est.once_flops, est.expected_flops) == (0, 6 * dot)

    assert in_loop(LOOP_HLO) == [(dot, 16, hlo_text.READ)]  # a counted loop's trips are read, whatever its scope
    assert in_loop(
        LOOP_HLO.replace(
            "condition=%cond, body=%body", 'condition=%cond, body=%body, metadata={op_name="expected_trips=6"}'
        )
    ) == [(dot, 16, hlo_text.READ)]
    est = roofline.estimate(hlo.kernels(LOOP_HLO), [], hw)
    assert (est.once_flops, est.expected_flops) == (0, 0)


# An expert-parallel MoE's loop body, as XLA:TPU compiles it: a grouped matmul (a Mosaic kernel)
# of a chunk of 2,048 sorted pairs over a device's 32 experts, whose products are scatter-added
# into the token rows in place.
MOE_CHUNK_HLO = textwrap.dedent(
    """
    HloModule jit_step, entry_computation_layout={()->()}

    %add (a: f32[], b: f32[]) -> f32[] {
      %a = f32[] parameter(0)
      %b = f32[] parameter(1)
      ROOT %s = f32[] add(%a, %b)
    }

    %fused_scatter (param_0: f32[8192,64], param_1: s32[2048], param_2: f32[2048,64]) -> f32[8192,64] {
      %param_0 = f32[8192,64]{1,0} parameter(0)
      %param_1 = s32[2048]{0} parameter(1)
      %param_2 = f32[2048,64]{1,0} parameter(2)
      ROOT %scatter = f32[8192,64]{1,0} scatter(%param_0, %param_1, %param_2), update_window_dims={1}, inserted_window_dims={0}, scatter_dims_to_operand_dims={0}, index_vector_dim=1, to_apply=%add
    }

    ENTRY %main (x: f32[8192,64], i: s32[2048], t: bf16[2048,64], w: bf16[32,64,64], g: s32[32]) -> f32[8192,64] {
      %x = f32[8192,64]{1,0} parameter(0)
      %i = s32[2048]{0} parameter(1)
      %t = bf16[2048,64]{1,0} parameter(2)
      %w = bf16[32,64,64]{2,1,0} parameter(3)
      %g = s32[32]{0} parameter(4)
      %ragged-dot.1 = bf16[2048,64]{1,0} custom-call(%t, %w, %g), custom_call_target="tpu_custom_call", metadata={op_name="jit(step)/expected_trips=4/while/body/expected_groups=SCOPE/ragged_dot_general"}
      %y = f32[2048,64]{1,0} convert(%ragged-dot.1)
      ROOT %out = f32[8192,64]{1,0} fusion(%x, %i, %y), kind=kCustom, calls=%fused_scatter
    }
    """
)


def test_a_kernel_stating_its_cost_is_counted_by_it():
    """A Pallas TPU kernel's CostEstimate (in its backend_config: XLA cannot see inside) is its
    FLOPs and bytes; a Triton kernel keeps only its named scopes, and states its FLOPs in one; a
    custom call stating neither has no FLOPs and is counted opaque."""
    cost = '"cost_estimate":{"flops":"5000000","transcendentals":"7","bytes_accessed":"123456"}'
    scope = 'metadata={op_name="jit(step)/transpose(jvp(kernel_flops=7000000))/block_dq/pallas_call"}'
    text = textwrap.dedent(
        f"""
        HloModule jit_step, entry_computation_layout={{()->()}}

        ENTRY %main (x: f32[256,64]) -> f32[256,64] {{
          %x = f32[256,64]{{1,0}} parameter(0)
          %stated = f32[256,64]{{1,0}} custom-call(%x), custom_call_target="tpu_custom_call", backend_config={{"custom_call_config": {{"body": "TUxJUg==", {cost}}}}}
          %triton = f32[256,64]{{1,0}} custom-call(%stated), custom_call_target="__gpu$xla.gpu.triton", {scope}
          ROOT %silent = f32[256,64]{{1,0}} custom-call(%triton), custom_call_target="tpu_custom_call", backend_config={{"custom_call_config": {{"body": "TUxJUg=="}}}}
        }}
        """
    )
    stated, triton, silent = hlo.kernels(text)
    assert (stated.flops, stated.bytes) == (5e6, 123456)
    assert (triton.flops, triton.bytes) == (7e6, 2 * 256 * 64 * 4)
    assert (silent.flops, silent.bytes) == (0, 2 * 256 * 64 * 4)
    assert roofline.estimate([stated, triton, silent], [], roofline.hardware("tpu-v5p")).opaque_runs == 1


def test_an_instruction_printed_over_several_lines_is_read_whole():
    """XLA:TPU prints a Pallas call's kernel metadata with newlines, its named scopes after them:
    the kernel's stated FLOPs and part of the step are read, and the lines after it still parse."""
    text = textwrap.dedent(
        """
        HloModule jit_step, entry_computation_layout={()->()}

        ENTRY %main (x: f32[256,64]) -> f32[256,64] {
          %x = f32[256,64]{1,0} parameter(0)
          %splash = f32[256,64]{1,0} custom-call(%x), custom_call_target="tpu_custom_call", frontend_attributes={kernel_metadata={
        }}, metadata={op_name="jit(step)/target/attention/kernel_flops=9000/splash_mha_fwd/pallas_call"}, backend_config={"custom_call_config": {"body": "e30="}}
          ROOT %sum = f32[256,64]{1,0} add(%splash, %x)
        }
        """
    )
    kernels = {k.opcode: k for k in hlo.kernels(text)}
    assert (kernels["custom-call"].flops, kernels["custom-call"].region) == (9000, "target attention")
    assert kernels["add"].bytes == 3 * 256 * 64 * 4


def test_an_asynchronous_copy_moves_its_buffer_once():
    """XLA:TPU's copy-start/copy-done pair is one copy: HBM to HBM reads and writes the buffer,
    HBM to on-chip memory (a layout's memory space S(1)) reads it once; copy-done moves nothing."""
    hbm = "(f32[256,64]{1,0}, f32[256,64]{1,0}, u32[]{:S(2)})"
    vmem = "(f32[256,64]{1,0:T(8,128)S(1)}, f32[256,64]{1,0:T(8,128)}, u32[]{:S(2)})"
    for result, moved in ((hbm, 2), (vmem, 1)):
        text = textwrap.dedent(
            f"""
            HloModule jit_step, entry_computation_layout={{()->()}}

            ENTRY %main (x: f32[256,64]) -> f32[256,64] {{
              %x = f32[256,64]{{1,0}} parameter(0)
              %cs = {result} copy-start(%x)
              ROOT %cd = f32[256,64]{{1,0}} copy-done(%cs)
            }}
            """
        )
        assert {k.opcode: k.bytes for k in hlo.kernels(text)} == {"copy-start": moved * 256 * 64 * 4}


@pytest.mark.parametrize("groups, weights_read", [("3", 3 * 64 * 64 * 2), ("", 32 * 64 * 64 * 2)])
def test_a_moe_chunk_reads_the_experts_it_reaches_and_updates_rows_in_place(groups, weights_read):
    """The grouped matmul reads the weights of the `expected_groups=k` experts its scope states
    (all 32 without it); the scatter-add fusion reads and writes the 2,048 rows it updates, not
    the 8,192-row buffer it updates in place."""
    text = MOE_CHUNK_HLO.replace("expected_groups=SCOPE/", f"expected_groups={groups}/" if groups else "")
    found = {k.opcode: (k.flops, k.bytes) for k in hlo.kernels(text)}
    chunk_bf16, chunk_f32 = 2048 * 64 * 2, 2048 * 64 * 4
    assert found["custom-call"] == (2.0 * 2048 * 64 * 64, chunk_bf16 + weights_read + 32 * 4 + chunk_bf16)
    assert found["fusion"] == (0.0, 2048 * 4 + chunk_f32 + 2 * chunk_f32)  # indices, updates; rows read and written


@pytest.mark.parametrize(
    "op_name, part",
    [
        ("jit(step)/target/dot_general", "target"),
        ("jit(step)/target/attention/exp", "target attention"),
        ("jit(step)/jvp(drafter)/attention/dot_general", "drafter attention"),
        ("jit(step)/transpose(jvp(drafter))/mul", "drafter"),  # the backward pass
        ("jit(step)/transpose(jvp(drafter))/lm_head/dot_general", "lm_head"),  # innermost of the parts
        ("jit(step)/optimizer/add", "other"),
        (None, "other"),
    ],
)
def test_an_ops_part_of_the_step_comes_from_its_named_scopes(op_name, part):
    attributes = f', metadata={{op_name="{op_name}" source_file="x.py"}}' if op_name else ""
    assert hlo.region(attributes) == part


def test_kernel_time_is_split_by_part_of_the_step():
    hw = roofline.Hardware("test", matmul_flops=1e12, memory_bandwidth=1e11, link_bandwidth=1e10)
    kernels = [
        hlo.Kernel("fusion", flops=2e9, bytes=1e6, count=3, region="target"),  # 2 ms each, compute-bound
        hlo.Kernel("fusion", flops=0.0, bytes=5e8, count=1, region="drafter attention"),  # 5 ms, memory-bound
        hlo.Kernel("fusion", flops=1e9, bytes=1e6, count=1, region="target"),
    ]
    assert roofline.seconds_by_region(kernels, hw) == pytest.approx({"target": 7e-3, "drafter attention": 5e-3})
    assert list(roofline.seconds_by_region(kernels, hw)) == ["target", "drafter attention"]  # longest first


# What XLA:GPU makes of a dot: a cuBLAS call whose dimensions are in its backend config, and a
# scratch buffer beside the product; a Pallas kernel (its FLOPs unknown).
GPU_HLO = textwrap.dedent(
    """
    HloModule jit_step, entry_computation_layout={()->()}

    ENTRY %main (a: bf16[8,64,32], b: bf16[8,32,16]) -> bf16[8,64,16] {
      %a = bf16[8,64,32]{2,1,0} parameter(0)
      %b = bf16[8,32,16]{2,1,0} parameter(1)
      %gemm = (bf16[8,64,16]{2,1,0}, s8[4194304]{0}) custom-call(%a, %b), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["2"],"rhs_contracting_dimensions":["1"],"lhs_batch_dimensions":["0"],"rhs_batch_dimensions":["0"]}}}
      %product = bf16[8,64,16]{2,1,0} get-tuple-element(%gemm), index=0
      ROOT %kernel = bf16[8,64,16]{2,1,0} custom-call(%product), custom_call_target="__gpu$xla.gpu.triton"
    }
    """
)


def test_library_gemms_count_and_kernels_do_not():
    found = {(k.opcode, k.flops, k.bytes): k.count for k in hlo.kernels(GPU_HLO)}
    product = 8 * 64 * 16 * 2
    assert found == {
        ("custom-call", 2.0 * 8 * 64 * 16 * 32, 8 * 64 * 32 * 2 + 8 * 32 * 16 * 2 + product): 1,
        ("custom-call", 0.0, 2 * product): 1,
    }
    hw = roofline.Hardware("test", matmul_flops=1e12, memory_bandwidth=1e11, link_bandwidth=1e10)
    assert roofline.estimate(hlo.kernels(GPU_HLO), [], hw).opaque_runs == 1


# (lhs [b, f, spatial...], rhs [o, i, window...], strides, padding, lhs and rhs dilation, groups):
# a dot as XLA:TPU writes it (a window of 4 over one input padded by 3), a batch as a dilated
# window, a strided grouped convolution with rhs dilation, and two spatial dimensions.
CONVOLUTIONS = [
    ((2, 8, 1), (16, 8, 4), (1,), [(3, 3)], (1,), (1,), 1),
    ((3, 4, 2), (5, 4, 2), (1,), [(0, 0)], (2,), (1,), 1),
    ((2, 6, 9), (4, 3, 3), (2,), [(1, 2)], (1,), (2,), 2),
    ((1, 4, 5, 7), (6, 4, 2, 3), (1, 2), [(1, 0), (2, 2)], (1, 3), (1, 1), 1),
]


@pytest.mark.parametrize("lhs, rhs, strides, padding, lhs_dilation, rhs_dilation, groups", CONVOLUTIONS)
def test_convolution_flops_count_only_products_of_real_elements(
    lhs, rhs, strides, padding, lhs_dilation, rhs_dilation, groups
):
    """The FLOPs read from the compiled convolution are 2 x its multiply-adds of two real elements,
    counted by convolving ones with ones (padding and dilation holes add zeros)."""

    def conv(x, w):
        return jax.lax.conv_general_dilated(
            x, w, strides, padding, lhs_dilation=lhs_dilation, rhs_dilation=rhs_dilation, feature_group_count=groups
        )

    x, w = jnp.ones(lhs), jnp.ones(rhs)
    text = jax.jit(conv).lower(x, w).compile().as_text()
    assert "convolution(" in text
    assert sum(k.flops * k.count for k in hlo.kernels(text)) == 2 * float(conv(x, w).sum())


def test_roofline_arithmetic():
    hw = roofline.Hardware("test", matmul_flops=1e12, memory_bandwidth=1e11, link_bandwidth=1e10)
    kernels = [
        hlo.Kernel("fusion", flops=2e9, bytes=1e8, count=10),  # compute-bound: 2 ms (memory 1 ms)
        hlo.Kernel("fusion", flops=0.0, bytes=5e8, count=4),  # memory-bound: 5 ms
    ]
    collectives = [
        hlo.Collective("all-reduce", "other", 8, int(1e8), 2, False),  # ring: 2·7/8 of 100 MB, twice
        hlo.Collective("all-gather", "other", 4, int(4e8), 1, False),  # 3/4 of 400 MB
    ]
    est = roofline.estimate(kernels, collectives, hw)
    assert est.matmul_flops == 2e10 and est.memory_bytes == 3e9
    assert math.isclose(est.wire_bytes, 3.5e8 + 3e8)
    assert math.isclose(est.kernels_s, 0.04) and math.isclose(est.compute_bound_s, 0.02)
    assert math.isclose(est.collectives_s, 0.065) and math.isclose(est.step_s, 0.105)
    s = roofline.speed(est, model_flops=8e10, tokens=4096, devices=8, epoch_tokens=1e6)
    assert math.isclose(s.tokens_per_s_per_device, 4096 / 8 / 0.105)
    assert math.isclose(s.mfu, 8e10 / 8 / 0.105 / 1e12)
    assert math.isclose(s.epoch_s, 245 * 0.105)  # ceil(1e6 / 4096) steps

    # A kernel moving at most cache_bytes runs at the cache's bandwidth, a larger one at memory's.
    cached = dataclasses.replace(hw, cache_bytes=1e7, cache_bandwidth=1e12)
    small, large = hlo.Kernel("fusion", 0.0, 1e7, 100), hlo.Kernel("fusion", 0.0, 2e7, 100)
    assert math.isclose(roofline.estimate([small, large], [], cached).kernels_s, 100 * (1e7 / 1e12 + 2e7 / 1e11))
    assert math.isclose(roofline.estimate([small, large], [], hw).kernels_s, 100 * 3e7 / 1e11)


def test_named_hardware_is_its_records_published_peaks():
    h100, b200 = roofline.hardware("h100"), roofline.hardware("b200")
    assert (h100.matmul_flops, h100.memory_bandwidth, h100.link_bandwidth) == (989.4e12, 3.35e12, 450e9)
    assert b200.matmul_flops > 2 * h100.matmul_flops and roofline.hardware("h200").memory_bandwidth == 4.8e12
    for name, part in hardware.ACCELERATORS.items():
        hw = roofline.hardware(name)
        assert (hw.name, hw.matmul_flops, hw.memory_bandwidth, hw.link_bandwidth) == (
            name,
            part.matmul_flops,
            part.memory_bandwidth,
            part.link_bandwidth,
        )
    with pytest.raises(ValueError, match=f"'tpu' is not one of {', '.join(hardware.NAMES)}$"):
        roofline.hardware("tpu")
