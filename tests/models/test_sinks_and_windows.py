"""gpt-oss' attention options in every target attention path: learned per-head sinks and sliding
windows (models/layers/attention.py, models/kernels/packed_causal.py).

The float64 reference (`support.reference_attention.sink_attention` under `packed_causal_mask`)
is checked once against transformers' gpt-oss eager attention, document by document with
transformers' own sliding-window mask; the XLA path, the fused kernel (Pallas interpret mode on
CPU) and decoding are checked against it. Window kernels must skip key tiles, not only mask
them: keys and values before the window are NaN, and a visited tile would carry the NaN into
the output (0 · NaN).
"""

from __future__ import annotations

import functools
import os
import textwrap
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import masking_utils
from transformers.models.gpt_oss import modeling_gpt_oss

from dflash_jax.data.synthetic import packed_batch
from dflash_jax.models import kernels
from dflash_jax.models.layers import attention
from support.reference_attention import packed_causal_mask, sink_attention
from support.simulated_devices import run_script


def _normal(seed, shape, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32), dtype)


def _qkv(rows, seq_len, heads, kv_heads, head_dim, dtype=jnp.float32):
    return tuple(
        _normal(seed, (rows, seq_len, n, head_dim), dtype) for seed, n in zip((1, 2, 3), (heads, kv_heads, kv_heads))
    )


def _sinks(heads):
    """Per-head logits spread around the scores' range, so the sink's share differs per head."""
    return jnp.linspace(-2.0, 3.0, heads, dtype=jnp.float32)


def _segments(rows, seq_len, doc_len, seed=0):
    batch = packed_batch(np.random.default_rng(seed), rows, seq_len, 100, doc_len=doc_len)
    return jnp.asarray(batch["segment_ids"])


def _real(segment_ids):
    return np.asarray(segment_ids != 0)[..., None, None]


# Jitted: one compilation per case costs less CPU than running the tile loop op by op.
_packed_attention = jax.jit(attention.packed_causal_attention, static_argnames=("implementation", "sliding_window"))


def _packed(impl, q, k, v, segment_ids, window, sinks):
    with jax.default_matmul_precision("highest"):
        return _packed_attention(q, k, v, segment_ids, implementation=impl, sliding_window=window, sinks=sinks)


def _reference(q, k, v, segment_ids, window, sinks):
    return sink_attention(q, k, v, packed_causal_mask(segment_ids, window), sinks)


def _close_where_real(actual, expected, segment_ids, atol):
    real = _real(segment_ids)
    np.testing.assert_allclose(
        np.where(real, np.asarray(actual, np.float32), 0), np.where(real, expected, 0), atol=atol
    )


@pytest.mark.parametrize("window", [0, 5])
def test_reference_is_transformers_gpt_oss_attention(window):
    """One packed row of three documents against transformers' eager attention run on each
    document alone, masked by transformers' own (sliding-window) causal mask function."""
    lengths, heads, kv_heads, head_dim = (9, 14, 6), 4, 2, 8
    segment_ids = jnp.asarray([np.repeat(np.arange(1, 4), lengths).tolist() + [0, 0]])
    q, k, v = _qkv(1, segment_ids.shape[1], heads, kv_heads, head_dim)
    sinks = _sinks(heads)
    mask_fn = (
        masking_utils.sliding_window_causal_mask_function(window) if window else masking_utils.causal_mask_function
    )
    module = types.SimpleNamespace(
        num_key_value_groups=heads // kv_heads, sinks=torch.tensor(np.asarray(sinks)), training=False
    )
    expected, start = [], 0
    for n in lengths:
        index = torch.arange(n)
        visible = mask_fn(0, 0, index[:, None], index[None, :])
        additive = torch.where(visible, 0.0, torch.finfo(torch.float32).min)[None, None]
        doc = [torch.tensor(np.asarray(x[:, start : start + n])).transpose(1, 2) for x in (q, k, v)]
        out, _ = modeling_gpt_oss.eager_attention_forward(module, *doc, additive, scaling=head_dim**-0.5)
        expected.append(out.numpy())  # [1, n, K*G, H]
        start += n
    reference = _reference(q, k, v, segment_ids, window, sinks)
    np.testing.assert_allclose(reference[:, :start], np.concatenate(expected, axis=1), atol=1e-5)


