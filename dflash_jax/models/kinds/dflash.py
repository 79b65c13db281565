"""DFlash (docs/design.md §2): the backbone alone. Slot k of the block [anchor, MASK, ...] drafts
the token at anchor + k, every slot on its own, scored with the paper's position decay; exported
as z-lab's `DFlashDraftModel`."""

from __future__ import annotations

from dflash_jax.models.kind import Kind, LlamaCpp, Vllm

KIND = Kind(
    "dflash",
    ("DFlashDraftModel",),
    # D-PACE's weights: +5 % held-out τ over the position decay's on the default job, two seeds.
    loss="dpace",
    llama_cpp=LlamaCpp("draft-dflash"),
    vllm=Vllm("dflash"),
)
