"""Sharding by name (docs/design.md §8): logical axis names, one rules table per layout.

Every parameter names its axes with logical names (models/parameters.py, from the partition rules
of the modules that define them), and so do the main activations (`constrain`). A rules table maps
logical names to mesh axes; there is one table per layout, and the layout follows from the mesh
shape (`layout_of`):

    data    data=N              the frozen target whole on every device
    fsdp    data x fsdp         the target split over `fsdp` (embed; the LM head and embedding by vocab;
                                a mixture of experts by expert: expert-parallel weights)
    tensor  data x fsdp x tensor  the target's heads, kv heads and MLP split over `tensor` (Megatron
                                style), vocab and experts over (fsdp, tensor), embed over fsdp

Batch rows are split over (data, fsdp) in every layout, never over `tensor`. The trained state
(the drafter's fp32 master weights and the AdamW moments) is split ZeRO-style over every device
in every layout (`ZERO_RULES`): the step gathers a weight (its compute-dtype copy) where it is
used and reduces its gradient back onto the split, so no device holds a whole copy of the
optimizer state. The drafter's activations follow the layout's rules like the target's, so in
`tensor` its heads and MLP are split too.

Resolving a logical spec (`logical_to_spec`) walks the rules in order: each rule gives its
mesh axes to every array axis of that logical name, skipping mesh axes of size 1 and those an
earlier rule already gave to another axis of the same array (a mesh axis splits an array once).
The order is the priority: in `fsdp` and `tensor`, vocab comes before batch, so the logits of a
chunk are split over vocab and their rows over `data` only (the vocab-parallel cross-entropy of
`training/objective.py`). An axis that the mesh axes do not divide drops trailing mesh axes until
they do, or stays whole.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import re
from collections.abc import Iterator, Mapping, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

# Mesh axes.
DATA_AXIS = "data"  # pure data parallelism
FSDP_AXIS = "fsdp"  # data parallelism whose members also split the frozen target's weights
TENSOR_AXIS = "tensor"  # model parallelism: the target's heads and MLP
MESH_AXES = (DATA_AXIS, FSDP_AXIS, TENSOR_AXIS)
BATCH_MESH_AXES = (DATA_AXIS, FSDP_AXIS)  # batch rows are split over these

# Logical axes.
BATCH = "batch"  # rows of a batch
EMBED = "embed"  # the model dimension
HEADS = "heads"  # query heads (x head_dim when flattened in a kernel)
KV_HEADS = "kv_heads"  # key/value heads (x head_dim)
MLP = "mlp"  # the SwiGLU intermediate dimension
VOCAB = "vocab"
FEATURES = "features"  # the drafter's input: k target layers' hidden states, concatenated
EXPERTS = "experts"  # the experts of a mixture-of-experts MLP
NORM = "norm"  # RMSNorm scales: never split (tiny, and used everywhere)
LAYERS = "layers"  # the leading axis of a scanned segment's stacked weights (models/layers/layer_stack.py): never split

Rules = tuple[tuple[str, tuple[str, ...]], ...]
# (regex ending a parameter's path, its logical axes): what a module that defines parameters
# declares about them (collected in models/parameters.py).
PartitionRules = tuple[tuple[str, tuple[str | None, ...]], ...]

# One table per layout: (logical axis, mesh axes), in priority order.
RULES: dict[str, Rules] = {
    "data": ((BATCH, BATCH_MESH_AXES),),
    "fsdp": (
        (VOCAB, (FSDP_AXIS,)),
        (EXPERTS, (FSDP_AXIS,)),
        (BATCH, BATCH_MESH_AXES),
        (EMBED, (FSDP_AXIS,)),
    ),
    "tensor": (
        (VOCAB, (FSDP_AXIS, TENSOR_AXIS)),
        (EXPERTS, (FSDP_AXIS, TENSOR_AXIS)),
        (HEADS, (TENSOR_AXIS,)),
        (KV_HEADS, (TENSOR_AXIS,)),
        (MLP, (TENSOR_AXIS,)),
        (BATCH, BATCH_MESH_AXES),
        (EMBED, (FSDP_AXIS,)),
    ),
}

# The trained state (master weights, optimizer moments), every layout: split over all devices.
# Heads and MLP go to `tensor` first, as the compute splits them (so gathering a weight for use is
# a plain all-gather over data x fsdp), then embed (else the next axis the rest divides) takes the
# remaining mesh axes.
ZERO_RULES: Rules = (
    (HEADS, (TENSOR_AXIS,)),
    (KV_HEADS, (TENSOR_AXIS,)),
    (MLP, (TENSOR_AXIS,)),
    *((name, MESH_AXES) for name in (EMBED, MLP, HEADS, KV_HEADS, FEATURES, VOCAB)),
)


def layout_of(mesh: Mesh | Mapping[str, int]) -> str:
    """The rules table a mesh uses: 'tensor' if it has a tensor axis, else 'fsdp' if it has an
    fsdp axis, else 'data'."""
    shape = _mesh_shape(mesh)
    if shape.get(TENSOR_AXIS, 1) > 1:
        return "tensor"
    if shape.get(FSDP_AXIS, 1) > 1:
        return "fsdp"
    return "data"


def logical_to_spec(
    logical_axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh | Mapping[str, int], rules: Rules
) -> PartitionSpec:
    """A PartitionSpec for an array of `shape` whose axes have these logical names (see the module
    docstring for how the rules are applied)."""
    sizes = _mesh_shape(mesh)
    if len(logical_axes) != len(shape):
        raise ValueError(f"logical axes {tuple(logical_axes)} do not match shape {tuple(shape)}")
    assigned: list[str | tuple[str, ...] | None] = [None] * len(shape)
    used: set[str] = set()
    for logical, mesh_axes in rules:
        for i, name in enumerate(logical_axes):
            if name != logical or assigned[i] is not None:
                continue
            chosen = [a for a in mesh_axes if sizes.get(a, 1) > 1 and a not in used]
            while chosen and shape[i] % math.prod(sizes[a] for a in chosen):
                chosen.pop()
            if chosen:
                assigned[i] = chosen[0] if len(chosen) == 1 else tuple(chosen)
                used.update(chosen)
    return PartitionSpec(*assigned)


def layout_spec(
    mesh: Mesh | Mapping[str, int], logical_axes: Sequence[str | None], shape: Sequence[int]
) -> PartitionSpec:
    """Where a model weight whose axes have these logical names lives under the mesh's layout."""
    return logical_to_spec(logical_axes, shape, mesh, RULES[layout_of(mesh)])


