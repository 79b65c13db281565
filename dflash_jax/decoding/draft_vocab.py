"""Drafting over a frequent-token vocabulary (docs/design.md §4 "Draft vocabulary").

The drafter's tokens come from the target's LM head, a [D, V] matmul per drafted slot; with a
large vocabulary it is most of a drafter step on a CPU (SmolLM2: 4.9 of 7.8 ms for V = 49,152).
Drafting over only the V' tokens its training answers used most (FR-Spec's idea) reads D × V'
weights instead. Verification still runs over the whole vocabulary, so decoding stays lossless:
a token outside the V' is never drafted, only emitted by the target. Under sampling, the draft
distribution q is zero outside the V' (logits -inf there), which rejection sampling allows.

Training writes the counts of the tokens it trained on (`FREQUENCIES_FILE`) in its workdir and
every export; `draft_token_ids` reads the V' most frequent back.
"""

from __future__ import annotations

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx

from dflash_jax.data.cache import write_json_atomically
from dflash_jax.errors import UserError
from dflash_jax.models.layers.basic import soft_capped

FREQUENCIES_FILE = "token_frequencies.json"


def by_frequency(counts: np.ndarray) -> np.ndarray:
    """Token ids by falling count [V] (ties by id), the unseen ones left out."""
    ids = np.argsort(-counts, kind="stable")
    return ids[counts[ids] > 0].astype(np.int32)


def write_frequencies(path: str, counts: np.ndarray, *, source: str) -> None:
    """`counts` [V] of the trained-on tokens, written as token ids by falling count (unseen ones
    left out), atomically."""
    ids = by_frequency(counts)
    write_json_atomically(path, {"source": source, "token_ids": ids.tolist(), "counts": counts[ids].tolist()})


def draft_token_ids(model_dir: str, size: int) -> np.ndarray:
    """The `size` most frequent trained-on tokens of the drafter in `model_dir` (an export or a
    training workdir), by falling count; fewer when its training saw fewer distinct tokens."""
    path = os.path.join(model_dir, FREQUENCIES_FILE)
    if not os.path.isfile(path):
        raise UserError(
            f"a draft vocabulary needs {path}: training writes it in its workdir and exports "
            "(a drafter trained elsewhere has none; drop --draft_vocab)"
        )
    with open(path) as f:
        ids = json.load(f)["token_ids"]
    return most_frequent(np.asarray(ids, np.int32), size, path)


def most_frequent(ids: np.ndarray, size: int, source: str) -> np.ndarray:
    """The first `size` of `ids` (token ids by falling count, from `source`); where training saw
    fewer distinct tokens, all of them, said in one warning line."""
    if size > len(ids):
        _warn_capped(size, len(ids), source)
    return ids[:size]


@functools.cache  # once per run: evaluate reads the same vocabulary for its engine and its decoder
def _warn_capped(size: int, seen: int, source: str) -> None:
    logging.warning(
        "draft vocabulary capped at %d tokens (asked for %d): the drafter's training saw only %d distinct tokens (%s)",
        seen,
        size,
        seen,
        source,
    )


class FullVocabulary:
    """Drafting over the target's whole vocabulary: its LM head as it is."""

    def __init__(self, target):
        self.target = target

    def logits(self, h: jax.Array) -> jax.Array:
        """h [..., D] -> logits [..., V]."""
        return self.target.unembed(h)

    def tokens(self, index: jax.Array) -> jax.Array:
        return index

    def columns(self, x: jax.Array) -> jax.Array:
        return x

    def scatter(self, logits: jax.Array) -> jax.Array:
        return logits


class DraftVocabulary(nnx.Module):
    """Drafting over `token_ids` [V'] alone, with their columns of the target's LM head copied
    once (gathering them every step would read the whole head again)."""

    def __init__(self, target, token_ids: np.ndarray):
        ids = jnp.asarray(token_ids, jnp.int32)
        if target.lm_head is None:  # tied: the embedding's rows are the head's columns
            kernel = target.embed_tokens.embedding[...][ids].T
        else:
            kernel = target.lm_head.kernel[...][:, ids]
        self.token_ids = nnx.Variable(ids)
        self.kernel = nnx.Variable(kernel)
        self.vocab_size = target.cfg.vocab_size
        self.softcap = target.cfg.final_logit_softcap
        self.compute_dtype = target.compute_dtype

    def logits(self, h: jax.Array) -> jax.Array:
        """h [..., D] -> logits [..., V'] of the draft tokens (one flat matmul: see layers.Linear)."""
        flat = h.reshape(-1, h.shape[-1]).astype(self.compute_dtype)
        logits = (flat @ self.kernel[...].astype(self.compute_dtype)).reshape(*h.shape[:-1], -1)
        return soft_capped(logits, self.softcap)

    def tokens(self, index: jax.Array) -> jax.Array:
        """Indices into the draft vocabulary -> token ids."""
        return self.token_ids[...][index]

    def columns(self, x: jax.Array) -> jax.Array:
        """x [..., V] over the whole vocabulary -> [..., V'] (a bias over the draft tokens)."""
        return x[..., self.token_ids[...]]

    def scatter(self, logits: jax.Array) -> jax.Array:
        """logits [..., V'] -> [..., V], -inf outside the draft vocabulary (q = 0 there)."""
        full = jnp.full((*logits.shape[:-1], self.vocab_size), -jnp.inf, logits.dtype)
        return full.at[..., self.token_ids[...]].set(logits)
