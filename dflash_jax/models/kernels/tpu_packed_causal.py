"""The target's packed causal attention on TPUs: jax's splash attention (a Pallas TPU kernel),
forward only (the target is frozen).

Splash attention takes segment ids (a query sees keys of its own document) and a static mask:
causal, or with a sliding window W the local mask i - W < j <= i. It skips the key blocks the
static mask leaves empty and computes every other block pair whole: segment ids mask inside a
block and skip none (`packed_causal.py` on GPUs starts each walk at the document's start). So its
work is fixed by the shapes, and it states those FLOPs (`cost.py`). Grouped-query heads are read
in place (its multi-head kernel takes fewer kv heads); attention sinks join its softmax. Queries
are scaled before the kernel (it does not scale). Off a TPU it runs in interpret mode (tests).
The drafter's block attention cannot be a splash mask (its visible keys depend on each batch's
anchors): it has its own kernels, `tpu_block.py`.
"""

from __future__ import annotations

import functools

import jax
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

from dflash_jax.models.kernels import cost, target_backend

BLOCKS = (512, 256, 128)  # splash's tiles: the largest that divides the sequence


def supported(seq_len: int) -> bool:
    return any(seq_len % b == 0 for b in BLOCKS)


def _block(seq_len: int) -> int:
    return next(b for b in BLOCKS if seq_len % b == 0)


@functools.cache
def _kernel(seq_len: int, heads: int, sliding_window: int, interpret: bool):
    block = _block(seq_len)
    shape = (seq_len, seq_len)
    one = masks.LocalMask(shape, (sliding_window - 1, 0), offset=0) if sliding_window else masks.CausalMask(shape)
    sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block)
    return splash.make_splash_mha(
        masks.MultiHeadMask([one] * heads), block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret
    )


def packed_causal_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array,
    *,
    sliding_window: int = 0,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """q [B, S, K*G, H], k/v [B, S, K, H], segment_ids [B, S] -> [B, S, K*G, H]; `sinks` [K*G]."""
    b, s, heads, h = q.shape
    kernel = _kernel(s, heads, sliding_window, target_backend() != "tpu")
    qh = (q * h**-0.5).astype(q.dtype).transpose(0, 2, 1, 3)  # [B, K*G, S, H]
    kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    ids = splash.SegmentIds(q=segment_ids, kv=segment_ids)
    block = _block(s)
    with cost.stating_flops(b * heads * cost.causal_walk_flops(s // block, block, block, h, sliding_window)):
        if sinks is None:
            out = jax.vmap(kernel)(qh, kh, vh, ids)
        else:
            out = jax.vmap(lambda q, k, v, ids: kernel(q, k, v, ids, sinks.astype(jax.numpy.float32)))(qh, kh, vh, ids)
    return out.transpose(0, 2, 1, 3)
