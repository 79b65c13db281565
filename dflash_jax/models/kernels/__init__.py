"""Fused attention kernels, one per attention pattern of training: for GPUs (Pallas on Triton,
below) and for TPUs (Pallas on Mosaic: `tpu_packed_causal`, jax's splash attention, for the
target; `tpu_block` for the drafter's blocks, the same walk in chunks of blocks).

* `packed_causal.packed_causal_attention`: the target's causal attention over packed rows,
  forward only (the target is frozen). Each tile of queries walks the key tiles from the start
  of its first query's document (or of its sliding window, if later) to the diagonal; tiles of
  earlier documents, or before the window, are never visited. Optional attention sinks.
* `block.block_attention`: the drafter's DFlash block attention (docs/design.md §3.2) with its
  backward pass. Each block's queries walk only the context tiles of its span (its document's
  keys before the anchor) and then its own block; the backward pass computes dq and the block's
  own dk/dv per block, and the context dk/dv per context tile by visiting only the blocks whose
  span covers that tile (blocks sorted by span end, so that set is one contiguous range).
* `grouped_matmul.grouped_matmul`: the MoE's grouped matmul on GPUs (forward only), each tile of
  rows sorted by expert multiplied by the experts its rows belong to, not by every expert.

`models/layers/attention.py` decides when these run (`implementation`); its XLA code is the reference
they are tested against (tests/models/test_attention_kernels.py, Pallas interpret mode on CPU).
On a machine without a GPU the kernels run in interpret mode: correct, slow, for tests only.

Both kernels assume what packing guarantees (docs/design.md §6.5): a row's documents are
contiguous runs of equal segment ids. Outputs at padding positions (segment 0) are unspecified;
nothing reads them.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterable, Iterator

import jax

# Masked scores: large, finite, negative (docs/design.md §3.2): a fully masked tile contributes
# exp(MASKED - m) = 0 once any visible key has been seen, and never NaN.
MASKED = -1e30
LOG2_E = 1.4426950408889634


_COMPILED_FOR = contextvars.ContextVar("dflash_kernels_compiled_for", default="")


def target_backend() -> str:
    """The backend programs are traced for: JAX's, or the one `compiled_for` names."""
    return _COMPILED_FOR.get() or jax.default_backend()


def interpret_mode() -> bool:
    """The Triton kernels compile for GPUs only; elsewhere they run in interpret mode (tests)."""
    return target_backend() != "gpu"


@contextlib.contextmanager
def compiled_for(backend: str) -> Iterator[None]:
    """Trace the kernels for `backend` ("gpu", "tpu") even on another one, and resolve attention
    'auto' as there: lets a CPU-only process lower them (`.lower(lowering_platforms=("cuda",))`,
    or a step over the devices of a GPU or TPU topology, `training/planning/compilers.py`) and compile them."""
    token = _COMPILED_FOR.set(backend)
    try:
        yield
    finally:
        _COMPILED_FOR.reset(token)


def compiled_for_gpu():
    return compiled_for("gpu")


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def supported_head_dim(head_dim: int) -> bool:
    """Triton tiles need power-of-two sizes; Qwen3 and Llama-3 use 128 (the tiny target 64)."""
    return head_dim >= 16 and head_dim == next_power_of_2(head_dim)


# ---------------------------------------------------------------------------------------------
# Tiles that fit: a Triton program whose tiles ask for more shared memory than the GPU gives one
# block does not compile (XLA:GPU: "Shared memory size limit exceeded"). Each kernel estimates
# what its tiles ask for and takes the first of its candidates that fits; where none does, the
# layer runs XLA's attention and says so (`fall_back`).


@dataclasses.dataclass(frozen=True)
class Tiles:
    rows: int  # query rows a program (or a loop step) multiplies at once
    keys: int  # keys a loop step reads
    stages: int  # Triton's software pipelining: a loop's reads are kept in this many copies


# Shared memory one block may opt in to, by CUDA compute capability (NVIDIA's CUDA C++ Programming
# Guide, technical specifications): 227 KiB on the data-center Hopper and Blackwell parts, what the
# target configs of the planner's Hopper and Blackwell GPUs say (training/planning/gpu_targets/, a
# test checks); 163 KiB on an A100; 99 KiB on the other Ampere, Ada and Blackwell parts.
SHARED_MEMORY_PER_BLOCK = {
    "8.0": 166_912,
    "8.6": 101_376,
    "8.9": 101_376,
    "9.0": 232_448,
    "10.0": 232_448,
    "12.0": 101_376,
}
# Besides the tiles Triton places barriers (a Hopper's figures are the estimates' exactly, a
# Blackwell asks 32 bytes more): a candidate must leave this much free.
SHARED_MEMORY_RESERVE = 1024


