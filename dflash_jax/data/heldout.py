"""The held-out split: `data.heldout_rows=N` keeps N prompts out of training, to measure τ on.

The rule. A conversation's *prompt* is its messages before its first assistant turn; only
conversations whose prompt holds a user turn have one (plain text does not). Each prompt gets a
key, the first 8 bytes of the sha256 of its (role, content) pairs, and the N distinct prompts
with the smallest keys are held out: every training conversation that opens with one of them is
left out of every epoch (so a prompt repeated in the data, or answered twice, is never trained
on), and the N prompts are the evaluation set, in key order.

The split is a function of the text of the usable conversations alone: not of their order, the
files they are in, the tokens, the number of processes or devices, or a resume. Re-tokenizing
the same data with the same settings gives the same split; only a change of which rows are
usable (another tokenizer, `data.seq_len` with `data.overlength='drop'`) can move it. The first
M prompts of `heldout_rows=N` are those of `heldout_rows=M`.
"""

from __future__ import annotations

import collections
import hashlib
import json

import numpy as np

from dflash_jax.data.cache import TokenizedCache
from dflash_jax.data.formats import Conversation, PlainText, normalize_record
from dflash_jax.data.sources import read_rows
from dflash_jax.errors import DataError

Messages = list[dict[str, str]]


def first_prompt(sample: Conversation | PlainText) -> Messages | None:
    """The messages before the first assistant turn, or None when they hold no user turn."""
    if not isinstance(sample, Conversation):
        return None
    prompt = []
    for message in sample.messages:
        if message["role"] == "assistant":
            break
        prompt.append({"role": message["role"], "content": message["content"]})
    return prompt if any(m["role"] == "user" for m in prompt) else None


def prompt_key(prompt: Messages) -> int:
    text = json.dumps([(m["role"], m["content"]) for m in prompt], ensure_ascii=False, separators=(",", ":"))
    return int.from_bytes(hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()[:8], "big")


def heldout_keys(cache: TokenizedCache, num_prompts: int) -> np.ndarray:
    """The keys of the held-out prompts, smallest first."""
    samples = _sample_index(cache)
    keys = np.unique(samples["prompt_key"][samples["has_prompt"]])
    if num_prompts > len(keys):
        raise DataError(
            f"data.heldout_rows={num_prompts}, but the data holds only {len(keys)} distinct prompts to hold out "
            "(conversations with a user turn before their first assistant turn)"
        )
    return keys[:num_prompts]


def heldout_samples(cache: TokenizedCache, num_prompts: int) -> np.ndarray:
    """Indices of the cache's samples left out of training: those opening with a held-out prompt."""
    if not num_prompts:
        return np.zeros(0, np.int64)
    samples = _sample_index(cache)
    held = samples["has_prompt"] & np.isin(samples["prompt_key"], heldout_keys(cache, num_prompts))
    if held.all():
        raise DataError(f"data.heldout_rows={num_prompts} holds out every conversation: nothing is left to train on")
    return np.flatnonzero(held)


def heldout_prompts(cache: TokenizedCache, num_prompts: int, data_format: str = "auto") -> list[Messages]:
    """The held-out prompts (OpenAI-style messages, ending with a user turn), in key order, read
    back from the source rows the cache was built from."""
    samples = _sample_index(cache)
    first_sample = {}  # key -> the first sample opening with that prompt
    for i in heldout_samples(cache, num_prompts):
        first_sample.setdefault(int(samples["prompt_key"][i]), i)
    keys = [int(k) for k in heldout_keys(cache, num_prompts)]
    by_source = collections.defaultdict(list)
    for key in keys:
        sample = samples[first_sample[key]]
        by_source[int(sample["source"])].append((key, int(sample["row"])))
    sources = [s["path"] for s in cache.manifest["inputs"]["sources"]]
    prompts = {}
    for source, wanted in by_source.items():
        records = read_rows(sources[source], [row for _, row in wanted], data_format)
        for (key, row), record in zip(wanted, records):
            prompt = first_prompt(normalize_record(record, data_format))
            if prompt is None or prompt_key(prompt) != key:
                raise DataError(f"{sources[source]}: row {row} changed since it was tokenized; rebuild the cache")
            prompts[key] = prompt
    return [prompts[key] for key in keys]


def _sample_index(cache: TokenizedCache) -> np.ndarray:
    if cache.samples is None:
        raise DataError(f"the tokenized cache {cache.directory} predates held-out prompts; rebuild it")
    return cache.samples
