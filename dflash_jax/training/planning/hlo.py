"""What one step of a compiled HLO module does, read from its text (optimized and SPMD-partitioned:
one device's program; `training/planning/hlo_text.py` parses it and counts each computation's runs).

`collectives` lists the collectives with their bytes; `kernels` lists every kernel the device
runs (a top-level op or fusion) with its matmul FLOPs and the memory it reads and writes;
`buffer_band` bounds the temporaries a compiler may plan for it.
XLA's own cost analysis counts a loop's body once, and a train step is mostly loops
(micro-batches, attention and LM-head chunks), hence this walk. The plan prints both
(`training/planning/memory.py`) and the roofline estimate reads them (`training/planning/roofline.py`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict

from dflash_jax.models.kernels import cost, grouped_matmul
from dflash_jax.training.planning import hlo_text
from dflash_jax.training.planning.hlo_text import READ, Instruction, Module, type_bytes

COLLECTIVE_KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
REGIONS = ("lm_head", "drafter", "target")  # named scopes of the step, innermost first
ATTENTION = "attention"  # the named scope of the attention kernels (models/layers/attention.py, block_attention.py)
_TRANSFORM = re.compile(r"^(?:[\w.\-]+\()+|\)+$")  # 'transpose(jvp(drafter))': what autodiff wraps a scope in

_GROUPS_LIST = re.compile(r"replica_groups=\{\{([0-9,]*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[([0-9,]+)\]<=")
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\][^{]*\{([^}]*)\}")
_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([0-9,]*)\}")
_DIM_LABELS = re.compile(r"dim_labels=([^_]*)_([^-]*)->([\w]*)")
_WINDOW = re.compile(r"window=\{([^}]*)\}")
# A matmul a GPU compiler handed to a library (cuBLAS, cuBLASLt): its dimensions in backend_config.
_GEMM_CONTRACTING = re.compile(r'"lhs_contracting_dimensions":\[([^\]]*)\]')
# A Pallas TPU kernel's own CostEstimate in its backend_config: XLA cannot see inside a kernel,
# and the attention kernels state the work their data-dependent walks are expected to do
# (models/kernels/cost.py; a call that carries none, Triton's or splash's, states its FLOPs in a
# named scope).
_KERNEL_FLOPS = re.compile(r'"cost_estimate":\s*\{[^}]*"flops":\s*"?(\d+)')
_KERNEL_BYTES = re.compile(r'"cost_estimate":\s*\{[^}]*"bytes_accessed":\s*"?(\d+)')

# Ops that move no data of their own: aliases, tuples, control flow (their bodies are counted).
_NO_TRAFFIC = {
    "parameter",
    "constant",
    "get-tuple-element",
    "tuple",
    "bitcast",
    "while",
    "call",
    "conditional",
    "after-all",
    "partition-id",
    "replica-id",
    "opt-barrier",
    "add-dependency",
    "async-start",
    "async-done",
    "copy-done",  # its copy-start moves the data
}
_SLICING = ("dynamic-slice", "slice", "gather")  # read only what they output
_LAYOUT = re.compile(r"\{[^}]*\}")
_IN_PLACE = {"dynamic-update-slice": 1, "scatter": 2}  # ops updating operand 0 in place: their update's operand


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str  # one of COLLECTIVE_KINDS
    region: str  # the part of the step it came from (`region`)
    group_size: int  # devices taking part in each group (0 = unknown, e.g. collective-permute)
    bytes: int  # per device and occurrence: the full buffer (gathered, reduced or sent)
    count: int  # occurrences per step (trip counts of the loops around it multiplied in)
    trips: str = READ  # how those trip counts were found: READ, EXPECTED or UNKNOWN


@dataclasses.dataclass(frozen=True)
class Kernel:
    opcode: str  # the top-level op ('fusion' for a fused kernel)
    flops: float  # matmul FLOPs (dot, convolution) per run
    bytes: float  # memory read and written per run
    count: int  # runs per step
    trips: str = READ  # how the trip counts of the loops around it were found: READ, EXPECTED or UNKNOWN
    region: str = "other"  # the part of the step it computes for (`region`)


def _group_size(attributes: str) -> int:
    """Devices per replica group, from any of the three ways HLO prints them."""
    mesh = _GROUPS_MESH.search(attributes)
    if mesh:
        sizes = dict(re.findall(r"'([^']+)'=(\d+)", mesh.group(1)))
        return math.prod(int(sizes[a]) for a in re.findall(r"'([^']+)'", mesh.group(2)) if a in sizes)
    listed = _GROUPS_LIST.search(attributes)
    if listed:
        return len([d for d in listed.group(1).split(",") if d])
    iota = _GROUPS_IOTA.search(attributes)
    if iota:
        return int(iota.group(1).split(",")[-1])
    return 0


def region(attributes: str) -> str:
    """The part of the step an op computes for, from its named scopes (its metadata's op_name,
    autodiff's wrappers removed): the innermost of `REGIONS` ('other' outside them), with
    ' attention' added inside the attention scope ('drafter attention'). A fusion carries the
    scopes of the op at its root."""
    op_name = hlo_text.OP_NAME.search(attributes)
    scopes = [_TRANSFORM.sub("", s) for s in op_name.group(1).split("/")] if op_name else []
    part = next((r for r in REGIONS if r in scopes), "other")
    return f"{part} {ATTENTION}" if ATTENTION in scopes else part


def collectives(text: str | Module) -> list[Collective]:
    """Every collective of a compiled HLO module, with how often one step runs it.

    Bytes are per device and occurrence, the whole buffer: the gathered result of an all-gather,
    the reduced buffer of an all-reduce or reduce-scatter, what an all-to-all or
    collective-permute sends.
    """
    module = text if isinstance(text, Module) else Module(text)
    merged: dict[tuple, int] = defaultdict(int)
    for name, (runs, how) in module.runs.items():
        for ins in module.computations[name]:
            kind = ins.opcode.removesuffix("-start")
            if kind not in COLLECTIVE_KINDS or ins.opcode.endswith("-done"):
                continue
            if ins.opcode.endswith("-start"):  # (operands, results, ...) of an asynchronous collective
                size = max((type_bytes(f"{d}[{s}]") for d, s in hlo_text.SHAPE.findall(ins.type)), default=0)
            else:
                size = type_bytes(ins.type)
            group = _group_size(ins.attributes)
            if kind == "reduce-scatter":  # the result is one device's share of the reduced buffer
                size *= max(group, 1)
            merged[(kind, region(ins.attributes), group, size, how)] += runs
    ordered = sorted(merged.items(), key=lambda kv: -kv[0][3] * kv[1])
    return [Collective(k, r, g, s, c, h) for (k, r, g, s, h), c in ordered]


def kernels(text: str | Module) -> list[Kernel]:
    """Every kernel one step runs (top-level ops and fusions of the computations that run as
    programs; collectives excepted, see `collectives`) with its matmul FLOPs and memory traffic.

    Traffic is what a kernel reads and writes: its operands and result, except that slicing ops
    read only the slice, a fusion reads only the slices it takes of an operand, and an update in
    place (dynamic-update-slice, scatter, a fusion whose result is one) writes only the update.
    """
    module = text if isinstance(text, Module) else Module(text)
    merged: dict[tuple, int] = defaultdict(int)
    for name, (runs, how) in module.runs.items():
        for ins in module.computations[name]:
            if ins.opcode.removesuffix("-start").removesuffix("-done") in COLLECTIVE_KINDS:
                continue
            flops = _flops(module, name, ins)
            traffic = 0 if ins.opcode in _NO_TRAFFIC else _traffic(module, name, ins)
            if flops or traffic:
                merged[(ins.opcode, flops, traffic, how, region(ins.attributes))] += runs
    return [Kernel(op, f, b, c, trips=h, region=r) for (op, f, b, h, r), c in merged.items()]


# Ops whose result is no buffer of its own: aliases of another's, or a tuple of them.
_ALIASES = {"parameter", "get-tuple-element", "tuple", "bitcast", "while", "call", "conditional", "opt-barrier"}


def buffer_band(text: str | Module) -> tuple[int, int]:
    """(lowest, highest) bytes of temporaries a compiler can plan for this program, per device.

    Lowest: its largest buffer made inside a loop body or called program (never an argument or
    an output, so a temporary). Highest: every buffer the program makes, each once, live at once
    (no reuse at all). A plan outside the band misreports the program or is not its plan.
    """
    module = text if isinstance(text, Module) else Module(text)
    inner, total = 0, 0
    for name in module.runs:
        for ins in module.computations[name]:
            if ins.opcode in _ALIASES:
                continue
            size = type_bytes(ins.type)
            total += size
            if name != module.entry:
                inner = max(inner, size)
    return inner, total


def _flops(module: Module, computation: str, ins: Instruction) -> float:
    """Matmul FLOPs of a dot, a library GEMM call, a convolution or a kernel stating its cost (in
    its backend_config or a `kernel_flops=N` scope), or of those a fusion computes."""
    gemm = _GEMM_CONTRACTING.search(ins.attributes) if ins.opcode == "custom-call" else None
    if ins.opcode == "dot" or gemm:
        contracting = gemm or _CONTRACTING.search(ins.attributes)
        lhs = hlo_text.dims(module.operand_type(computation, ins.operands[0]))
        dims = [int(d.strip('" ')) for d in contracting.group(1).split(",") if d.strip('" ')] if contracting else []
        return 2.0 * math.prod(hlo_text.dims(ins.type)) * math.prod(lhs[d] for d in dims)  # first result: the product
    if ins.opcode == "convolution":
        return _convolution_flops(module, computation, ins)
    if _is_ragged_dot(ins):
        # Each row of lhs [M, K] times its group's [K, N] of rhs [G, K, N]: 2·M·N·K.
        lhs = next(
            (d for d in (hlo_text.dims(module.operand_type(computation, o)) for o in ins.operands) if len(d) == 2), []
        )
        return 2.0 * math.prod(hlo_text.dims(ins.type)) * (lhs[-1] if lhs else 0)
    if ins.opcode == "custom-call":
        kernel = _KERNEL_FLOPS.search(ins.attributes)
        stated = int(kernel.group(1)) if kernel else hlo_text.stated(ins.attributes, cost.KERNEL_FLOPS)
        if stated:
            return float(stated)
    if ins.opcode == "fusion":
        body = dict(hlo_text.CALLED.findall(ins.attributes)).get("calls")
        return sum(_flops(module, body, inner) for inner in module.computations.get(body, []))
    return 0.0


def _is_ragged_dot(ins: Instruction) -> bool:
    """The MoE's grouped matmul (`jax.lax.ragged_dot`): XLA's op, the Mosaic kernel XLA:TPU
    calls for it (a custom call named after it, beside the one computing its metadata), or the
    project's Triton kernel on GPUs (its name in the op's scopes)."""
    if ins.opcode == "ragged-dot":
        return True
    if ins.opcode != "custom-call":
        return False
    op_name = hlo_text.OP_NAME.search(ins.attributes)
    fused = op_name is not None and f"/{grouped_matmul.NAME}/" in op_name.group(1)
    return fused or (ins.name.startswith("ragged-dot") and "metadata" not in ins.name)


def _convolution_flops(module: Module, computation: str, ins: Instruction) -> float:
    """2 x the multiply-adds of a convolution whose operands are both real: per output, the input
    features of its group times the window positions that land on an input element, not on
    padding or a dilation hole. XLA:TPU writes dots as such convolutions (a head dimension as a
    window of size n padded by n - 1 on an input of size 1, a batch as a dilated window), where
    every window position but one per output multiplies padding."""
    lhs = hlo_text.dims(module.operand_type(computation, ins.operands[0]))
    rhs = hlo_text.dims(module.operand_type(computation, ins.operands[1]))
    out = hlo_text.dims(ins.type)
    labels = _DIM_LABELS.search(ins.attributes)
    if not labels:  # no labels: the operands' dimensions in XLA's default order, no window
        return 2.0 * math.prod(out) * (rhs[1] if len(rhs) > 1 else 1)
    lhs_labels, rhs_labels, out_labels = labels.groups()
    window = _window(ins.attributes, sum(c.isdigit() for c in rhs_labels))
    macs = math.prod(out) * rhs[rhs_labels.index("i")]
    for d, (size, stride, pad_low, lhs_dilation, rhs_dilation) in enumerate(window):
        in_size, out_size = lhs[lhs_labels.index(str(d))], out[out_labels.index(str(d))]
        real = {p * lhs_dilation for p in range(in_size)}  # input positions after dilation
        hits = sum(o * stride + k * rhs_dilation - pad_low in real for o in range(out_size) for k in range(size))
        macs = macs / out_size * hits
    return 2.0 * macs


def _window(attributes: str, spatial: int) -> list[tuple[int, int, int, int, int]]:
    """(size, stride, low padding, lhs dilation, rhs dilation) of each spatial dimension of a
    convolution's `window={size=AxB stride=.. pad=L_HxL_H lhs_dilate=.. rhs_dilate=..}`."""
    fields = dict(item.split("=", 1) for item in (_WINDOW.search(attributes) or [None, ""])[1].split() if "=" in item)

    def each(key: str, default: int) -> list[int]:
        if key not in fields:
            return [default] * spatial
        return [int(v.split("_")[0]) for v in fields[key].split("x")]

    sizes = each("size", 1)
    return list(zip(sizes, each("stride", 1), each("pad", 0), each("lhs_dilate", 1), each("rhs_dilate", 1)))