def shared_memory_per_block() -> int:
    """Of the GPU the program is traced for: the active mesh's devices (a GPU topology's when the
    planner compiles without one), else JAX's first device; a Hopper's (compute capability 9.0)
    where neither is a GPU (on a CPU the kernels run in interpret mode what a Hopper would run)."""
    from dflash_jax.models import sharding

    mesh = sharding.active_mesh()
    device = mesh.devices.flat[0] if mesh is not None else jax.devices()[0]
    capability = getattr(device, "compute_capability", None)
    if capability is None:
        return SHARED_MEMORY_PER_BLOCK["9.0"]
    return SHARED_MEMORY_PER_BLOCK.get(capability, min(SHARED_MEMORY_PER_BLOCK.values()))


def candidates(rows: int, keys: int) -> list[Tiles]:
    """Tiles of up to `rows` x `keys` (powers of two) and no side under 16 (Triton's dots), best
    first: pipelined (2 stages) before not, then the larger, then the one with more rows (from 64
    rows a matmul runs on Hopper's faster warpgroup instructions, `uses_warpgroup_matmuls`)."""
    sides = [16 << i for i in range(max(rows, keys).bit_length())]
    options = [Tiles(r, k, st) for r in sides if r <= rows for k in sides if k <= keys for st in (2, 1)]
    return sorted(options, key=lambda t: (-t.stages, -t.rows * t.keys, -t.rows))


def first_fitting(candidates: Iterable[Tiles], shared_memory: Callable[[Tiles], int]) -> Tiles | None:
    """The first candidate whose `shared_memory` estimate fits the GPU's, with the reserve."""
    limit = shared_memory_per_block() - SHARED_MEMORY_RESERVE
    return next((t for t in candidates if shared_memory(t) <= limit), None)


def uses_warpgroup_matmuls(rows: int) -> bool:
    """Triton (num_warps=4) multiplies a left operand of 64 rows or more with Hopper's warpgroup
    matmuls (wgmma), which read their right operand, and a loaded left one, from shared memory;
    fewer rows run mma.sync, whose operands pass through shared memory into registers."""
    return rows >= 64


def loop_buffers(tiles: Tiles) -> int:
    """Copies of a tile a pipelined loop reads: one a stage under warpgroup matmuls, one fewer
    under mma.sync (the next step's copy lands while registers hold this one's); one unpipelined."""
    if tiles.stages == 1:
        return 1
    return tiles.stages if uses_warpgroup_matmuls(tiles.rows) else tiles.stages - 1


def walk_shared_memory(tiles: Tiles, head_dim: int, itemsize: int, key_bytes: int = 0) -> int:
    """A program whose [rows, H] query tile walks [keys, H] key and value tiles in a loop (an
    online softmax): the query tile; `loop_buffers` copies of the key and value tiles (unpipelined
    they take turns in one) and of `key_bytes` a key also read a step (segment ids), but for the
    step in flight; under mma.sync the probabilities' [rows, keys] tile on its way to the values'
    matmul. XLA:GPU's figures for a Hopper GPU, e.g. 327,936 bytes for rows = keys = 64 in 2 stages at
    H = 512 (Gemma 4's global heads), tests/training/test_kernel_fit.py."""
    query = tiles.rows * head_dim * itemsize
    key_tile = tiles.keys * head_dim * itemsize
    if tiles.stages == 1:
        kv = key_tile
    else:
        kv = loop_buffers(tiles) * 2 * key_tile + (tiles.stages - 1) * tiles.keys * key_bytes
    probabilities = 0 if uses_warpgroup_matmuls(tiles.rows) else tiles.rows * tiles.keys * itemsize
    return query + kv + probabilities


# ---------------------------------------------------------------------------------------------
# Fallbacks: a layer asked for a kernel ('auto' on a GPU or TPU, or 'fused') that runs XLA's
# attention instead says why, once, to whoever collects the reasons (the plan prints them).

_FALLBACKS: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("dflash_kernel_fallbacks", default=None)


@contextlib.contextmanager
def noting_fallbacks() -> Iterator[list[str]]:
    """While tracing inside: the list of `fall_back` reasons, each once, in the order met."""
    reasons: list[str] = []
    token = _FALLBACKS.set(reasons)
    try:
        yield reasons
    finally:
        _FALLBACKS.reset(token)


def fall_back(reason: str) -> None:
    reasons = _FALLBACKS.get()
    if reasons is not None and reason not in reasons:
        reasons.append(reason)
