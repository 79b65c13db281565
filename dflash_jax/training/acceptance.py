"""Acceptance length (tau) measured during training by real speculative decoding.

Prompts come from a JSONL of chat records (`messages` in OpenAI role/content form); trailing
assistant turns are dropped and the rest is rendered with the target's own chat template and a
generation prompt, as a serving engine would.
"""

from __future__ import annotations

import json

import numpy as np

from dflash_jax.decoding.acceptance import measure_acceptance
from dflash_jax.models.drafter import DFlashDrafter
from dflash_jax.models.qwen3 import Transformer


def load_prompts(path: str, tokenizer_dir: str, *, num_prompts: int, enable_thinking: bool) -> list[np.ndarray]:
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    prompts = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if len(prompts) == num_prompts:
                break
            if not line.strip():
                continue
            messages = list(json.loads(line)["messages"])
            while messages and messages[-1]["role"] == "assistant":
                messages.pop()
            ids = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True,
                enable_thinking=enable_thinking, return_dict=False,
            )
            prompts.append(np.asarray(ids, np.int32))
    if not prompts:
        raise ValueError(f"eval.prompts={path!r} holds no prompt")
    return prompts


def stop_tokens(tokenizer_dir: str) -> tuple[int, ...]:
    """End-of-turn ids: the generation config's eos ids and the tokenizer's eos token."""
    import transformers

    ids = set()
    try:
        eos = transformers.GenerationConfig.from_pretrained(tokenizer_dir).eos_token_id
        ids.update([eos] if isinstance(eos, int) else eos or [])
    except OSError:  # no generation_config.json
        pass
    tokenizer_eos = transformers.AutoTokenizer.from_pretrained(tokenizer_dir).eos_token_id
    if tokenizer_eos is not None:
        ids.add(tokenizer_eos)
    return tuple(sorted(ids))


class AcceptanceEval:
    def __init__(self, prompts: list[np.ndarray], stop: tuple[int, ...], *, max_new_tokens: int):
        self.prompts, self.stop, self.max_new_tokens = prompts, stop, max_new_tokens

    def __call__(self, target: Transformer, drafter: DFlashDrafter) -> dict:
        return measure_acceptance(
            target, drafter, self.prompts, max_new_tokens=self.max_new_tokens, stop_tokens=self.stop
        )
