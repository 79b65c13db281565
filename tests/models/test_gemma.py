"""Gemma 4's decoder layer against transformers' Gemma4TextDecoderLayer (fp32, tiny random weights):
a sliding layer and a full layer whose values come from k_proj (proportional RoPE over a wider
head, fewer kv heads), packed rows equal to each document run alone, and cached decoding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from transformers.models.gemma4 import modeling_gemma4 as g4

from dflash_jax.models.architecture import RopeConfig
from dflash_jax.models.families.gemma4 import Gemma4Attention, Gemma4Block
from dflash_jax.models.layers.basic import SwiGLU, rotary
from dflash_jax.models.layers.mixers import DecodeStep, PackedRows

HIDDEN, WINDOW = 64, 8
TEXT = dict(
    vocab_size=128,
    hidden_size=HIDDEN,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    global_head_dim=32,
    num_global_key_value_heads=1,
    attention_k_eq_v=True,
    sliding_window=WINDOW,
    layer_types=["sliding_attention", "full_attention"],
    hidden_size_per_layer_input=0,
)
ROPES = {
    "sliding_attention": (RopeConfig(10000.0), 16),
    "full_attention": (RopeConfig(1_000_000.0, kind="proportional", partial_factor=0.25), 32),
}


@pytest.fixture(scope="module", params=[0, 1], ids=["sliding", "full_k_eq_v"])
def layer(request):
    config = transformers.Gemma4TextConfig(**TEXT)
    config._attn_implementation = "eager"
    torch.manual_seed(request.param)
    ref = g4.Gemma4TextDecoderLayer(config, request.param).eval()
    with torch.no_grad():
        for name, p in [*ref.named_parameters(), *ref.named_buffers()]:
            p.copy_(
                1.0 + 0.2 * torch.randn_like(p) if "norm" in name or "scalar" in name else 0.2 * torch.randn_like(p)
            )
    layer_type = config.layer_types[request.param]
    return config, ref, _ours(config, ref, layer_type), layer_type


def _ours(config, ref, layer_type) -> Gemma4Block:
    sliding = layer_type == "sliding_attention"
    dtypes = dict(param_dtype=jnp.float32, compute_dtype=jnp.float32)

    def build():
        rngs = nnx.Rngs(0)
        attention = Gemma4Attention(
            hidden_size=HIDDEN,
            num_heads=4,
            num_kv_heads=2 if sliding else 1,
            head_dim=16 if sliding else 32,
            eps=config.rms_norm_eps,
            sliding_window=WINDOW if sliding else 0,
            values_from_keys=not sliding,
            rngs=rngs,
            **dtypes,
        )
        mlp = SwiGLU(HIDDEN, 96, activation="gelu_tanh", rngs=rngs, **dtypes)
        return Gemma4Block(attention, mlp, None, hidden_size=HIDDEN, eps=config.rms_norm_eps, **dtypes)

    graphdef, state = nnx.split(nnx.eval_shape(build))
    tensors = {k: v.numpy() for k, v in ref.state_dict().items()}

    def read(path, leaf):
        names = [str(getattr(p, "key", p)) for p in path]
        name = ".".join(names[:-1] + ["weight"]) if names[-1] in ("kernel", "weight") else ".".join(names)
        value = tensors[name].T if names[-1] == "kernel" else tensors[name]
        assert value.shape == leaf.shape, (names, value.shape, leaf.shape)
        return jnp.asarray(value)

    nnx.replace_by_pure_dict(state, jax.tree_util.tree_map_with_path(read, nnx.to_pure_dict(state)))
    return nnx.merge(graphdef, state)


def _reference(config, ref, layer_type, x: np.ndarray) -> np.ndarray:
    """The reference layer on one document x [S, D] (causal, windowed where the layer slides)."""
    s = x.shape[0]
    hidden = torch.from_numpy(x)[None]
    cos_sin = g4.Gemma4TextRotaryEmbedding(config)(hidden, torch.arange(s)[None], layer_type)
    i, j = torch.arange(s)[:, None], torch.arange(s)[None]
    visible = (j <= i) & ((i - j < WINDOW) if layer_type == "sliding_attention" else True)
    mask = torch.where(visible, 0.0, float("-inf"))[None, None]
    with torch.no_grad():
        return ref(hidden, None, {}, position_embeddings=cos_sin, attention_mask=mask)[0].numpy()


def _tables(layer_type, positions):
    rope, head_dim = ROPES[layer_type]
    return rotary(jnp.asarray(positions), rope, head_dim)


def test_packed_rows_equal_each_document_in_transformers(layer):
    config, ref, ours, layer_type = layer
    rng = np.random.default_rng(3)
    docs = [rng.standard_normal((n, HIDDEN)).astype(np.float32) for n in (13, 5)]
    x = np.concatenate([*docs, np.zeros((2, HIDDEN), np.float32)])[None]
    segment_ids = np.array([[1] * 13 + [2] * 5 + [0] * 2])
    positions = np.array([[*range(13), *range(5), 0, 0]])
    with jax.default_matmul_precision("highest"):
        rows = PackedRows(jnp.asarray(segment_ids), _tables(layer_type, positions))
        out = np.asarray(jax.jit(lambda m, x, r: m(x, r))(ours, jnp.asarray(x), rows))
    start = 0
    for doc in docs:
        expected = _reference(config, ref, layer_type, doc)
        np.testing.assert_allclose(out[0, start : start + len(doc)], expected, atol=5e-5, rtol=1e-5)
        start += len(doc)


def test_cached_decoding_equals_transformers(layer):
    config, ref, ours, layer_type = layer
    text = np.random.default_rng(4).standard_normal((12, HIDDEN)).astype(np.float32)
    expected = _reference(config, ref, layer_type, text)

    @jax.jit
    def decode(model, x, start, cache):
        positions = start[:, None] + jnp.arange(x.shape[1])[None]
        return model.decode(x, DecodeStep(start, _tables(layer_type, positions)), cache)

    cache = ours.mixer.new_cache(1, 16)
    with jax.default_matmul_precision("highest"):
        first, cache = decode(ours, jnp.asarray(text[None, :9]), jnp.array([0]), cache)
        rest, _ = decode(ours, jnp.asarray(text[None, 9:]), jnp.array([9]), cache)
    got = np.concatenate([np.asarray(first[0]), np.asarray(rest[0])])
    np.testing.assert_allclose(got, expected, atol=5e-5, rtol=1e-5)
