"""The target LM matches transformers (torch CPU, fp32) on the same weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from dflash_jax.models.formats.hf import load_target

SEQ = 24


def _reference(path, tokens):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        out = model(torch.tensor(tokens), output_hidden_states=True)
    return out.logits.numpy(), [h.numpy() for h in out.hidden_states]


def _ours(path, tokens, compute_dtype=jnp.float32):
    model = load_target(path, param_dtype=jnp.float32, compute_dtype=compute_dtype)
    b, s = tokens.shape
    with jax.default_matmul_precision("highest"):
        logits, hidden = model(
            jnp.asarray(tokens),
            jnp.ones((b, s), jnp.int32),
            jnp.broadcast_to(jnp.arange(s), (b, s)),
            hidden_layers=tuple(range(model.cfg.num_layers)),
        )
    return np.asarray(logits, np.float32), [np.asarray(h, np.float32) for h in hidden]


@pytest.mark.parametrize("fixture", ["qwen3_checkpoint", "qwen3_tied_checkpoint", "llama_checkpoint"])
def test_fp32_logits_and_hidden_states_match_transformers(fixture, request):
    path = request.getfixturevalue(fixture)
    tokens = np.random.default_rng(0).integers(0, 128, (2, SEQ))
    ref_logits, ref_hidden = _reference(path, tokens)
    logits, hidden = _ours(path, tokens)
    np.testing.assert_allclose(logits, ref_logits, atol=1e-4, rtol=1e-4)
    # HF hidden_states[i + 1] is layer i's hidden state, the last one after the final norm: the
    # feature the reference DFlash code reads for target layer i.
    for i, h in enumerate(hidden):
        np.testing.assert_allclose(h, ref_hidden[i + 1], atol=1e-4, rtol=1e-4, err_msg=f"layer {i}")
    # The features training and decoding read, every layer id including L - 1.
    model = load_target(path, param_dtype=jnp.float32, compute_dtype=jnp.float32)
    layer_ids = tuple(range(model.cfg.num_layers))
    ones = jnp.ones(tokens.shape, jnp.int32)
    with jax.default_matmul_precision("highest"):
        packed = model.features(jnp.asarray(tokens), ones, jnp.broadcast_to(jnp.arange(SEQ), tokens.shape), layer_ids)
        _, cached, _ = model.decode(jnp.asarray(tokens), model.new_cache(*tokens.shape), feature_layers=layer_ids)
    expected = np.concatenate(ref_hidden[1:], axis=-1)
    np.testing.assert_allclose(np.asarray(packed), expected, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(cached), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_bf16_compute_stays_close(qwen3_checkpoint):
    tokens = np.random.default_rng(1).integers(0, 128, (1, SEQ))
    ref_logits, _ = _reference(qwen3_checkpoint, tokens)
    logits, _ = _ours(qwen3_checkpoint, tokens, compute_dtype=jnp.bfloat16)
    scale = np.abs(ref_logits).max()
    assert np.abs(logits - ref_logits).max() < 0.05 * scale
    assert (logits.argmax(-1) == ref_logits.argmax(-1)).mean() > 0.9
