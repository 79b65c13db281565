"""The memory plan of a run: the exact train step, compiled ahead of time on shapes only.

`plan_train_step(setup, devices)` builds the frozen target, the drafter state and a batch as
`jax.ShapeDtypeStruct`s carrying the shardings a real run gives them, lowers and compiles the
real jitted step (`jit(step).lower(...).compile()`), and reads back what the compiler planned
per device: argument bytes by category (computed from the shardings), temporaries, the total
against an HBM budget, the compiler's FLOP count, and the collectives of the compiled program
with their bytes per step. No weights, no data, no device memory: only the target's config.

`format_plan` prints it; `python -m dflash_jax.plan` is the command line (docs/design.md §8).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import time
from collections import defaultdict
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from dflash_jax.data.packing import FIELDS
from dflash_jax.models import kernels, parameters, sharding
from dflash_jax.training import step as step_lib
from dflash_jax.training.config.run_config import TrainSetup
from dflash_jax.training.mesh import batch_sharding, make_mesh, mesh_axes_description
from dflash_jax.training.planning import hlo, hlo_text
from dflash_jax.training.planning.flops import model_flops_per_step, remat_flops_per_step
from dflash_jax.training.planning.hlo import Collective, Kernel, collectives

GIB = 2**30
# Of the HBM, what a step may plan to use: the runtime, the compiler's scratch and
# fragmentation need the rest.
USABLE_FRACTION = 0.9


@dataclasses.dataclass(frozen=True)
class Plan:
    mesh: str  # "data=8 x fsdp=1 x tensor=1"
    layout: str  # the sharding rules table used
    platform: str  # the compiler's platform (cpu when devices are simulated)
    num_devices: int
    rows: int  # global batch rows
    seq_len: int
    grad_accum_steps: int
    bytes_per_device: dict[str, int]  # target, drafter, optimizer, batch (from the shardings)
    arguments: int  # per device, as the compiler counts them
    outputs: int
    aliased: int  # outputs written in place of donated arguments
    temporaries: int
    peak: int  # per device: what the step needs at its peak
    model_flops: float  # per global step, analytic
    remat_flops: float  # per global step, analytic: recomputed in the backward pass
    tokens: int  # packed token slots per step (rows x seq_len)
    block_tokens: int  # drafter tokens per step (rows x anchors x block size)
    collectives: tuple[Collective, ...]
    compile_seconds: float
    drafter_kind: str = "dflash"  # models/kinds/: its heads' FLOPs are in model_flops
    kernels: tuple[Kernel, ...] = ()  # of one device's program, for the roofline (training/planning/roofline.py)
    lower_seconds: float = 0.0  # tracing and lowering the step, before compiling it
    compile_cpu_seconds: float = 0.0  # CPU time of the compile, every thread of it (wall time: compile_seconds)
    device_kind: str = ""  # the compiled-for devices' `device_kind` ("TPU v5", say)
    generated_code: int = 0  # per device, bytes of the compiled program
    compiler_costs: dict[str, float] = dataclasses.field(default_factory=dict)  # `compiler_costs`
    out_of_memory: str = ""  # the compiler's refusal (TPU); then the memory figures come from its message
    kernel_fallbacks: tuple[str, ...] = ()  # why layers asked for a kernel run XLA's attention (kernels.fall_back)

    def fits(self, hbm_bytes: float) -> bool:
        return self.peak <= USABLE_FRACTION * hbm_bytes


def abstract_target(setup: TrainSetup, mesh: Mesh) -> tuple[nnx.GraphDef, nnx.State]:
    """The target's graph and its parameters as ShapeDtypeStructs placed as a run loads them."""
    graphdef, params = nnx.split(nnx.eval_shape(lambda: step_lib.new_target(setup)))
    shardings = parameters.param_shardings(mesh, params)
    return graphdef, jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), params, shardings)


def abstract_batch(setup: TrainSetup, mesh: Mesh) -> dict[str, jax.ShapeDtypeStruct]:
    shape = (setup.data.global_batch_rows, setup.data.seq_len)
    return {k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=batch_sharding(mesh)) for k in FIELDS}


