"""An optimized HLO module's text, parsed: its computations, their instructions, and how often one
step runs each computation, the trip counts of the loops around it multiplied in.

A trip count is the compiler's annotation, else read from the loop's counter (its start, limit
and step), else the `expected_trips=N` named scope a model puts around a loop of data-dependent
length (an expert-parallel MoE's chunks of routed pairs), else unknown (the loop counts once).
`training/planning/hlo.py` reads costs from it.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict
from collections.abc import Iterator

_DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
}
SHAPE = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]m[0-9]\w*)?)\[([0-9,]*)\]")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*\))?\s*->.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"\s([a-z][a-z0-9\-]*)\(")
_NAME = re.compile(r"%([\w.\-]+)")
_PAREN = re.compile(r"[()]")
CALLED = re.compile(r"\b(body|condition|to_apply|calls|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
OP_NAME = re.compile(r'op_name="([^"]*)"')
_QUOTED = re.compile(r'"(?:[^"\\]|\\.)*"')
_SCALAR_INTEGERS = ("s32[]", "u32[]", "s64[]", "u64[]")
_INDEX = re.compile(r"\bindex=(\d+)")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"')

# Ops whose callees run as programs of their own (loops, calls, branches); any other op's callee
# is a fusion's body (`calls=` of a fusion) or a scalar function applied elementwise (`to_apply=`).
_CONTROL_FLOW = ("while", "call", "conditional", "async-start")

# How the trip counts of the loops around an op were found, surest first: read from the program;
# EXPECTED for a loop of data-dependent length, at the trips its `expected_trips=N` scope states
# (an expert-parallel MoE's chunks of routed pairs under balanced routing); UNKNOWN, counted once.
READ, EXPECTED, UNKNOWN = "read", "expected", "unknown"


def least_sure(*hows: str) -> str:
    """The least sure of some ways trip counts were found (an op inside loops found several ways)."""
    return max(hows, key=(READ, EXPECTED, UNKNOWN).index)


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    type: str  # the result type: 'f32[8,4]{1,0}', or a tuple of them
    opcode: str
    operands: tuple[str, ...]  # names of the operands
    arguments: str  # the text between the parentheses (a constant's value)
    attributes: str  # the text after them
    is_root: bool


class Module:
    """A parsed HLO module: computations (instructions in order) and how often each runs."""

    def __init__(self, text: str):
        self.computations: dict[str, list[Instruction]] = {}
        self.entry: str | None = None
        current = None
        for line in _statements(text):
            header = _COMPUTATION.match(line)
            if header and "=" not in line.split("(")[0]:
                current = header.group(1)
                self.computations[current] = []
                if line.startswith("ENTRY"):
                    self.entry = current
                continue
            if current is None:
                continue
            if line.strip() == "}":
                current = None
                continue
            instruction = _parse_instruction(line)
            if instruction is not None:
                self.computations[current].append(instruction)
        self.named = {c: {i.name: i for i in body} for c, body in self.computations.items()}
        self.runs = self._runs()

    def _runs(self) -> dict[str, tuple[int, str]]:
        """(runs per step, how the trip counts around it were found) of each computation that runs
        as a program (the entry, loop bodies and conditions, called computations, branches)."""
        calls: dict[str, list[tuple[str, int, str]]] = defaultdict(list)
        for name, body in self.computations.items():
            for ins in body:
                if ins.opcode not in _CONTROL_FLOW:
                    continue
                callee = dict(CALLED.findall(ins.attributes))
                if ins.opcode == "while":
                    trips, how = self._trip_count(name, ins, callee)
                    calls[name].append((callee["body"], trips, how))
                    calls[name].append((callee["condition"], trips + 1, how))
                    continue
                for key in ("to_apply", "calls", "true_computation", "false_computation"):
                    if key in callee:
                        calls[name].append((callee[key], 1, READ))
                for group in _BRANCHES.findall(ins.attributes):
                    calls[name].extend((c.strip().lstrip("%"), 1, READ) for c in group.split(","))
        runs: dict[str, tuple[int, str]] = {}

        def visit(name: str, mult: int, how: str, depth: int = 0) -> None:
            if depth > 64 or name not in self.computations:
                return
            old = runs.get(name, (0, READ))
            runs[name] = (old[0] + mult, least_sure(old[1], how))
            for callee, m, h in calls.get(name, []):
                visit(callee, mult * m, least_sure(how, h), depth + 1)

        if self.entry is not None:
            visit(self.entry, 1, READ)
        return runs

    def _trip_count(self, computation: str, loop: Instruction, callee: dict[str, str]) -> tuple[int, str]:
        """(iterations of `loop`, a while in `computation`; how they were found): READ from the
        compiler's annotation or a counted loop (`_counted_trips`); else EXPECTED from the
        loop's `expected_trips=N` scope; else 1, UNKNOWN."""
        trips = self._counted_trips(computation, loop, callee)
        if trips is not None:
            return trips, READ
        expected = stated(loop.attributes, "expected_trips")
        return (expected, EXPECTED) if expected is not None else (1, UNKNOWN)

    def _counted_trips(self, computation: str, loop: Instruction, callee: dict[str, str]) -> int | None:
        """The compiler's annotation, else read from a counted loop `i < N` whose body adds a
        constant step to i (XLA:TPU's windowed matmul loops step by 2, counting in u32) from a
        constant start (0 when not one); None when the trip count is not in the program."""
        known = _TRIP_COUNT.search(loop.attributes)
        if known:
            return int(known.group(1))
        condition = self.named.get(callee.get("condition"), {})
        for compare in condition.values():
            if compare.opcode != "compare" or "direction=LT" not in compare.attributes:
                continue
            counter, limit = (condition.get(o) for o in (*compare.operands, "", "")[:2])
            if counter is None or limit is None or counter.opcode != "get-tuple-element":
                continue
            if limit.opcode != "constant" or not limit.type.startswith(_SCALAR_INTEGERS):
                continue
            index = _tuple_index(counter)
            body = self.named.get(callee.get("body"), {})
            root = next((i.name for i in body.values() if i.is_root), "")
            update = _tuple_element(body, root, index)  # i + step
            steps = [_constant(body.get(o)) for o in update.operands] if update and update.opcode == "add" else []
            step = next((c for c in steps if c is not None), None) or 1
            start = _constant(_tuple_element(self.named[computation], (*loop.operands, "")[0], index)) or 0
            return max(0, -(-(int(limit.arguments) - start) // step))
        # Else a loop whose condition holds one integer constant and compares less-than: i < N from 0.
        constants = [i for i in condition.values() if i.opcode == "constant" and i.type.startswith(_SCALAR_INTEGERS)]
        compares = [i for i in condition.values() if i.opcode == "compare" and "direction=LT" in i.attributes]
        if len(constants) == 1 and compares and constants[0].arguments.isdigit():
            return int(constants[0].arguments)
        return None

    def operand_type(self, computation: str, name: str) -> str:
        operand = self.named[computation].get(name)
        return operand.type if operand else ""


def _statements(text: str) -> Iterator[str]:
    """The module's lines, each instruction on one: a kernel's attributes may span several lines
    (XLA:TPU prints a Pallas call's `kernel_metadata` with newlines, its `metadata` after them)."""
    pending = ""
    for line in text.splitlines():
        if pending:
            pending += " " + line.strip()
        elif _INSTRUCTION.match(line):
            pending = line
        else:
            yield line
            continue
        if _open_braces(pending) <= 0:
            yield pending
            pending = ""
    if pending:
        yield pending


def _open_braces(line: str) -> int:
    """Braces opened and not closed in `line`, outside its quoted strings."""
    if '"' in line:
        line = _QUOTED.sub("", line)
    return line.count("{") - line.count("}")


def _parse_instruction(line: str) -> Instruction | None:
    match = _INSTRUCTION.match(line)
    if not match:
        return None
    rhs = match.group(3)
    opcode = _OPCODE.search(" " + rhs)
    if not opcode:
        return None
    start = opcode.end(0) - 1  # just after '(' in rhs (the search ran on ' ' + rhs)
    depth, end = 1, len(rhs) + 1
    for paren in _PAREN.finditer(rhs, start):
        depth += 1 if paren.group(0) == "(" else -1
        if not depth:
            end = paren.end(0)
            break
    return Instruction(
        name=match.group(2),
        type=rhs[: opcode.start(0)].strip(),
        opcode=opcode.group(1),
        operands=tuple(_NAME.findall(rhs[start : end - 1])),
        arguments=rhs[start : end - 1],
        attributes=rhs[end:],
        is_root=bool(match.group(1)),
    )


def stated(attributes: str, key: str) -> int | None:
    """N of a `key=N` named scope around an op (what a model states the program cannot show:
    models/layers/moe.py's `expected_trips`, `expected_groups`), or None."""
    op_name = OP_NAME.search(attributes)
    value = re.search(rf"\b{key}=(\d+)", op_name.group(1)) if op_name else None
    return int(value.group(1)) if value else None


def _tuple_index(ins: Instruction) -> int:
    return int(_INDEX.search(ins.attributes).group(1))


def _tuple_element(named: dict[str, Instruction], tuple_name: str, index: int) -> Instruction | None:
    """Element `index` of the tuple instruction `tuple_name`; None when it is not one."""
    tup = named.get(tuple_name)
    if tup is None or tup.opcode != "tuple" or index >= len(tup.operands):
        return None
    return named.get(tup.operands[index])


def _constant(ins: Instruction | None) -> int | None:
    """The value of an integer scalar constant, else None."""
    if ins is None or ins.opcode != "constant" or not ins.arguments.lstrip("-").isdigit():
        return None
    return int(ins.arguments)


def type_bytes(text: str) -> int:
    """Bytes of every array in a type ('f32[8,4]{1,0}', tuples summed)."""
    total = 0
    for dtype, dims in SHAPE.findall(text):
        size = _DTYPE_BYTES.get(dtype, 1 if dtype.startswith("f8") else None)
        if size is None:
            continue
        total += size * math.prod(int(d) for d in dims.split(",") if d)
    return total


def dims(text: str) -> list[int]:
    shape = SHAPE.search(text)
    return [int(d) for d in shape.group(2).split(",") if d] if shape else []