def is_stacked(path: str | Sequence) -> bool:
    """Whether the parameter at `path` stacks the layers of a scanned segment (`LayerStack`)."""
    name = path if isinstance(path, str) else dotted(path)
    return re.search(r"(^|\.)stacked\.\d+\.", name) is not None


# ---------------------------------------------------------------------------------------------
# Activations: `constrain(x, (BATCH, ..., HEADS, None))` inside `activation_sharding(mesh)`.

_ACTIVE: contextvars.ContextVar[tuple[Mesh, Rules] | None] = contextvars.ContextVar("dflash_sharding", default=None)


@contextlib.contextmanager
def activation_sharding(mesh: Mesh, rules: Rules | None = None) -> Iterator[None]:
    """While tracing inside this context, `constrain` places activations on `mesh` by `rules`
    (default: the mesh's layout)."""
    token = _ACTIVE.set((mesh, RULES[layout_of(mesh)] if rules is None else rules))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


@contextlib.contextmanager
def per_device() -> Iterator[None]:
    """While tracing a shard_map body: its arrays are one device's blocks, so `constrain` leaves
    them alone."""
    token = _ACTIVE.set(None)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active_mesh() -> Mesh | None:
    """The mesh of the enclosing `activation_sharding`; None outside it."""
    active = _ACTIVE.get()
    return None if active is None else active[0]


def activation_spec(x_shape: Sequence[int], logical_axes: Sequence) -> PartitionSpec | None:
    """The spec `constrain` would give; None outside `activation_sharding`. `...` in the logical
    axes stands for as many unnamed axes as the rank needs."""
    active = _ACTIVE.get()
    if active is None:
        return None
    mesh, rules = active
    return logical_to_spec(_expand(logical_axes, len(x_shape)), x_shape, mesh, rules)


def constrain(x: jax.Array, logical_axes: Sequence) -> jax.Array:
    """`with_sharding_constraint` by logical names; the identity outside `activation_sharding`."""
    spec = activation_spec(x.shape, logical_axes)
    if spec is None:
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(_ACTIVE.get()[0], spec))


def constrain_spec(x: jax.Array, spec: PartitionSpec | None) -> jax.Array:
    if spec is None or _ACTIVE.get() is None:
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(_ACTIVE.get()[0], spec))


def _expand(logical_axes: Sequence, rank: int) -> tuple:
    axes = tuple(logical_axes)
    if Ellipsis in axes:
        i = axes.index(Ellipsis)
        axes = axes[:i] + (None,) * (rank - len(axes) + 1) + axes[i + 1 :]
    return axes


def spec_axes(entry) -> tuple[str, ...]:
    """A PartitionSpec entry (None, one mesh axis or a tuple of them) as a tuple of axis names."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _mesh_shape(mesh: Mesh | Mapping[str, int]) -> dict[str, int]:
    return dict(mesh.shape) if isinstance(mesh, Mesh) else dict(mesh)


def dotted(path: Sequence) -> str:
    """A pytree key path (or tuple of names) as 'layers.0.mlp.up_proj.kernel', without `.value`."""
    parts = []
    for key in path:
        for attr in ("key", "idx", "name"):
            if hasattr(key, attr):
                key = getattr(key, attr)
                break
        parts.append(str(key))
    if parts and parts[-1] == "value":
        parts.pop()
    return ".".join(parts)
