"""Inputs for the drafter's block attention tests (tests/models/test_attention_kernels.py,
test_tpu_attention_kernel.py): packed rows with the objective's own anchors, random q/k/v, and
the output and gradients of one implementation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.data.synthetic import packed_batch
from dflash_jax.models.layers import block_attention
from dflash_jax.training import objective


def normal(key, shape, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(key), shape).astype(dtype)


def context_mask(rows, seq_len, num_blocks, seed=0):
    """Segment ids and a context mask from the objective's own anchor sampling, with an invalid
    block and a block anchored at a document start (both see no context)."""
    batch = {
        k: jnp.asarray(v)
        for k, v in packed_batch(np.random.default_rng(seed), rows, seq_len, 100, doc_len=(12, 70)).items()
    }
    keys = objective.row_keys(jax.random.key(seed), jnp.arange(rows))
    index, valid = objective.sample_anchors(keys, batch["segment_ids"], batch["loss_mask"], num_blocks, "row")
    index, valid = index.at[0, 0].set(0), valid.at[0, 1].set(False)
    return block_attention.block_context_mask(batch["segment_ids"], index, valid)


def inputs(rows, seq_len, num_blocks, block_len, heads, kv_heads, head_dim, dtype):
    shapes = [
        (rows, num_blocks, block_len, heads, head_dim),
        (rows, seq_len, kv_heads, head_dim),
        (rows, seq_len, kv_heads, head_dim),
        (rows, num_blocks, block_len, kv_heads, head_dim),
        (rows, num_blocks, block_len, kv_heads, head_dim),
    ]
    return tuple(normal(10 + i, shape, dtype) for i, shape in enumerate(shapes))


def loss_and_grads(impl, args, mask, cotangent):
    def loss(args):
        out = block_attention.block_attention(*args, mask, blocks_per_chunk=3, implementation=impl)
        return jnp.sum(out.astype(jnp.float32) * cotangent), out

    with jax.default_matmul_precision("highest"):
        (_, out), grads = jax.value_and_grad(loss, has_aux=True)(args)
    return out.astype(jnp.float32), [g.astype(jnp.float32) for g in grads]
