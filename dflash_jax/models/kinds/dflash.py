"""DFlash (docs/design.md §2): the backbone alone. Slot k of the block [anchor, MASK, ...] drafts
the token at anchor + k, every slot on its own, scored with the paper's position decay; exported
as z-lab's `DFlashDraftModel`."""

from __future__ import annotations

from dflash_jax.models.kind import PER_CONVERSATION_ANCHORS, SPECFORGE_SCHEDULE, Kind, LlamaCpp, Vllm

KIND = Kind(
    "dflash",
    ("DFlashDraftModel",),
    # D-PACE's weights: +5 % held-out τ over the position decay's on the default job, two seeds.
    loss="dpace",
    # Held-out τ over the paper's α 0.5: +0.9 % on two seeds, +0.2 % on three (behind on the
    # third); 0.2 is level with 0.5 (the kinds with a head keep 0.5: the selector's loses at 0.3).
    dpace_alpha=0.3,
    # +3.0 % held-out τ over 1 anchor per 8 row tokens, at twice the step (two seeds).
    **PER_CONVERSATION_ANCHORS,
    # +1.7 % held-out τ over the paper's schedule, ahead on each of four seeds (two other kinds
    # lose with it: docs/experiments.md).
    **SPECFORGE_SCHEDULE,
    llama_cpp=LlamaCpp("draft-dflash"),
    vllm=Vllm("dflash"),
)