def bytes_per_device(tree) -> int:
    """Bytes one device holds of a tree of sharded ShapeDtypeStructs (the most loaded device)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shard = leaf.sharding.shard_shape(leaf.shape)
        total += math.prod(shard) * jnp.dtype(leaf.dtype).itemsize
    return total


def lower_train_step(setup: TrainSetup, mesh: Mesh):
    """(jit-lowered train step, abstract state, abstract target, abstract batch) of a real run."""
    graphdef, target = abstract_target(setup, mesh)
    # The schedule's length does not change the program.
    program = step_lib.build_train_step(setup, mesh, graphdef, target, total_steps=1000)
    batch = abstract_batch(setup, mesh)
    state = program.abstract_state
    return program.step.lower(state, target, batch), state, target, batch


def plan_train_step(setup: TrainSetup, devices=None, *, hlo_path: str = "") -> Plan:
    """Compile the step of `setup` on `devices` (default: all) and read back its plan; with
    `hlo_path`, also write the compiled program's HLO text there. On the devices of a GPU or
    TPU topology (`training/planning/compilers.py`) the attention kernels are traced and compiled for
    that hardware, as a run there would; a TPU compiler's out-of-memory refusal is a plan that does
    not fit, its memory figures read from the refusal."""
    devices = jax.devices() if devices is None else devices
    mesh = make_mesh(*setup.mesh_shape, devices=devices)
    platform = devices[0].platform
    start = time.perf_counter()
    with kernels.compiled_for(platform) if platform != "cpu" else contextlib.nullcontext():
        with kernels.noting_fallbacks() as kernel_fallbacks:
            lowered, state, target, batch = lower_train_step(setup, mesh)
    lower_seconds = time.perf_counter() - start
    placed = {
        "target": bytes_per_device(target),
        "drafter": bytes_per_device(state.params),
        "optimizer": bytes_per_device(state.opt_state),
        "batch": bytes_per_device(batch),
    }
    start, start_cpu = time.perf_counter(), time.process_time()
    try:
        compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e) or platform != "tpu":
            raise
        compiled, refusal = None, str(e)
    compile_seconds, compile_cpu_seconds = time.perf_counter() - start, time.process_time() - start_cpu
    rows, seq_len = setup.data.global_batch_rows, setup.data.seq_len
    common = dict(
        mesh=mesh_axes_description(mesh),
        layout=sharding.layout_of(mesh),
        platform=platform,
        num_devices=mesh.devices.size,
        rows=rows,
        seq_len=seq_len,
        grad_accum_steps=setup.run.grad_accum_steps,
        bytes_per_device=placed,
        model_flops=model_flops_per_step(setup, rows, seq_len),
        remat_flops=remat_flops_per_step(setup, rows, seq_len),
        tokens=rows * seq_len,
        block_tokens=rows * setup.objective.num_anchors * setup.drafter.block_size,
        drafter_kind=setup.drafter.kind,
        compile_seconds=compile_seconds,
        lower_seconds=lower_seconds,
        compile_cpu_seconds=compile_cpu_seconds,
        device_kind=devices[0].device_kind,
        kernel_fallbacks=tuple(kernel_fallbacks),
    )
    if compiled is None:
        return _refused_plan(refusal, common)
    memory = compiled.memory_analysis()
    text = compiled.as_text()
    if hlo_path:
        with open(hlo_path, "w", encoding="utf-8") as f:
            f.write(text)
    program = hlo_text.Module(text)
    peak = int(getattr(memory, "peak_memory_in_bytes", 0) or 0)
    derived = memory.argument_size_in_bytes + memory.output_size_in_bytes - memory.alias_size_in_bytes
    derived += memory.temp_size_in_bytes
    return Plan(
        **common,
        arguments=memory.argument_size_in_bytes,
        outputs=memory.output_size_in_bytes,
        aliased=memory.alias_size_in_bytes,
        temporaries=memory.temp_size_in_bytes,
        peak=max(peak, derived),
        collectives=tuple(collectives(program)),
        kernels=tuple(hlo.kernels(program)),
        generated_code=memory.generated_code_size_in_bytes,
        compiler_costs=compiler_costs(compiled) if platform != "cpu" else {},
    )


def compiler_costs(compiled) -> dict[str, float]:
    """The compiler's FLOPs and bytes accessed of one device's program: its own cost analysis
    (TPU), else XLA's HloCostAnalysis over the optimized module (XLA:GPU deviceless gives none).
    Either counts a loop's body once."""
    costs = compiled.cost_analysis()
    if not costs:
        from jax._src.lib import _jax  # HloCostAnalysis has no public binding

        module = compiled.runtime_executable().hlo_modules()[0]
        costs = _jax.hlo_module_cost_analysis(jax.devices("cpu")[0].client, module)
    return {"flops": float(costs.get("flops", 0.0)), "bytes": float(costs.get("bytes accessed", 0.0))}


