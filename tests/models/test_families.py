"""Every target family beyond dense Qwen3/Llama against transformers (torch CPU, fp32), on tiny
random checkpoints transformers itself writes in the hub's layout (tests/support/hf_reference.py):
logits and every hidden state, greedy generation, packed rows equal to their documents run one by
one, and lossless speculative decoding through rolled-back caches (linear-attention states
included)."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from dflash_jax.decoding.generate import TargetDecoder
from dflash_jax.decoding.speculative import SpeculativeDecoder
from dflash_jax.models.formats.hf import load_target
from support.decoding_models import ScriptedDrafter
from support.hf_reference import write_hf_checkpoint

# Each family's checkpoint and transformers model, compiled for every test: a minute or more per
# family on 2 cores. The fast tier covers the layers (test_moe, test_linear_attention,
# test_sinks_and_windows, test_latent_attention, test_gemma, test_target) and the registry
# (test_family_registry).
pytestmark = pytest.mark.slow

FAMILIES = (
    "qwen3_moe",
    "qwen3_5",
    "qwen3_5_text",
    "qwen3_5_moe",
    "qwen3_next",
    "gpt_oss",
    "deepseek_v3",
    "kimi_k25",
    "minimax_m2",
    "gemma4",
    "gemma4_text",
)
# Packing and rollback depend on the mixers and MLPs, not on how weights are stored: one family
# per new kind of layer (experts; Gated DeltaNet with gated attention; sliding windows and sinks;
# latent attention with grouped sigmoid routing; Gemma's layers with their own RoPE per layer kind)
# keeps the suite short.
ROW_FAMILIES = ("qwen3_moe", "qwen3_5", "gpt_oss", "deepseek_v3", "gemma4")
SEQ = 80  # more than one 64-token linear-attention chunk
NEW = 12


@pytest.fixture(scope="module")
def family(request, tmp_path_factory):
    path = write_hf_checkpoint(tmp_path_factory.mktemp(request.param), arch=request.param)
    architecture = json.loads((Path(path) / "config.json").read_text())["architectures"][0]
    reference = getattr(transformers, architecture).from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    )
    reference.eval()
    with jax.default_matmul_precision("highest"):
        ours = load_target(path, param_dtype=jnp.float32, compute_dtype=jnp.float32)
    return request.param, reference, ours


def _forward(model, tokens, segment_ids, positions):
    with jax.default_matmul_precision("highest"):
        logits, hidden = jax.jit(lambda t, s, p: model(t, s, p, hidden_layers=tuple(range(model.cfg.num_layers))))(
            tokens, segment_ids, positions
        )
    return np.asarray(logits), [np.asarray(h) for h in hidden]


@pytest.mark.parametrize("family", FAMILIES, indirect=True)
def test_logits_hidden_states_and_greedy_text_match_transformers(family):
    name, reference, ours = family
    tokens = np.random.default_rng(0).integers(0, 128, (2, SEQ))
    with torch.no_grad():
        out = reference(input_ids=torch.tensor(tokens), output_hidden_states=True)
    ones = jnp.ones(tokens.shape, jnp.int32)
    logits, hidden = _forward(ours, jnp.asarray(tokens), ones, jnp.broadcast_to(jnp.arange(SEQ), tokens.shape))
    np.testing.assert_allclose(logits, out.logits.numpy(), atol=1e-4, rtol=1e-4, err_msg=name)
    # transformers' hidden_states[i + 1] is layer i's hidden state, the last one after the final norm:
    # the feature the reference DFlash code reads for target layer i.
    for i, h in enumerate(hidden):
        np.testing.assert_allclose(h, out.hidden_states[i + 1].numpy(), atol=1e-4, rtol=1e-4, err_msg=f"{name} {i}")
    # The features decoding reads (a prefill through the cache), every layer id including L - 1.
    layer_ids = tuple(range(ours.cfg.num_layers))
    with jax.default_matmul_precision("highest"):
        _, features, _ = ours.decode(jnp.asarray(tokens), ours.new_cache(2, SEQ), feature_layers=layer_ids)
    expected = np.concatenate([h.numpy() for h in out.hidden_states[1:]], axis=-1)
    np.testing.assert_allclose(np.asarray(features), expected, atol=1e-4, rtol=1e-4, err_msg=f"{name} features")

    prompts = [tokens[0, :9], tokens[1, :30]]
    ours_greedy = TargetDecoder(ours, max_prompt_len=32, max_new_tokens=NEW, batch_size=2).generate(prompts)
    for prompt, got in zip(prompts, ours_greedy):
        with torch.no_grad():
            ref = reference.generate(
                torch.tensor(prompt)[None], max_new_tokens=NEW, do_sample=False, min_new_tokens=NEW, pad_token_id=0
            )
        np.testing.assert_array_equal(got.tokens, ref[0, len(prompt) :].numpy(), err_msg=name)


@pytest.mark.parametrize("family", ROW_FAMILIES, indirect=True)
def test_packed_row_equals_its_documents_alone(family):
    name, _, ours = family
    rng = np.random.default_rng(1)
    lengths = (70, 3, 45)  # a document longer than a chunk, one shorter than the conv window
    width = sum(lengths) + 10  # and padding
    tokens = np.zeros((1, width), np.int32)
    segment_ids, positions = np.zeros_like(tokens), np.zeros_like(tokens)
    docs, start = [], 0
    for i, n in enumerate(lengths):
        doc = rng.integers(0, 128, n)
        tokens[0, start : start + n], segment_ids[0, start : start + n] = doc, i + 1
        positions[0, start : start + n] = np.arange(n)
        docs.append((start, doc))
        start += n
    packed_logits, packed_hidden = _forward(ours, *(jnp.asarray(a) for a in (tokens, segment_ids, positions)))
    alone_width = max(lengths)  # every document alone, padded after it: one compiled forward
    for start, doc in docs:
        n = len(doc)
        alone = np.zeros((3, 1, alone_width), np.int32)
        alone[0, 0, :n], alone[1, 0, :n], alone[2, 0, :n] = doc, 1, np.arange(n)
        alone_logits, alone_hidden = _forward(ours, *(jnp.asarray(a) for a in alone))
        # fp32 noise of other tilings: ~1e-6 of the states' scale, which reaches ~10 in Gemma
        # (embeddings times sqrt(D)); a document seeing another would differ by far more.
        np.testing.assert_allclose(packed_logits[0, start : start + n], alone_logits[0, :n], atol=5e-5, err_msg=name)
        for p, a in zip(packed_hidden, alone_hidden):
            np.testing.assert_allclose(p[0, start : start + n], a[0, :n], atol=5e-5, err_msg=name)


@pytest.mark.parametrize("family", ROW_FAMILIES, indirect=True)
def test_speculative_decoding_is_lossless(family):
    """A drafter right most of the time but not always: every step rolls the target's caches back
    by a different amount, and the output stays the target's own greedy text."""
    name, _, ours = family
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 128, n).astype(np.int32) for n in (5, 23)]
    kw = dict(max_prompt_len=32, max_new_tokens=24, batch_size=2)
    plain = TargetDecoder(ours, **kw).generate(prompts)
    width = 32 + 24 + 16
    sequences = np.zeros((2, width), np.int32)
    for i, (prompt, g) in enumerate(zip(prompts, plain)):
        full = np.concatenate([prompt, g.tokens])
        sequences[i, : len(full)] = full
    spec = SpeculativeDecoder(ours, ScriptedDrafter(ours, sequences, block_size=6), **kw).generate(prompts)
    for p, s in zip(plain, spec):
        np.testing.assert_array_equal(s.tokens, p.tokens, err_msg=name)
    lengths = np.concatenate([s.step_lengths for s in spec])
    assert lengths.mean() > 2 and len(set(lengths.tolist())) >= 3, lengths  # varied acceptance, real rollbacks
