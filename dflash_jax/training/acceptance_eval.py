"""Acceptance length during and after training, measured by real speculative decoding.

During training, `AcceptanceEval` decodes a fixed prompt set every `eval.every_steps` (the best
τ is kept, docs/design.md §7.4). At the end, `final_evaluation` measures the export against the
target alone, as `python -m dflash_jax.evaluate` does, and keeps the result in `<workdir>/eval/`.
Prompts are rendered with the target's own chat template, as a serving engine would.
"""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np

from dflash_jax.decoding import measurement
from dflash_jax.decoding.acceptance import measure_acceptance
from dflash_jax.decoding.draft_vocab import draft_token_ids
from dflash_jax.decoding.prompt_sets import ChatTokenizer, load_prompts
from dflash_jax.models.drafter import DFlashDrafter
from dflash_jax.models.formats.hf import load_target
from dflash_jax.models.transformer import Transformer
from dflash_jax.training.config.run_config import TrainSetup
from dflash_jax.training.drafters import load_any_drafter


class AcceptanceEval:
    """Callable (target, drafter) -> acceptance statistics on a fixed prompt set."""

    def __init__(
        self,
        prompts: list[np.ndarray],
        stop: tuple[int, ...],
        *,
        max_new_tokens: int,
        confidence_threshold: float = 0.0,
        draft_tokens: np.ndarray | None = None,
    ):
        self.prompts, self.stop, self.max_new_tokens = prompts, stop, max_new_tokens
        self.drafting = dict(confidence_threshold=confidence_threshold, draft_tokens=draft_tokens)

    @classmethod
    def for_setup(cls, setup: TrainSetup, draft_tokens: np.ndarray | None = None) -> AcceptanceEval:
        """`draft_tokens`: the run's draft vocabulary (`eval.draft_vocab`; None: every token)."""
        chat = ChatTokenizer(setup.target_path, enable_thinking=setup.data.enable_thinking)
        _, prompts = load_prompts(setup.eval.prompts, chat, limit=setup.eval.num_prompts)
        return cls(
            prompts,
            chat.stop_tokens,
            max_new_tokens=setup.eval.max_new_tokens,
            confidence_threshold=setup.eval.confidence_threshold,
            draft_tokens=draft_tokens,
        )

    def __call__(self, target: Transformer, drafter: DFlashDrafter) -> dict:
        return measure_acceptance(
            target,
            drafter,
            self.prompts,
            max_new_tokens=self.max_new_tokens,
            stop_tokens=self.stop,
            **self.drafting,
        )


def run_evaluation(
    target_path: str,
    drafter_path: str,
    prompt_specs,
    *,
    drafter_step=None,
    dtype=jnp.bfloat16,
    enable_thinking=False,
    draft_vocab: int = 0,
    **kwargs,
) -> dict:
    """`decoding.measurement.evaluate` on models loaded from disk (the drafter: an export or a
    workdir), both in `dtype`; `draft_vocab` > 0: drafting among the drafter's that many most
    frequent trained-on tokens (decoding/draft_vocab.py)."""
    chat = ChatTokenizer(target_path, enable_thinking=enable_thinking)
    target = load_target(target_path, param_dtype=dtype, compute_dtype=dtype)
    drafter = load_any_drafter(drafter_path, step=drafter_step, param_dtype=dtype, compute_dtype=dtype)
    if draft_vocab:
        kwargs["draft_tokens"] = draft_token_ids(drafter_path, draft_vocab)
    result = measurement.evaluate(target, drafter, chat, prompt_specs, **kwargs)
    result["run"].update(
        target=target_path, drafter=drafter_path, drafter_step=drafter_step, dtype=jnp.dtype(dtype).name
    )
    return result


def final_evaluation(setup: TrainSetup) -> dict | None:
    """The finished run's export against the target alone on the eval prompts (None without
    prompts). A rerun reads the saved result instead of decoding again."""
    if not setup.eval.enabled:
        return None
    workdir = setup.workdir
    saved = os.path.join(workdir.eval, "eval.json")
    weights = os.path.join(workdir.export, "model.safetensors")
    if os.path.isfile(saved) and os.path.getmtime(saved) >= os.path.getmtime(weights):
        with open(saved) as f:
            return json.load(f)
    result = run_evaluation(
        setup.target_path,
        workdir.export,
        [setup.eval.prompts],
        num_prompts=setup.eval.num_prompts,
        max_new_tokens=setup.eval.max_new_tokens,
        dtype=setup.target_dtype,
        enable_thinking=setup.data.enable_thinking,
        confidence_threshold=setup.eval.confidence_threshold,
        draft_vocab=setup.eval.draft_vocab,
    )
    measurement.write_outputs(result, workdir.eval)
    return result
