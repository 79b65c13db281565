"""The target's packed causal attention on TPUs (jax's splash attention, models/kernels/
tpu_packed_causal.py) equals the XLA code, run in Pallas interpret mode on CPU: documents packed
in rows, grouped-query heads, a sliding window and attention sinks (gpt-oss); and the target's
attention traced for a TPU uses it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.data.synthetic import packed_batch
from dflash_jax.models import attention, kernels
from dflash_jax.models.kernels import tpu_packed_causal


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


def test_fused_on_tpu_is_splash_for_the_target():
    q = jnp.zeros((1, 256, 4, 64))
    k = v = jnp.zeros((1, 256, 2, 64))
    seg = jnp.ones((1, 256), jnp.int32)

    def traced(fn):
        with kernels.compiled_for("tpu"):
            return str(jax.make_jaxpr(fn)(q, k, v, seg))

    target = traced(lambda q, k, v, s: attention.packed_causal_attention(q, k, v, s, implementation="fused"))
    assert "pallas_call" in target and "splash" in target
    assert attention.resolve_implementation("auto", "tpu") == "xla"
    assert not tpu_packed_causal.supported(200)  # then the XLA code runs