_SIZE = r"([0-9.]+)([KMGT]?)"
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _refused_plan(refusal: str, common: dict) -> Plan:
    """The plan of a step the TPU compiler refused for HBM: "Used 20.5G of 15.75G hbm", else
    "memory required for HLO temporaries (32.00G) exceeds available HBM" on top of the arguments."""
    arguments = sum(common["bytes_per_device"].values())

    def size(match, at):
        return int(float(match.group(at)) * _UNITS[match.group(at + 1)])

    used = re.search(rf"Used {_SIZE} of {_SIZE} hbm", refusal)
    temporaries = re.search(rf"HLO temporaries \({_SIZE}\)", refusal)
    temps = size(temporaries, 1) if temporaries else 0
    peak = size(used, 1) if used else arguments + temps
    line = next((t.strip() for t in refusal.splitlines() if "memory" in t.lower()), refusal.splitlines()[0])
    return Plan(
        **common,
        arguments=arguments,
        outputs=0,
        aliased=0,
        temporaries=temps or max(0, peak - arguments),
        peak=peak,
        collectives=(),
        kernels=(),
        out_of_memory=line.removeprefix("RESOURCE_EXHAUSTED: "),
    )


@dataclasses.dataclass(frozen=True)
class MeshChoice:
    """A mesh the step fits on, by estimate (`smallest_fitting_mesh`)."""

    hosts: int
    devices_per_host: int
    shape: tuple[int, int, int]  # (data, fsdp, tensor)
    target_bytes: int  # per device: the frozen target's weights, from their shardings (exact)
    peak: int  # per device: target_bytes + the rest of the compiled plan (estimate)
    experts_per_device: int  # of each mixture-of-experts layer; 0 when the target has none
    expert_axes: tuple[str, ...]  # the mesh axes the experts are split over


