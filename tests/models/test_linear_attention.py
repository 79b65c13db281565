"""Gated DeltaNet (Qwen3.5 / Qwen3-Next linear attention): parity with transformers, packed rows,
decoding, and lossless rollback of rejected drafts. fp32 throughout."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

from dflash_jax.models import hf_config
from dflash_jax.models.families.qwen3_next import unfuse_in_proj
from dflash_jax.models.layers.linear_attention import GatedDeltaNet
from dflash_jax.models.weight_maps import checkpoint_name

# Distinct sizes everywhere (G = 2 value heads per key head, H != U), so no transposed or
# regrouped axis can pass by accident.
HF_SIZES = dict(
    hidden_size=64,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    rms_norm_eps=1e-6,
    num_hidden_layers=1,
    layer_types=["linear_attention"],
)
D = HF_SIZES["hidden_size"]
ATOL = 2e-5
# Every forward runs [2, 160] rows (padded): one compilation for the whole file. 160 tokens are
# two full chunks of 64 and a padded one.
ROWS, S = 2, 160


def _reference(family: str, seed: int = 0):
    """transformers' layer, with the norm scale moved off its initial ones and decays from slow
    (a state that remembers hundreds of tokens) to fast: transformers' initial A of up to 16
    forgets everything within a token or two, which would hide a state that leaks or is lost."""
    torch.manual_seed(seed)
    if family == "qwen3_5":
        layer = Qwen3_5GatedDeltaNet(transformers.Qwen3_5TextConfig(**HF_SIZES), 0)
    else:
        layer = Qwen3NextGatedDeltaNet(transformers.Qwen3NextConfig(**HF_SIZES), 0)
    with torch.no_grad():
        layer.norm.weight.add_(0.2 * torch.randn_like(layer.norm.weight))
        layer.A_log.copy_(torch.log(torch.tensor([0.02, 0.1, 0.5, 4.0])))
        layer.dt_bias.copy_(-1.0 + 0.5 * torch.randn_like(layer.dt_bias))
    return layer.eval()


def _ours(tensors: dict[str, np.ndarray]) -> GatedDeltaNet:
    """Our layer holding `tensors` (torch names and layouts), mapped by the checkpoint loader's rule."""
    layer = GatedDeltaNet(
        hf_config.linear_attention(HF_SIZES),
        hidden_size=D,
        eps=HF_SIZES["rms_norm_eps"],
        param_dtype=jnp.float32,
        compute_dtype=jnp.float32,
        rngs=nnx.Rngs(0),
    )
    graphdef, state = nnx.split(layer)
    used = set()

    def load(path, leaf):
        name, transposed = checkpoint_name(tuple(getattr(k, "key", k) for k in path), "")
        used.add(name)
        tensor = tensors[name].T if transposed else tensors[name]
        assert tensor.shape == leaf.shape, name
        return jnp.asarray(tensor)

    pure = jax.tree_util.tree_map_with_path(load, nnx.to_pure_dict(state))
    assert used == set(tensors)
    nnx.replace_by_pure_dict(state, pure)
    return nnx.merge(graphdef, state)


def _tensors(layer) -> dict[str, np.ndarray]:
    return {name: p.detach().numpy() for name, p in layer.state_dict().items()}


@pytest.fixture(scope="module")
def layer():
    return _ours(_tensors(_reference("qwen3_5")))


@nnx.jit
def _forward(layer, x, segment_ids):
    return layer.packed(x, segment_ids)


@nnx.jit
def _decode(layer, x, cache, start):
    return layer.extend(x, cache, start)


def _run(fn, *args):
    with jax.default_matmul_precision("highest"):
        return jax.tree.map(np.asarray, fn(*args))


def _alone(layer, docs: list[np.ndarray]) -> list[np.ndarray]:
    """Each document [S_i, D] run alone, as the only document of its row -> its outputs [S_i, D]."""
    outputs = []
    for i in range(0, len(docs), ROWS):
        x = np.zeros((ROWS, S, D), np.float32)
        segment_ids = np.zeros((ROWS, S), np.int32)
        for row, doc in enumerate(docs[i : i + ROWS]):
            x[row, : len(doc)], segment_ids[row, : len(doc)] = doc, 1
        out = _run(_forward, layer, jnp.asarray(x), jnp.asarray(segment_ids))
        outputs += [out[row, : len(doc)] for row, doc in enumerate(docs[i : i + ROWS])]
    return outputs