def _traffic(module: Module, computation: str, ins: Instruction) -> float:
    def operand_bytes(i: int) -> int:
        return type_bytes(module.operand_type(computation, ins.operands[i])) if i < len(ins.operands) else 0

    if ins.opcode in _SLICING:
        return 2 * type_bytes(ins.type)
    if ins.opcode == "dynamic-update-slice":
        return 2 * operand_bytes(1)
    if ins.opcode == "scatter":
        return 2 * operand_bytes(2) + operand_bytes(1)
    if _is_ragged_dot(ins):
        return _ragged_dot_traffic(module, computation, ins)
    kernel = _KERNEL_BYTES.search(ins.attributes) if ins.opcode == "custom-call" else None
    if kernel:
        return float(kernel.group(1))
    if ins.opcode == "copy-start":  # (destination, source, context): an asynchronous copy
        # Memory space S(n) in a layout is on-chip (a TPU's VMEM): only the other side is HBM.
        on_chip = any("S(" in layout for layout in _LAYOUT.findall(ins.type)[:2])
        return operand_bytes(0) * (1 if on_chip else 2)
    if ins.opcode == "fusion":
        body = dict(hlo_text.CALLED.findall(ins.attributes)).get("calls")
        if body in module.computations:
            return _fusion_traffic(module, body)
    read = sum(operand_bytes(i) for i in range(len(ins.operands)))
    if ins.opcode == "custom-call" and _GEMM_CONTRACTING.search(ins.attributes):
        return read + type_bytes(hlo_text.SHAPE.search(ins.type).group(0))  # (product, scratch): the product
    return read + type_bytes(ins.type)


