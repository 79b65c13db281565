"""Acceptance length (tau) measured during training by real speculative decoding.

Prompts come from a JSONL of chat records (or a bundled set name); trailing assistant turns are
dropped and the rest is rendered with the target's own chat template and a generation prompt, as
a serving engine would (`dflash_jax.decoding.chat`, shared with `python -m dflash_jax.evaluate`).
"""

from __future__ import annotations

import numpy as np

from dflash_jax.decoding.acceptance import measure_acceptance
from dflash_jax.decoding.chat import ChatTokenizer, load_prompts
from dflash_jax.models.drafter import DFlashDrafter
from dflash_jax.models.qwen3 import Transformer


class AcceptanceEval:
    """Callable (target, drafter) -> acceptance statistics on a fixed prompt set."""

    def __init__(self, prompts: list[np.ndarray], stop: tuple[int, ...], *, max_new_tokens: int):
        self.prompts, self.stop, self.max_new_tokens = prompts, stop, max_new_tokens

    @classmethod
    def from_files(cls, prompts: str, tokenizer_dir: str, *, num_prompts: int, enable_thinking: bool,
                   max_new_tokens: int) -> "AcceptanceEval":
        chat = ChatTokenizer(tokenizer_dir, enable_thinking=enable_thinking)
        _, token_prompts = load_prompts(prompts, chat, limit=num_prompts)
        return cls(token_prompts, chat.stop_tokens, max_new_tokens=max_new_tokens)

    def __call__(self, target: Transformer, drafter: DFlashDrafter) -> dict:
        return measure_acceptance(
            target, drafter, self.prompts, max_new_tokens=self.max_new_tokens, stop_tokens=self.stop
        )