def _inputs(seed, *shape):
    return np.random.default_rng(seed).standard_normal((*shape, D)).astype(np.float32)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_matches_transformers(family):
    reference = _reference(family)
    tensors = _tensors(reference)
    if family == "qwen3_next":
        unfused = unfuse_in_proj(
            tensors.pop("in_proj_qkvz.weight"),
            tensors.pop("in_proj_ba.weight"),
            num_k_heads=HF_SIZES["linear_num_key_heads"],
            num_v_heads=HF_SIZES["linear_num_value_heads"],
            head_k_dim=HF_SIZES["linear_key_head_dim"],
            head_v_dim=HF_SIZES["linear_value_head_dim"],
        )
        tensors.update({f"{name}.weight": w for name, w in unfused.items()})
    # transformers' pure-torch path ignores packing: the rows are whole documents.
    x = _inputs(1, ROWS, S)
    with torch.no_grad():
        expected = reference(torch.from_numpy(x)).numpy()
    got = _run(_forward, _ours(tensors), jnp.asarray(x), jnp.ones((ROWS, S), jnp.int32))
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=ATOL)


def test_next_conversion_rejects_a_mismatched_projection():
    with pytest.raises(ValueError, match="in_proj_qkvz has shape"):
        unfuse_in_proj(np.zeros((100, D)), np.zeros((8, D)), num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=8)


def test_packed_documents_equal_documents_alone(layer):
    # Row 0: documents crossing the chunk boundaries at 64 and 128, then padding; row 1: a
    # document shorter than the conv window, then a long one, then padding.
    lengths = [[70, 45, 30], [3, 130]]
    x = _inputs(2, ROWS, S)
    segment_ids = np.zeros((ROWS, S), np.int32)
    spans = []
    for row, docs in enumerate(lengths):
        segment_ids[row, : sum(docs)] = np.repeat(np.arange(1, len(docs) + 1), docs)
        ends = np.cumsum(docs)
        spans += [(row, slice(end - n, end)) for n, end in zip(docs, ends)]
    packed = _run(_forward, layer, jnp.asarray(x), jnp.asarray(segment_ids))
    alone = _alone(layer, [x[row, span] for row, span in spans])
    for (row, span), expected in zip(spans, alone):
        np.testing.assert_allclose(packed[row, span], expected, rtol=1e-4, atol=ATOL)
    assert np.isfinite(packed).all()


@pytest.mark.parametrize("block", [1, 5])
def test_decoding_in_blocks_equals_the_packed_forward(layer, block):
    length = 20
    x = _inputs(3, ROWS, length)
    cache = layer.empty_cache(ROWS, block)
    outputs = []
    for begin in range(0, length, block):
        start = jnp.full((ROWS,), begin, jnp.int32)
        out, cache = _run(_decode, layer, jnp.asarray(x[:, begin : begin + block]), cache, start)
        outputs.append(out)
    np.testing.assert_allclose(np.concatenate(outputs, axis=1), np.stack(_alone(layer, list(x))), rtol=1e-4, atol=ATOL)


def test_rollback_is_lossless(layer):
    """A prefill longer than the cache's window, then drafts of 5 of which each row keeps some:
    every output equals the packed forward of the tokens the row kept, and the rejected drafts
    leave no trace. Kept per round: row 0 two then all five, row 1 none then three."""
    block, prompt = 5, 70
    x_prompt = _inputs(4, ROWS, prompt)
    drafts = [_inputs(5 + i, ROWS, block) for i in range(3)]
    kept = [[2, 0], [5, 3]]
    cache = layer.empty_cache(ROWS, block)
    start = np.zeros(ROWS, np.int32)
    out, cache = _run(_decode, layer, jnp.asarray(x_prompt), cache, jnp.asarray(start))
    history = [[x_prompt[row]] for row in range(ROWS)]
    outputs = [[out[row]] for row in range(ROWS)]
    start += prompt
    for i, draft in enumerate(drafts):
        out, cache = _run(_decode, layer, jnp.asarray(draft), cache, jnp.asarray(start))
        n = kept[i] if i < len(kept) else [block] * ROWS
        for row in range(ROWS):
            history[row].append(draft[row, : n[row]])
            outputs[row].append(out[row, : n[row]])
        start += np.asarray(n, np.int32)
    expected = _alone(layer, [np.concatenate(h) for h in history])
    for row in range(ROWS):
        np.testing.assert_allclose(np.concatenate(outputs[row]), expected[row], rtol=1e-4, atol=ATOL)
