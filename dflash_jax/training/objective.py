"""The DFlash training objective (DESIGN §2), on packed rows.

A batch is a dict of int32 [rows, seq_len] arrays: `tokens`, `segment_ids` (0 = padding),
`positions` (within the document) and `loss_mask` (1 on response tokens). For every row we
sample `num_anchors` anchor positions on device, build one block `[anchor, MASK, …]` per anchor,
run the drafter over all blocks at once, and score slot k ≥ 1 against the data token at
`anchor + k` with the decay-weighted cross-entropy of the paper.

The frozen target side (features, block embeddings) is `frozen_inputs`; the differentiable
drafter side is `drafter_loss`. The LM head is applied in chunks of blocks, each chunk
rematerialized in the backward pass, so the [blocks × vocab] logits never exist at once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.models.attention import block_context_mask
from dflash_jax.models.chunking import map_block_chunks
from dflash_jax.models.drafter import DFlashDrafter
from dflash_jax.models.qwen3 import Transformer

Batch = dict[str, jax.Array]
BATCH_KEYS = ("tokens", "segment_ids", "positions", "loss_mask")

# docs/design.md §3.3: the paper's loss decay γ per block size; other sizes need an explicit γ.
PAPER_LOSS_DECAY_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


@dataclasses.dataclass(frozen=True)
class ObjectiveConfig:
    block_size: int
    mask_token_id: int
    num_anchors: int
    loss_decay_gamma: float
    target_layer_ids: tuple[int, ...]
    attention_chunk_blocks: int = 32
    lm_head_chunk_blocks: int = 32
    remat: bool = False  # recompute each drafter layer in the backward pass


@flax.struct.dataclass
class Blocks:
    """One block per anchor. R rows, N anchors per row, Bk = block size, S = seq_len."""

    tokens: jax.Array  # [R, N, Bk]   anchor token then MASK tokens
    positions: jax.Array  # [R, N, Bk]   anchor's in-document position + slot
    labels: jax.Array  # [R, N, Bk-1] data token at anchor + k, k = 1..Bk-1
    label_mask: jax.Array  # [R, N, Bk-1] slot is scored: inside the row and the document, a response token
    weights: jax.Array  # [R, N, Bk-1] label_mask · exp(-(k-1)/γ)
    valid: jax.Array  # [R, N] the anchor exists (rows may have fewer candidates than N)
    ctx_mask: jax.Array  # [R, N, S] context positions each block may attend to


def sample_anchors(
    key: jax.Array, segment_ids: jax.Array, loss_mask: jax.Array, num_anchors: int
) -> tuple[jax.Array, jax.Array]:
    """Uniform sampling without replacement of `num_anchors` anchors per row.

    Candidates are positions p whose next token is a response token of the same document.
    Gumbel top-k over the candidates draws a uniform random subset; rows with fewer candidates
    than `num_anchors` get invalid (masked) anchors. Returns (anchor_index [R, N] int32,
    anchor_valid [R, N] bool).
    """
    same_doc_next = (segment_ids[:, :-1] != 0) & (segment_ids[:, 1:] == segment_ids[:, :-1])
    candidate = same_doc_next & (loss_mask[:, 1:] == 1)
    candidate = jnp.pad(candidate, ((0, 0), (0, 1)))  # the last position has no next token
    scores = jnp.where(candidate, jax.random.gumbel(key, candidate.shape), -jnp.inf)
    top, index = jax.lax.top_k(scores, num_anchors)
    valid = jnp.isfinite(top)
    return jnp.where(valid, index, 0).astype(jnp.int32), valid


def _gather_rows(x: jax.Array, index: jax.Array) -> jax.Array:
    """x [R, S], index [R, ...] -> x[r, index[r, ...]]."""
    flat = jnp.take_along_axis(x, index.reshape(index.shape[0], -1), axis=1)
    return flat.reshape(index.shape)


def make_blocks(batch: Batch, anchor_index: jax.Array, anchor_valid: jax.Array, cfg: ObjectiveConfig) -> Blocks:
    seq_len = batch["tokens"].shape[1]
    offsets = jnp.arange(cfg.block_size)
    index = anchor_index[:, :, None] + offsets  # [R, N, Bk]
    in_row = index < seq_len
    index = jnp.minimum(index, seq_len - 1)
    tokens_at = _gather_rows(batch["tokens"], index)
    segment_at = _gather_rows(batch["segment_ids"], index)
    scored = (
        anchor_valid[:, :, None]
        & in_row
        & (segment_at == segment_at[:, :, :1])
        & (_gather_rows(batch["loss_mask"], index) == 1)
    )[:, :, 1:]
    decay = jnp.exp(-jnp.arange(cfg.block_size - 1, dtype=jnp.float32) / cfg.loss_decay_gamma)
    anchor_position = _gather_rows(batch["positions"], anchor_index)
    return Blocks(
        tokens=jnp.where(offsets == 0, tokens_at, cfg.mask_token_id),
        positions=anchor_position[:, :, None] + offsets,
        labels=tokens_at[:, :, 1:],
        label_mask=scored,
        weights=scored * decay,
        valid=anchor_valid,
        ctx_mask=block_context_mask(batch["segment_ids"], anchor_index, anchor_valid),
    )


def frozen_inputs(
    target: Transformer, batch: Batch, key: jax.Array, cfg: ObjectiveConfig
) -> tuple[jax.Array, jax.Array, Blocks]:
    """Everything that does not depend on the drafter: (features, block embeddings, blocks)."""
    anchor_index, anchor_valid = sample_anchors(key, batch["segment_ids"], batch["loss_mask"], cfg.num_anchors)
    blocks = make_blocks(batch, anchor_index, anchor_valid, cfg)
    features = target.features(batch["tokens"], batch["segment_ids"], batch["positions"], cfg.target_layer_ids)
    block_embeds = target.embed(blocks.tokens)
    return jax.lax.stop_gradient(features), jax.lax.stop_gradient(block_embeds), blocks


def lm_head_cross_entropy(
    unembed: Callable[[jax.Array], jax.Array],
    hidden: jax.Array,
    labels: jax.Array,
    *,
    chunk_blocks: int,
) -> tuple[jax.Array, jax.Array]:
    """hidden [R, N, K, D], labels [R, N, K] -> (cross-entropy fp32, argmax == label), [R, N, K].

    Works on `chunk_blocks` blocks of every row at a time (rows stay split over devices), and
    recomputes each chunk's logits in the backward pass instead of storing them.
    """

    def chunk(h, y):
        logits = unembed(h).astype(jnp.float32)
        label_logit = jnp.take_along_axis(logits, y[..., None], axis=-1)[..., 0]
        return jax.nn.logsumexp(logits, axis=-1) - label_logit, jnp.argmax(logits, axis=-1) == y

    return map_block_chunks(chunk, (hidden, labels), chunk_blocks)


def drafter_loss(
    drafter: DFlashDrafter,
    unembed: Callable[[jax.Array], jax.Array],
    features: jax.Array,
    block_embeds: jax.Array,
    ctx_positions: jax.Array,
    blocks: Blocks,
    cfg: ObjectiveConfig,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Decay-weighted CE normalized by Σw (0 when nothing is scored), and metric sums."""
    hidden = drafter(
        block_embeds,
        blocks.positions,
        drafter.context(features),
        ctx_positions,
        blocks.ctx_mask,
        blocks_per_chunk=cfg.attention_chunk_blocks,
        remat=cfg.remat,
    )
    ce, correct = lm_head_cross_entropy(unembed, hidden[:, :, 1:], blocks.labels, chunk_blocks=cfg.lm_head_chunk_blocks)
    weight_sum = blocks.weights.sum()
    loss = (blocks.weights * ce).sum() / jnp.maximum(weight_sum, 1e-9)
    return loss, metric_sums(loss, correct, blocks)