def smallest_fitting_mesh(
    setup: TrainSetup,
    plan: Plan,
    hbm_bytes: float,
    *,
    devices_per_host: int,
    max_hosts: int = 512,
    min_hosts: int = 1,
    sizes: Callable[[int], bool] = lambda devices: True,
) -> MeshChoice | None:
    """The fewest hosts of `devices_per_host` devices on which the step of `plan` fits, by estimate.

    Candidates split the target over every device: data=1, the plan's tensor axis (within a host),
    fsdp the rest, the global batch's rows divisible by fsdp x grad_accum_steps as `resolve`
    requires. A candidate's peak is its frozen target's bytes per device, computed exactly from the
    parameters' shardings on that mesh, plus the rest of the compiled plan scaled to the candidate:
    the drafter and optimizer state (split over every device) by the ratio of devices, everything
    else (activations and temporaries, which follow the rows a device holds) by the ratio of row
    groups (data x fsdp). Compile the candidate (`--num_devices`) to confirm. None when no
    candidate of `min_hosts` to `max_hosts` hosts, of a device count `sizes` accepts (a TPU
    slice's), fits.
    """
    data, fsdp, tensor = setup.mesh_shape
    b = plan.bytes_per_device
    state = b["drafter"] + b["optimizer"]
    activations = plan.peak - b["target"] - state
    params = nnx.split(nnx.eval_shape(lambda: step_lib.new_target(setup)))[1]
    leaves = [(path, leaf.shape, leaf.dtype) for path, leaf in jax.tree_util.tree_leaves_with_path(params)]
    rows = setup.data.global_batch_rows // setup.run.grad_accum_steps
    for hosts in range(min_hosts, max_hosts + 1):
        devices = hosts * devices_per_host
        if devices % tensor or rows % (devices // tensor) or not sizes(devices):
            continue
        mesh = {sharding.DATA_AXIS: 1, sharding.FSDP_AXIS: devices // tensor, sharding.TENSOR_AXIS: tensor}
        target = sum(_shard_bytes(mesh, path, shape, dtype) for path, shape, dtype in leaves)
        rest = state * plan.num_devices / devices + activations * data * fsdp * tensor / devices
        if target + rest <= USABLE_FRACTION * hbm_bytes:
            experts, axes = _experts_per_device(mesh, leaves)
            shape = (1, devices // tensor, tensor)
            return MeshChoice(hosts, devices_per_host, shape, target, int(target + rest), experts, axes)
    return None


def _shard_bytes(mesh: dict[str, int], path, shape, dtype) -> int:
    spec = parameters.param_spec(mesh, path, shape)
    split = [math.prod(mesh[a] for a in sharding.spec_axes(entry)) for entry in spec] + [1] * (len(shape) - len(spec))
    return math.prod(-(-dim // n) for dim, n in zip(shape, split)) * jnp.dtype(dtype).itemsize


def _experts_per_device(mesh: dict[str, int], leaves) -> tuple[int, tuple[str, ...]]:
    """(experts of a layer one device holds, the mesh axes they are split over); (0, ()) without experts."""
    for path, shape, _ in leaves:
        names = parameters.param_axes(path)
        if sharding.EXPERTS in names:  # after LAYERS in a scanned segment's stacked weights
            axis = names.index(sharding.EXPERTS)
            axes = sharding.spec_axes(parameters.param_spec(mesh, path, shape)[axis])
            return shape[axis] // math.prod(mesh[a] for a in axes), axes
    return 0, ()


def format_mesh_choice(choice: MeshChoice | None, hbm_bytes: float, *, max_hosts: int = 512) -> str:
    """The plan's line naming the smallest mesh that fits (or that none does)."""
    usable = USABLE_FRACTION * hbm_bytes
    if choice is None:
        return f"  no mesh of up to {max_hosts} hosts fits {usable / GIB:.1f} GiB per device by estimate"
    data, fsdp, tensor = choice.shape
    devices = choice.hosts * choice.devices_per_host
    experts = (
        f"experts over {' x '.join(choice.expert_axes)}, {choice.experts_per_device} a device; "
        if choice.experts_per_device
        else ""
    )
    return (
        f"  smallest mesh that fits (estimate): {choice.hosts} hosts x {choice.devices_per_host} devices = {devices}, "
        f"data={data} x fsdp={fsdp} x tensor={tensor} ({experts}heads and MLP over tensor): target "
        f"{choice.target_bytes / GIB:.1f} GiB + the rest of this plan scaled to it = {choice.peak / GIB:.1f} "
        f"GiB of {usable / GIB:.1f} GiB per device; confirm with --num_devices={devices}"
    )


# ---------------------------------------------------------------------------------------------
# The report.


def _gib(n: float) -> str:
    return f"{n / GIB:7.2f} GiB"


# What a collective's count means when a loop around it has a data-dependent length.
_TRIPS_NOTES = {
    hlo_text.EXPECTED: " (count at the trips balanced routing needs)",
    hlo_text.UNKNOWN: " (count per loop iteration: trip count unknown)",
}


def _gb(n: float) -> str:
    return f"{n / 1e9:8.2f} GB"


def verdict(plan: Plan, hbm_bytes: float, *, fsdp: int, tensor: int, remat: bool, remat_policy: str = "full") -> str:
    """'fits: …' or 'DOES NOT FIT: … try …' with what would reduce the peak."""
    usable = USABLE_FRACTION * hbm_bytes
    if plan.fits(hbm_bytes):
        return f"fits: {plan.peak / GIB:.1f} GiB of {usable / GIB:.1f} GiB usable per device"
    tips = [] if not plan.out_of_memory else [f"(the compiler: {plan.out_of_memory})"]
    if fsdp == 1:
        tips.append("split the target over devices (variant :fsdp, or --config.mesh.fsdp=4)")
    if tensor == 1 and plan.bytes_per_device["target"] > 0.4 * usable:
        tips.append("split its heads and MLP (--config.mesh.tensor=2, 4 or 8)")
    tips.append("fewer rows per device (--config.train.grad_accum_steps=2 keeps the global batch)")
    if not remat:
        tips.append("--config.train.remat=True")
    elif remat_policy != "full":
        tips.append("--config.train.remat_policy=full")
    tips.append("smaller train.lm_head_chunk_blocks / train.attention_chunk_blocks")
    over = f"{plan.peak / GIB:.1f} GiB > {usable / GIB:.1f} GiB usable per device (by {(plan.peak - usable) / GIB:.1f} GiB)"
    return f"DOES NOT FIT: {over}; try " + "; ".join(tips)


def _devices(plan: Plan) -> str:
    """'2 cpu devices', or the device kind and its compiler: '<device_kind> devices, compiled by XLA:GPU'."""
    if plan.platform == "cpu":
        return "cpu devices"
    return f"{plan.device_kind} devices, compiled by {'XLA:GPU' if plan.platform == 'gpu' else 'XLA:TPU'}"


def format_plan(
    plan: Plan, hbm_bytes: float, *, title: str, fsdp: int, tensor: int, remat: bool, remat_policy: str = "full"
) -> str:
    b = plan.bytes_per_device
    usable = USABLE_FRACTION * hbm_bytes
    lines = [
        f"plan: {title}",
        f"  mesh {plan.mesh} ({plan.num_devices} {_devices(plan)}), layout '{plan.layout}';"
        f" {plan.rows} rows x {plan.seq_len}, grad_accum_steps={plan.grad_accum_steps};"
        f" lowered in {plan.lower_seconds:.0f} s, compiled in {plan.compile_seconds:.0f} s",
        "  per device:",
        f"    target weights (frozen)  {_gib(b['target'])}",
        f"    drafter weights (fp32)   {_gib(b['drafter'])}",
        f"    optimizer state          {_gib(b['optimizer'])}",
        f"    batch                    {_gib(b['batch'])}",
        f"    arguments in all         {_gib(plan.arguments)}",
        f"    outputs (not in place)   {_gib(plan.outputs - plan.aliased)}",
        f"    temporaries              {_gib(plan.temporaries)}",
        *([f"    generated code           {_gib(plan.generated_code)}"] if plan.generated_code else []),
        f"    total                    {_gib(plan.peak)}  of {usable / GIB:.1f} GiB usable"
        f" ({USABLE_FRACTION:.0%} of {hbm_bytes / GIB:g} GiB)",
        f"  {verdict(plan, hbm_bytes, fsdp=fsdp, tensor=tensor, remat=remat, remat_policy=remat_policy)}",
        *(f"  {reason}" for reason in plan.kernel_fallbacks),
        f"  model FLOPs per step {plan.model_flops / 1e12:,.1f} TFLOP"
        f" (+ {plan.remat_flops / 1e12:,.1f} TFLOP recomputed in the backward pass)",
        f"  tokens per step {plan.tokens:,} ({plan.rows} x {plan.seq_len}); drafter block tokens {plan.block_tokens:,}"
        f" ({plan.drafter_kind})",
    ]
    if plan.platform != "cpu" and not plan.out_of_memory:
        costs = plan.compiler_costs
        lines.append(
            f"  the compiler's cost analysis (loop bodies once), per device: {costs.get('flops', 0) / 1e12:,.2f} TFLOP,"
            f" {costs.get('bytes', 0) / 1e9:,.2f} GB accessed"
        )
    if not plan.collectives:
        lines.append("  collectives: none")
        return "\n".join(lines)
    total = sum(c.bytes * c.count for c in plan.collectives)
    lines.append(f"  collectives per step, per device (whole buffers): {total / 1e9:,.2f} GB")
    groups: dict[tuple[str, str, int], list[Collective]] = defaultdict(list)
    for c in plan.collectives:
        groups[(c.region, c.kind, c.group_size)].append(c)
    for (region, kind, group), ops in sorted(groups.items(), key=lambda kv: -sum(c.bytes * c.count for c in kv[1])):
        biggest = max(ops, key=lambda c: c.bytes * c.count)
        unknown = _TRIPS_NOTES.get(hlo_text.least_sure(*(c.trips for c in ops)), "")
        over = f"over {group}" if group else ""
        lines.append(
            f"    {region:<17s} {kind:<18s} {over:<7s} {_gb(sum(c.bytes * c.count for c in ops))}"
            f" {sum(c.count for c in ops):5d} ops, largest {biggest.bytes / 1e6:,.1f} MB x {biggest.count}{unknown}"
        )
    return "\n".join(lines)
