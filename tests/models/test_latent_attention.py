"""Multi-head latent attention against transformers' DeepseekV3Attention (fp32, tiny random weights):
packed rows equal each document run alone by the reference, and cached decoding (kv_b_proj
absorbed, rolled back between steps) equals the reference on the final text. YaRN with mscale and
mscale_all_dim both set, interleaved rotary pairs, value heads narrower than key heads."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

from dflash_jax.models import hf_config
from dflash_jax.models.layers.basic import rotary
from dflash_jax.models.layers.latent_attention import LatentAttention, rope_rows_deinterleaved
from dflash_jax.models.layers.mixers import DecodeStep, PackedRows

HIDDEN, HEADS, Q_RANK, KV_RANK, NOPE, ROPE, V_DIM = 64, 4, 24, 32, 16, 8, 12
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 32,
    "mscale": 0.8,
    "mscale_all_dim": 1.0,
    "beta_fast": 32,
    "beta_slow": 1,
}


def reference(q_lora_rank):
    config = transformers.DeepseekV3Config(
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=KV_RANK,
        qk_nope_head_dim=NOPE,
        qk_rope_head_dim=ROPE,
        v_head_dim=V_DIM,
        max_position_embeddings=128,
        rope_parameters=dict(YARN),
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    attn = ds.DeepseekV3Attention(config, layer_idx=0).eval()
    with torch.no_grad():
        for name, p in attn.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    return config, attn, ds.DeepseekV3RotaryEmbedding(config)


def ours(config, attn) -> LatentAttention:
    """Our module with the reference's weights, rotary rows reordered as the loader does."""
    q_lora_rank = config.q_lora_rank or 0
    abstract = nnx.eval_shape(
        lambda: LatentAttention(
            hf_config.latent_attention(config.to_dict()),
            hidden_size=HIDDEN,
            num_heads=HEADS,
            param_dtype=jnp.float32,
            compute_dtype=jnp.float32,
            rngs=nnx.Rngs(0),
        )
    )
    graphdef, state = nnx.split(abstract)
    tensors = {k: v.numpy() for k, v in attn.state_dict().items()}
    query = "q_b_proj.weight" if q_lora_rank else "q_proj.weight"
    tensors[query] = rope_rows_deinterleaved(tensors[query], NOPE + ROPE, ROPE)
    tensors["kv_a_proj_with_mqa.weight"] = rope_rows_deinterleaved(
        tensors["kv_a_proj_with_mqa.weight"], KV_RANK + ROPE, ROPE
    )

    def read(path, leaf):
        names = [str(getattr(p, "key", p)) for p in path]
        value = tensors[".".join(names[:-1] + ["weight"])]
        value = value.T if names[-1] == "kernel" else value
        assert value.shape == leaf.shape, (names, value.shape, leaf.shape)
        return jnp.asarray(value)

    nnx.replace_by_pure_dict(state, jax.tree_util.tree_map_with_path(read, nnx.to_pure_dict(state)))
    return nnx.merge(graphdef, state)


def reference_outputs(attn, rope, x: np.ndarray) -> np.ndarray:
    """The reference on one document x [S, D] (causal) -> [S, D]."""
    s = x.shape[0]
    hidden = torch.from_numpy(x)[None]
    cos_sin = rope(hidden, torch.arange(s)[None])
    mask = torch.full((s, s), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        return attn(hidden, position_embeddings=cos_sin, attention_mask=mask)[0][0].numpy()


def tables(config, positions):
    return rotary(jnp.asarray(positions), hf_config.rope(config.to_dict()), ROPE)


@pytest.mark.parametrize("q_lora_rank", [Q_RANK, None])
def test_packed_rows_equal_each_document_in_transformers(q_lora_rank):
    config, attn, rope = reference(q_lora_rank)
    model = ours(config, attn)
    rng = np.random.default_rng(1)
    lengths = (11, 7)
    docs = [rng.standard_normal((n, HIDDEN)).astype(np.float32) for n in lengths]
    x = np.concatenate([*docs, np.zeros((2, HIDDEN), np.float32)])[None]  # and two padding slots
    segment_ids = np.array([[1] * 11 + [2] * 7 + [0] * 2])
    positions = np.array([[*range(11), *range(7), 0, 0]])
    with jax.default_matmul_precision("highest"):
        rows = PackedRows(jnp.asarray(segment_ids), tables(config, positions))
        out = np.asarray(jax.jit(lambda m, x, r: m(x, r))(model, jnp.asarray(x), rows))
    start = 0
    for doc in docs:
        np.testing.assert_allclose(out[0, start : start + len(doc)], reference_outputs(attn, rope, doc), atol=2e-5)
        start += len(doc)
    assert np.isfinite(out).all()


def test_cached_decoding_with_rollback_equals_transformers():
    """Prefill 6 tokens, append 4, roll 3 of them back, append 5 others: every output of the last
    two calls equals the reference on the text the cache then holds. Each call attends only a
    prefix of the 16 slots (`DecodeStep.num_slots`), as the decoding loop's buckets do."""
    config, attn, rope = reference(Q_RANK)
    model = ours(config, attn)
    rng = np.random.default_rng(2)
    text = rng.standard_normal((12, HIDDEN)).astype(np.float32)
    rejected = rng.standard_normal((4, HIDDEN)).astype(np.float32)
    expected = reference_outputs(attn, rope, text)

    @functools.partial(jax.jit, static_argnames="num_slots")
    def decode(model, x, start, cache, num_slots):
        positions = start[:, None] + jnp.arange(x.shape[1])[None]
        return model.decode(x, DecodeStep(start, tables(config, positions), num_slots=num_slots), cache)

    cache = model.new_cache(1, 16)
    with jax.default_matmul_precision("highest"):
        out, cache = decode(model, jnp.asarray(text[None, :6]), jnp.array([0]), cache, 8)
        np.testing.assert_allclose(np.asarray(out[0]), expected[:6], atol=2e-5)
        accepted_then_rejected = np.concatenate([text[6:7], rejected[1:]])  # the first kept, 3 rolled back
        out, cache = decode(model, jnp.asarray(accepted_then_rejected[None]), jnp.array([6]), cache, 12)
        np.testing.assert_allclose(np.asarray(out[0, :1]), expected[6:7], atol=2e-5)
        out, cache = decode(model, jnp.asarray(text[None, 7:12]), jnp.array([7]), cache, 12)
    np.testing.assert_allclose(np.asarray(out[0]), expected[7:12], atol=2e-5)
    assert cache.entries.shape == (1, 16, KV_RANK + ROPE)  # the latent and the shared rotary key only
