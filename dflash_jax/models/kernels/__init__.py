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
from collections.abc import Iterator

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