def metric_sums(loss: jax.Array, correct: jax.Array, blocks: Blocks) -> dict[str, jax.Array]:
    """Additive statistics (sum them over micro-batches and steps, then `summarize`)."""
    hit = correct & blocks.label_mask
    leading_hits = jnp.cumprod(hit, axis=-1).sum(-1)  # accepted draft tokens per block
    return {
        "loss_sum": loss.astype(jnp.float32),
        "loss_batches": jnp.float32(1),
        "slot_hits": hit.sum((0, 1)).astype(jnp.float32),
        "slot_scored": blocks.label_mask.sum((0, 1)).astype(jnp.float32),
        "tau_sum": jnp.where(blocks.valid, 1 + leading_hits, 0).sum().astype(jnp.float32),
        "blocks": blocks.valid.sum().astype(jnp.float32),
    }


def summarize(sums: dict) -> dict[str, float]:
    """Metric sums (host values) -> loss, accuracy, per-slot accuracy, tau_train."""
    slot_acc = np.asarray(sums["slot_hits"]) / np.maximum(np.asarray(sums["slot_scored"]), 1)
    out = {
        "loss": float(sums["loss_sum"] / max(float(sums["loss_batches"]), 1)),
        "accuracy": float(sums["slot_hits"].sum() / max(float(sums["slot_scored"].sum()), 1)),
        "tau_train": float(sums["tau_sum"] / max(float(sums["blocks"]), 1)),
    }
    out.update({f"acc_slot_{k + 1}": float(a) for k, a in enumerate(slot_acc)})
    return out