def _ragged_dot_traffic(module: Module, computation: str, ins: Instruction) -> float:
    """A grouped matmul reads its rows and the weights [G, K, N] of the groups that get rows, and
    writes its product: all G groups' weights, or the share its `expected_groups=k` scope states
    (an expert-parallel MoE's chunk of sorted pairs reaches a few of a device's experts)."""
    expected = hlo_text.stated(ins.attributes, "expected_groups")
    read = 0.0
    for operand in ins.operands:
        kind = module.operand_type(computation, operand)
        size, shape = type_bytes(kind), hlo_text.dims(kind)
        if len(shape) == 3 and expected:  # the weights: the share of groups that get rows
            size *= min(1.0, expected / shape[0])
        read += size
    return read + type_bytes(hlo_text.SHAPE.search(ins.type).group(0))


def _fusion_traffic(module: Module, body: str) -> float:
    instructions = module.computations[body]
    by_name = {i.name: i for i in instructions}
    users: dict[str, list[Instruction]] = defaultdict(list)
    for ins in instructions:
        for operand in ins.operands:
            users[operand].append(ins)

    def final_users(name: str) -> list[tuple[Instruction, str]]:
        """(user, the operand it reads) through bitcasts."""
        out = []
        for user in users[name]:
            if user.opcode == "bitcast":
                out.extend(final_users(user.name))
            else:
                out.append((user, name))
        return out

    def parameter_of(name: str) -> str | None:
        ins = by_name.get(name)
        while ins is not None and ins.opcode == "bitcast":
            ins = by_name.get(ins.operands[0])
        return ins.name if ins is not None and ins.opcode == "parameter" else None

    root = next((i for i in reversed(instructions) if i.is_root), instructions[-1])
    outputs = [by_name[o] for o in root.operands] if root.opcode == "tuple" else [root]
    in_place: set[str] = set()  # parameters updated in place by a dynamic-update-slice or scatter output
    written = 0
    for out in outputs:
        if out.opcode in _IN_PLACE and parameter_of(out.operands[0]):
            in_place.add(parameter_of(out.operands[0]))
            # the update; a scatter also reads the rows it combines the update with
            update = module.operand_type(body, out.operands[_IN_PLACE[out.opcode]])
            written += type_bytes(update) * (2 if out.opcode == "scatter" else 1)
        else:
            written += type_bytes(out.type)

    def slice_read(user: Instruction, via: str) -> bool:
        return user.opcode in _SLICING and user.operands[0] == via

    read = 0
    for param in (i for i in instructions if i.opcode == "parameter"):
        uses = final_users(param.name)
        updated = param.name in in_place
        if uses and all(
            slice_read(u, via) or (updated and u.opcode in _IN_PLACE and u.operands[0] == via) for u, via in uses
        ):
            read += sum(type_bytes(u.type) for u, via in uses if slice_read(u, via))
        else:
            read += type_bytes(param.type)
    return read + written
