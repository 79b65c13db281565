"""The TPU attention kernels equal the XLA code, run in Pallas interpret mode on CPU: the target's
packed causal attention (jax's splash attention, models/kernels/tpu_packed_causal.py) with
documents packed in rows, grouped-query heads, a sliding window and attention sinks (gpt-oss);
the drafter's block attention (models/kernels/tpu_block.py) with its gradients. Traced for a TPU,
"fused" uses them, and "auto" the blocks' kernel."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.data.synthetic import packed_batch
from dflash_jax.models import kernels
from dflash_jax.models.kernels import cost, tpu_block, tpu_packed_causal
from dflash_jax.models.layers import attention, block_attention
from support import block_cases


@pytest.mark.parametrize(
    ("window", "with_sinks", "dtype", "atol"),
    [(0, False, jnp.float32, 2e-5), (100, True, jnp.float32, 2e-5), (0, False, jnp.bfloat16, 3e-2)],
)
def test_splash_packed_causal_equals_xla(window, with_sinks, dtype, atol):
    rows, seq_len, heads, kv_heads, head_dim = 2, 256, 4, 2, 64
    batch = packed_batch(np.random.default_rng(0), rows, seq_len, 100, doc_len=(10, 90))
    seg = jnp.asarray(batch["segment_ids"]).at[1, :150].set(1)  # a document over more than one tile
    q, k, v = (
        jax.random.normal(jax.random.key(i), (rows, seq_len, n, head_dim)).astype(dtype)
        for i, n in ((1, heads), (2, kv_heads), (3, kv_heads))
    )
    sinks = jnp.linspace(-1.0, 1.0, heads) if with_sinks else None
    with jax.default_matmul_precision("highest"):
        reference = attention._packed_causal_xla(q, k, v, seg, window, sinks).astype(jnp.float32)
        splash = tpu_packed_causal.packed_causal_attention(q, k, v, seg, sliding_window=window, sinks=sinks)
    real = np.asarray(seg != 0)[..., None, None]  # outputs at padding are unspecified
    np.testing.assert_allclose(np.where(real, splash.astype(jnp.float32), 0), np.where(real, reference, 0), atol=atol)


@pytest.mark.parametrize(
    ("seq_len", "num_blocks", "block_len", "heads", "kv_heads", "dtype", "atol"),
    [
        (300, 19, 8, 4, 2, jnp.float32, 2e-5),  # 3 key tiles, 3 chunks (the last padded), G = 2
        pytest.param(200, 9, 6, 6, 2, jnp.float32, 2e-5, marks=pytest.mark.slow),  # G = 3, L = 6
        pytest.param(256, 16, 16, 2, 2, jnp.bfloat16, 5e-2, marks=pytest.mark.slow),
    ],
)
def test_tpu_block_attention_equals_xla_with_gradients(
    monkeypatch, seq_len, num_blocks, block_len, heads, kv_heads, dtype, atol
):
    """Key tiles of 128 (not 512), so short rows exercise the walk: chunks whose spans cross
    tiles, chunks and tiles no span reaches, blocks that see no context (`_blocks`)."""
    monkeypatch.setattr(tpu_block, "MAX_TILE", 128)
    rows = 2
    mask = block_cases.context_mask(rows, seq_len, num_blocks)
    args = block_cases.inputs(rows, seq_len, num_blocks, block_len, heads, kv_heads, 32, dtype)
    cotangent = block_cases.normal(30, args[0].shape)
    out_xla, grads_xla = block_cases.loss_and_grads("xla", args, mask, cotangent)
    spans = block_attention.context_spans(mask)

    def loss(args):  # the kernels alone: off a TPU they run in interpret mode
        out = tpu_block.block_attention_in_spans(*args, *spans)
        return jnp.sum(out.astype(jnp.float32) * cotangent), out

    with jax.default_matmul_precision("highest"):
        (_, out_tpu), grads_tpu = jax.value_and_grad(loss, has_aux=True)(args)
    out_tpu, grads_tpu = out_tpu.astype(jnp.float32), [g.astype(jnp.float32) for g in grads_tpu]
    np.testing.assert_allclose(out_tpu, out_xla, atol=atol)
    scale = 1 if dtype == jnp.float32 else 4  # bf16 gradients sum many rounded terms
    for name, tpu, xla in zip(("q", "k_ctx", "v_ctx", "k_blk", "v_blk"), grads_tpu, grads_xla):
        np.testing.assert_allclose(tpu, xla, atol=scale * atol, err_msg=name)


def test_the_block_kernels_walk_only_the_tiles_spans_reach():
    """Per chunk of CHUNK blocks, its spans' tiles; per tile, the chunks reaching it; the cost
    the kernels state assumes one document a row: about half the (chunk, tile) pairs."""
    tile = 128
    start = jnp.array([[0, 0, 130, 130, 130, 300, 300, 0, *[0] * 8]], jnp.int32)  # 2 chunks of 8
    end = jnp.array([[0, 5, 140, 200, 260, 310, 380, 0, *[0] * 8]], jnp.int32)
    first, count = tpu_block._chunk_tiles(start, end, tile)
    assert first.tolist() == [0, 0] and count.tolist() == [3, 0]  # tiles 0-2; the second sees none
    first, count = tpu_block._tile_chunks(first.reshape(1, 2), count.reshape(1, 2), tiles=4)
    assert first.tolist() == [0, 0, 0, 0] and count.tolist() == [1, 1, 1, 0]
    assert 0.5 < cost.expected_visits(64, 6) / (64 * 6) < 0.6


@pytest.mark.parametrize("sliding_window, visited", [(0, 1 + 2 + 3), (512, 1 + 2 + 2)])
def test_splash_states_the_block_pairs_it_computes(sliding_window, visited):
    """Splash computes every 512 x 512 block pair its static mask reaches, whole: 3 query blocks
    visit 1, 2, 3 key blocks causally; with a window of 512 keys the last visits only 2."""
    sds = jax.ShapeDtypeStruct
    q, kv, seg = sds((2, 1536, 4, 64), jnp.bfloat16), sds((2, 1536, 2, 64), jnp.bfloat16), sds((2, 1536), jnp.int32)

    def target(q, k, v, segment_ids):
        return tpu_packed_causal.packed_causal_attention(q, k, v, segment_ids, sliding_window=sliding_window)

    with kernels.compiled_for("tpu"):
        lowered = jax.jit(target).trace(q, kv, kv, seg).lower(lowering_platforms=("tpu",))
    stated = set(re.findall(r"kernel_flops=(\d+)", lowered.as_text(debug_info=True)))
    assert stated == {str(2 * 4 * visited * 2 * (2 * 512 * 512 * 64))}  # rows x heads x pairs x (scores, values)


def test_fused_on_tpu_is_splash_for_the_target():
    q = jnp.zeros((1, 256, 4, 64))
    k = v = jnp.zeros((1, 256, 2, 64))
    seg = jnp.ones((1, 256), jnp.int32)

    def traced(fn):
        with kernels.compiled_for("tpu"):
            return str(jax.make_jaxpr(fn)(q, k, v, seg))

    target = traced(lambda q, k, v, s: attention.packed_causal_attention(q, k, v, s, implementation="fused"))
    assert "pallas_call" in target and "splash" in target
    assert attention.resolve_implementation("auto", "tpu") == "fused"
    q_blk, kv_blk, mask = jnp.zeros((1, 8, 4, 4, 64)), jnp.zeros((1, 8, 4, 2, 64)), jnp.ones((1, 8, 256), bool)

    def drafter(q, k, v, kb, vb, mask):
        return block_attention.block_attention(q, k, v, kb, vb, mask, blocks_per_chunk=4, implementation="fused")

    with kernels.compiled_for("tpu"):
        assert "dflash_block_attention_fwd_tpu" in str(jax.make_jaxpr(drafter)(q_blk, k, v, kv_blk, kv_blk, mask))
    assert not tpu_packed_causal.supported(200)  # then the XLA code runs
