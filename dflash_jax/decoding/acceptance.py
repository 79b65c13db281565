"""Acceptance statistics of speculative decoding, as the reference benchmark reports them.

Per prompt, the acceptance length of a verification step is the number of tokens it added to the
output (accepted drafts + 1, at most the block size; the step that hits a stop token or
max_new_tokens counts only the tokens kept). τ of a prompt set is the mean over prompts of each
prompt's mean acceptance length; prompts that finished at the prefill (no step) are left out.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dflash_jax.decoding.generate import Generation
from dflash_jax.decoding.sampling import GREEDY, SamplingConfig
from dflash_jax.decoding.speculative import SpeculativeDecoder
from dflash_jax.models.drafter import DFlashDrafter
from dflash_jax.models.transformer import Transformer


def acceptance_stats(generations: Sequence[Generation], block_size: int) -> dict:
    """τ, the histogram of acceptance lengths and per-slot acceptance rates.

    block_size: the longest acceptance (the tokens verified per step, `DrafterConfig.verify_size`).
    histogram[n-1] counts steps of acceptance length n (1..block_size). slot_acceptance[k-1] is
    the fraction of steps whose draft k (1..block_size-1) was accepted, i.e. length > k.
    """
    per_prompt = [g.step_lengths for g in generations if len(g.step_lengths)]
    lengths = np.concatenate(per_prompt) if per_prompt else np.zeros((0,), np.int32)
    if lengths.size and (lengths.min() < 1 or lengths.max() > block_size):
        raise ValueError(f"acceptance lengths outside 1..{block_size}: {lengths.min()}..{lengths.max()}")
    histogram = np.bincount(lengths, minlength=block_size + 1)[1:]
    slots = np.arange(1, block_size)
    return {
        "tau": float(np.mean([s.mean() for s in per_prompt])) if per_prompt else float("nan"),
        "tau_pooled": float(lengths.mean()) if lengths.size else float("nan"),
        "num_prompts": len(generations),
        "num_prompts_with_steps": len(per_prompt),
        "num_steps": int(lengths.size),
        "num_tokens": int(sum(len(g.tokens) for g in generations)),
        "histogram": histogram.tolist(),
        "slot_acceptance": [float((lengths > k).mean()) if lengths.size else float("nan") for k in slots],
    }


def measure_acceptance(
    target: Transformer,
    drafter: DFlashDrafter,
    prompts: Sequence[np.ndarray],
    *,
    max_new_tokens: int,
    batch_size: int = 8,
    sampling: SamplingConfig = GREEDY,
    stop_tokens: Sequence[int] = (),
    seed: int = 0,
    confidence_threshold: float = 0.0,
    draft_tokens: np.ndarray | None = None,
) -> dict:
    """Speculative-decode `prompts` (1-D token arrays, chat template applied) and return
    `acceptance_stats` (key "tau", ...). `confidence_threshold`: a confidence head's truncation (0 = off);
    `draft_tokens`: the draft vocabulary (decoding/draft_vocab.py; None: every token).

    Repeated calls with the same prompts, settings and model structure reuse the compiled
    steps, so calling this every N training steps costs only the decoding itself.
    """
    if not len(prompts):
        raise ValueError("measure_acceptance needs at least one prompt")
    decoder = SpeculativeDecoder(
        target,
        drafter,
        max_prompt_len=max(len(p) for p in prompts),
        max_new_tokens=max_new_tokens,
        batch_size=min(batch_size, len(prompts)),
        sampling=sampling,
        stop_tokens=stop_tokens,
        confidence_threshold=confidence_threshold,
        draft_tokens=draft_tokens,
    )
    return acceptance_stats(decoder.generate(prompts, seed=seed), drafter.cfg.verify_size)