@pytest.mark.parametrize(
    ("seq_len", "window", "with_sinks"),
    [(300, 0, True), (300, 37, False), pytest.param(600, 128, True, marks=pytest.mark.slow), (100, 500, True)],
)
def test_xla_packed_attention_equals_reference(seq_len, window, with_sinks):
    segment_ids = _segments(2, seq_len, (seq_len // 6, seq_len // 2))
    q, k, v = _qkv(2, seq_len, 4, 2, 16)
    sinks = _sinks(4) if with_sinks else None
    out = _packed("xla", q, k, v, segment_ids, window, sinks)
    _close_where_real(out, _reference(q, k, v, segment_ids, window, sinks), segment_ids, atol=1e-5)
    assert np.isfinite(np.asarray(out)).all()


def test_window_shrinks_the_computed_pairs():
    tiles = attention.packed_causal_tiles(1024)
    assert attention.packed_causal_pairs(1024, 0) == attention.packed_causal_pairs(1024)
    windowed = attention.packed_causal_pairs(1024, 128)
    assert windowed == sum((hi - lo) * (hi - max(0, lo - 127)) for lo, hi in tiles)
    assert windowed < attention.packed_causal_pairs(1024) / 2
    assert attention.packed_causal_pairs(1024, 4096) == attention.packed_causal_pairs(1024)


@pytest.mark.parametrize(
    ("window", "with_sinks", "dtype", "atol"),
    [
        (0, True, jnp.float32, 2e-5),
        (1, True, jnp.float32, 2e-5),  # each query sees itself only
        (64, False, jnp.float32, 2e-5),  # exactly one key tile
        pytest.param(100, True, jnp.bfloat16, 3e-2, marks=pytest.mark.slow),
    ],
)
def test_fused_packed_attention_equals_xla(window, with_sinks, dtype, atol):
    seq_len = 200  # not a multiple of the tiles
    segment_ids = _segments(2, seq_len, (10, 90)).at[1, :150].set(1)  # a document over three key tiles
    q, k, v = _qkv(2, seq_len, 4, 2, 32, dtype)
    sinks = _sinks(4) if with_sinks else None
    reference = _packed("xla", q, k, v, segment_ids, window, sinks).astype(jnp.float32)
    fused = _packed("fused", q, k, v, segment_ids, window, sinks).astype(jnp.float32)
    _close_where_real(fused, np.asarray(reference), segment_ids, atol)
    assert np.isfinite(np.asarray(fused)).all()


@pytest.mark.parametrize("impl", ["xla", "fused"])
def test_key_tiles_before_the_window_are_never_read(impl):
    """One document of 512 tokens, window 60: queries from 384 on need no key before 325, and
    both implementations' key loops start at or after 320 for them (XLA: the 128-query tile
    [384, 512) from key 325; fused: 64-query tiles 6 and 7 from key tiles 5 and 6). Keys and
    values before 320 are NaN: a tile that was masked but still computed would give NaN."""
    seq_len, window, first_checked, poisoned = 512, 60, 384, 320
    segment_ids = jnp.ones((1, seq_len), jnp.int32)
    q, k, v = _qkv(1, seq_len, 2, 1, 32)
    sinks = _sinks(2)
    clean = _packed(impl, q, k, v, segment_ids, window, sinks)
    k_nan, v_nan = (x.at[:, :poisoned].set(jnp.nan) for x in (k, v))
    out = _packed(impl, q, k_nan, v_nan, segment_ids, window, sinks)
    assert np.isfinite(np.asarray(out[:, first_checked:])).all()
    np.testing.assert_array_equal(out[:, first_checked:], clean[:, first_checked:])
    assert np.isnan(np.asarray(out[:, :poisoned])).any()  # the poison does reach what reads it


@functools.partial(jax.jit, static_argnames=("num_new", "window"))
def _decode(q, k_cache, v_cache, lengths, sinks, *, num_new, window):
    mask = attention.cached_causal_mask(lengths, num_new, k_cache.shape[1], sliding_window=window)
    with jax.default_matmul_precision("highest"):
        return attention.attend(q, k_cache, v_cache, mask, sinks=sinks), mask


def test_decode_with_window_and_sinks_equals_reference():
    """New tokens appended to caches of different lengths (slots past the new tokens hold
    stale garbage) see what the same tokens see in one causal sliding-window pass."""
    rows, num_new, cache_size, window, heads, kv_heads, head_dim = 2, 4, 24, 6, 4, 2, 16
    lengths = np.asarray([3, 11])
    q_all, k_all, v_all = (np.asarray(x) for x in _qkv(rows, cache_size, heads, kv_heads, head_dim))
    sinks = _sinks(heads)
    live = np.arange(cache_size)[None, :] < (lengths + num_new)[:, None]
    stale = np.asarray(_normal(9, k_all.shape)) * 100
    k_cache, v_cache = (np.where(live[..., None, None], x, stale) for x in (k_all, v_all))
    new = lengths[:, None] + np.arange(num_new)  # [B, T] the new tokens' slots
    q = np.take_along_axis(q_all, new[..., None, None], axis=1)
    out, mask = _decode(q, k_cache, v_cache, jnp.asarray(lengths), sinks, num_new=num_new, window=window)
    full = _reference(q_all, k_all, v_all, jnp.asarray(live, jnp.int32), window, sinks)
    np.testing.assert_allclose(out, np.take_along_axis(full, new[..., None, None], axis=1), atol=1e-5)
    assert (np.asarray(mask).sum(-1) == np.minimum(new + 1, window)).all() and (new + 1 > window).any()


def test_fully_masked_rows_stay_finite_with_sinks():
    """A query that sees nothing gives the sink all the weight: zeros, not NaN."""
    q, k, v = _qkv(1, 8, 2, 1, 16)
    mask = np.tril(np.ones((1, 8, 8), bool))
    mask[0, :4] = False
    out = np.asarray(jax.jit(attention.attend)(q, k, v, mask, sinks=_sinks(2)))
    assert np.isfinite(out).all()
    np.testing.assert_array_equal(out[0, :4], 0)


def test_fused_kernel_with_window_and_sinks_lowers_to_triton_for_gpu():
    """gpt-oss-20b's head layout (64 query heads of 64 over 8 kv heads, window 128)."""
    sds = jax.ShapeDtypeStruct
    q, kv = sds((1, 512, 64, 64), jnp.bfloat16), sds((1, 512, 8, 64), jnp.bfloat16)
    segment_ids, sinks = sds((1, 512), jnp.int32), sds((64,), jnp.float32)

    def target(q, k, v, segment_ids, sinks):
        return attention.packed_causal_attention(
            q, k, v, segment_ids, implementation="fused", sliding_window=128, sinks=sinks
        )

    with kernels.compiled_for_gpu():
        hlo = jax.jit(target).trace(q, kv, kv, segment_ids, sinks).lower(lowering_platforms=("cuda",)).as_text()
    assert hlo.count("__gpu$xla.gpu.triton") == 1


SHARDED_CHECK = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from dflash_jax.models import sharding
    from dflash_jax.models.layers import attention
    from dflash_jax.training.mesh import make_mesh
    import test_sinks_and_windows as t

    segment_ids = t._segments(2, 128, (10, 60))
    q, k, v = t._qkv(2, 128, 4, 2, 32)
    sinks = t._sinks(4)
    alone = t._packed("fused", q, k, v, segment_ids, 40, sinks)
    for mesh in (make_mesh(2, 1, 1), make_mesh(1, 1, 2)):  # rows split; heads split
        def run(q, k, v, segment_ids, sinks, window=40):  # not t._packed: its jit cache ignores the mesh
            with sharding.activation_sharding(mesh), jax.default_matmul_precision("highest"):
                return attention.packed_causal_attention(
                    q, k, v, segment_ids, implementation="fused", sliding_window=window, sinks=sinks
                )
        np.testing.assert_allclose(jax.jit(run)(q, k, v, segment_ids, sinks), alone, atol=1e-5)
        for head_sinks, window in ((sinks, 40), (None, 0)):  # the plain kernel, traced only
            assert "shard_map" in str(jax.make_jaxpr(run, static_argnums=5)(q, k, v, segment_ids, head_sinks, window))
    print("ok")
    """
)


@pytest.mark.slow
def test_fused_attention_runs_per_shard_with_sinks_following_their_heads():
    result = run_script(SHARDED_CHECK, devices=2, import_dir=os.path.dirname(__file__))
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]
