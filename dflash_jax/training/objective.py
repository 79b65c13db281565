"""The DFlash training objective (docs/design.md §3), on packed rows.

A batch is a dict of int32 [rows, seq_len] arrays: `tokens`, `segment_ids` (0 = padding),
`positions` (within the document) and `loss_mask` (1 on response tokens). For every row we
sample `num_anchors` anchor positions on device, build one block `[anchor, MASK, …]` per anchor,
run the drafter over all blocks at once, and score slot k ≥ 1 against the data token at
`anchor + k` (or, with `distill`, against the target's whole next-token distribution there) with
a weighted cross-entropy: the paper's position decay ('dflash') or D-PACE's confidence weights
('dpace').

Each drafter kind (docs/design.md "Drafter kinds") scores the blocks with its own terms, built
from the pieces here (training/kinds/, a module per kind; training/loss.py runs them).

The frozen target side (features, block embeddings) is `frozen_inputs`. The LM head is applied
in chunks of blocks, each computing its own gradient with respect to the hidden states, so the
[blocks × vocab] logits never exist at once and are never recomputed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.models.drafter_config import DrafterConfig
from dflash_jax.models.layers.block_attention import block_context_mask
from dflash_jax.models.layers.chunking import BLOCKS_PER_CHUNK, map_block_chunks
from dflash_jax.models.transformer import Transformer
from dflash_jax.training.head_terms import vocab_parallel_logits

Batch = dict[str, jax.Array]

# docs/design.md §3.3: the paper's loss decay γ per block size; other sizes need an explicit γ
# (unless the drafter's kind has its own, `Kind.loss_decay_gamma`).
PAPER_LOSS_DECAY_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}

# docs/design.md §3.1: how anchors are drawn. 'document': response-token anchors shared out per
# document; 'response': response-token anchors uniform over the row; 'row': the original scheme
# (uniform over the row, the last prompt token allowed), kept for comparison.
ANCHOR_SCHEMES = ("document", "response", "row")

# docs/design.md §3.3: how slots are weighted. 'dflash': the paper's exponential position decay,
# divided by Σw; 'dpace': D-PACE (arXiv 2605.18810), weights from the drafter's own confidence,
# divided by the number of documents.
LOSSES = ("dflash", "dpace")


@dataclasses.dataclass(frozen=True)
class ObjectiveSettings:
    """The objective's fields of the `train` section (training/config/sections.py's TrainSettings)."""

    # Blocks per row; 0 = the drafter kind's for data.seq_len (`Kind.anchors_per_token`, with its
    # `anchors_per_document` cap unless one is set).
    num_anchors: int = 512
    # docs/design.md §3.1: 'document' (response-token anchors, every document its share),
    # 'response' (response-token anchors, uniform over the row) or 'row' (the original scheme).
    anchor_scheme: str = "document"
    # 'document': cap on one document's anchors; 0 = no cap (with num_anchors 0: the kind's).
    anchors_per_document: int = 0
    # docs/design.md §3.3: how each slot's loss is weighted: 'dflash' (the paper's position decay)
    # or 'dpace' (D-PACE confidence weights); '' = the drafter kind's own (`Kind.loss`).
    loss: str = ""
    # 'dpace': smoothing of the target token's probability, in [0, 1]; -1 = the drafter kind's
    # (`Kind.dpace_alpha`).
    dpace_alpha: float = -1.0
    # 'dflash': γ of the position decay; 0 = the paper's value for the block size, or the
    # drafter kind's own (`Kind.loss_decay_gamma`, as its authors train it).
    loss_decay_gamma: float = 0.0
    # docs/design.md §3.3: score each slot against the target's whole next-token distribution
    # (KL divergence) instead of the data token alone.
    distill: bool = False
    # A drafter with a candidate selector: weight α of the candidate cross-entropy added to the
    # DFlash loss.
    selector_alpha: float = 1.0
    # A drafter whose heads correct the backbone's logits: weight λ of the backbone's own loss in
    # (1 − λ)·corrected + λ·backbone at the first step, falling linearly to 0 over the first
    # `base_loss_decay` of the run (SpecForge's curriculum: 1 over the first half);
    # base_loss_decay=0 keeps λ fixed.
    base_loss_weight: float = 1.0
    base_loss_decay: float = 0.5
    # Recompute each drafter layer in the backward pass.
    remat: bool = False
    # What a recomputed layer keeps (models/layers/layer_stack.py's REMAT_POLICIES): 'full' nothing;
    # 'dots_saveable' every matmul's output; 'dots_with_no_batch_dims_saveable' the weight
    # matmuls' (not attention's).
    remat_policy: str = "full"
    # Blocks per attention chunk (memory vs speed).
    attention_chunk_blocks: int = BLOCKS_PER_CHUNK
    # Blocks per LM-head/cross-entropy chunk.
    lm_head_chunk_blocks: int = 32


@dataclasses.dataclass(frozen=True)
class ObjectiveConfig(ObjectiveSettings):
    """The settings resolved against the drafter (`training.config.run_config.resolve`)."""

    drafter: DrafterConfig = dataclasses.field(kw_only=True)
    loss: str = dataclasses.field(kw_only=True)  # resolved: never ''
    loss_decay_gamma: float = dataclasses.field(kw_only=True)  # resolved: never 0
    dpace_alpha: float = dataclasses.field(kw_only=True)  # resolved: never -1
    total_steps: int = 0  # the run's length (`step.build_train_step`): what schedules over it read

    @property
    def needs_target_distribution(self) -> bool:
        """Whether the target's next-token distribution at each label is computed (to distill,
        or for a kind whose loss always reads it)."""
        return self.distill or self.drafter.kind_spec.reads_target_distribution


@flax.struct.dataclass
class Blocks:
    """One block per anchor. R rows, N anchors per row, Bk = block size, S = seq_len, K = scored
    slots per block (Bk - 1, or Bk for a kind whose every slot drafts: `DrafterConfig.num_scored`)."""

    tokens: jax.Array  # [R, N, Bk]   anchor token then MASK tokens
    positions: jax.Array  # [R, N, Bk]   anchor's in-document position + slot
    labels: jax.Array  # [R, N, K] data token at anchor + k, k = 1..K
    label_mask: jax.Array  # [R, N, K] slot is scored: inside the row and the document, a response token
    valid: jax.Array  # [R, N] the anchor exists (rows may have fewer candidates than N)
    ctx_mask: jax.Array  # [R, N, S] context positions each block may attend to
    documents: jax.Array  # [R] documents in the row ('dpace' divides by their global count)
    # [R, N, K, D] 'distill' and kinds whose loss reads the target's distribution: the target's
    # normed last hidden state that predicts each label
    target_hidden: jax.Array | None = None
    # [R, N, Bk, D] kinds that read the realised tokens: the target's embeddings of the anchor and
    # the labels but the last
    realised_embeds: jax.Array | None = None


def count_documents(segment_ids: jax.Array) -> jax.Array:
    """[R, S] -> [R] int32: documents in each row (a document never spans two rows, §6.5)."""
    starts = (segment_ids != 0) & (segment_ids != jnp.pad(segment_ids, ((0, 0), (1, 0)))[:, :-1])
    return starts.sum(axis=1, dtype=jnp.int32)


def anchor_candidates(segment_ids: jax.Array, loss_mask: jax.Array, scheme: str) -> jax.Array:
    """[R, S] bool: positions p that may anchor a block (docs/design.md §3.1).

    Every scheme needs p + 1 to be a response token of p's document. 'response' and 'document'
    also need p itself to be a response token, as at inference, where the anchor is always a
    token the target generated; 'row' (the original scheme) also accepts the last prompt token.
    """
    same_doc_next = (segment_ids[:, :-1] != 0) & (segment_ids[:, 1:] == segment_ids[:, :-1])
    candidate = same_doc_next & (loss_mask[:, 1:] == 1)
    if scheme != "row":
        candidate &= loss_mask[:, :-1] == 1
    return jnp.pad(candidate, ((0, 0), (0, 1)))  # the last position has no next token


def rank_within_documents(segment_ids: jax.Array, candidate: jax.Array, noise: jax.Array) -> jax.Array:
    """[R, S] int32: each candidate's rank by `noise` among its document's candidates (0 = lowest
    noise); non-candidates get S. With uniform noise, the candidates of rank < c are a uniform
    random subset of c of the document's candidates."""
    s = segment_ids.shape[1]
    order = jnp.lexsort((noise, ~candidate, segment_ids), axis=-1)  # by document, candidates first
    sorted_segments = jnp.take_along_axis(segment_ids, order, axis=1)
    position = jnp.broadcast_to(jnp.arange(s), segment_ids.shape)
    new_document = jnp.concatenate(
        [jnp.ones_like(sorted_segments[:, :1], bool), sorted_segments[:, 1:] != sorted_segments[:, :-1]], axis=1
    )
    document_start = jax.lax.cummax(jnp.where(new_document, position, 0), axis=1)
    rank = jnp.take_along_axis(position - document_start, jnp.argsort(order, axis=1), axis=1)
    return jnp.where(candidate, rank, s).astype(jnp.int32)


def sample_anchors(
    row_keys: jax.Array,
    segment_ids: jax.Array,
    loss_mask: jax.Array,
    num_anchors: int,
    scheme: str,
    anchors_per_document: int = 0,
) -> tuple[jax.Array, jax.Array]:
    """`num_anchors` anchors per row, drawn uniformly without replacement (docs/design.md §3.1).

    row_keys [R] (one PRNG key per row: a row's anchors depend on the row, not on how the batch
    is split into micro-batches or over devices). 'row' and 'response' draw among all the row's
    candidates; 'document' gives every document its share: candidates are taken in rounds (the
    first round takes one random candidate of each document, the next round a second one, ...),
    so a long document cannot crowd out the beginnings of the short ones, and
    `anchors_per_document` > 0 caps a document's share. Rows with fewer candidates than
    `num_anchors` get invalid (masked) anchors. Returns (anchor_index [R, N] int32, valid [R, N]).
    """
    candidate = anchor_candidates(segment_ids, loss_mask, scheme)
    shape = (segment_ids.shape[1],)
    noise = jax.vmap(lambda key: jax.random.uniform(key, shape))(row_keys)
    if scheme == "document":
        rank = rank_within_documents(segment_ids, candidate, noise)
        if anchors_per_document:
            candidate &= rank < anchors_per_document
        tie_break = jax.vmap(lambda key: jax.random.uniform(jax.random.fold_in(key, 1), shape))(row_keys)
        noise = rank + tie_break  # round r of the documents before round r + 1, in random order
    top, index = jax.lax.top_k(jnp.where(candidate, -noise, -jnp.inf), num_anchors)
    valid = jnp.isfinite(top)
    return jnp.where(valid, index, 0).astype(jnp.int32), valid


def _gather_rows(x: jax.Array, index: jax.Array) -> jax.Array:
    """x [R, S], index [R, ...] -> x[r, index[r, ...]]."""
    flat = jnp.take_along_axis(x, index.reshape(index.shape[0], -1), axis=1)
    return flat.reshape(index.shape)


def make_blocks(batch: Batch, anchor_index: jax.Array, anchor_valid: jax.Array, cfg: ObjectiveConfig) -> Blocks:
    seq_len, drafter = batch["tokens"].shape[1], cfg.drafter
    index = anchor_index[:, :, None] + jnp.arange(drafter.num_scored + 1)  # the anchor and the labels
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
    if drafter.kind_spec.scores_prefix:  # only the slots before the first unscored one
        scored = jnp.cumprod(scored, axis=-1).astype(bool)
    anchor_position = _gather_rows(batch["positions"], anchor_index)
    offsets = jnp.arange(drafter.block_size)
    return Blocks(
        tokens=jnp.where(offsets == 0, tokens_at[:, :, : drafter.block_size], drafter.mask_token_id),
        positions=anchor_position[:, :, None] + offsets,
        labels=tokens_at[:, :, 1:],
        label_mask=scored,
        valid=anchor_valid,
        ctx_mask=block_context_mask(batch["segment_ids"], anchor_index, anchor_valid),
        documents=count_documents(batch["segment_ids"]),
    )


def frozen_inputs(
    target: Transformer, batch: Batch, row_keys: jax.Array, cfg: ObjectiveConfig
) -> tuple[jax.Array, jax.Array, Blocks]:
    """Everything that does not depend on the drafter: (features, block embeddings, blocks).

    row_keys [R]: one anchor-sampling key per row (see `row_keys`)."""
    anchor_index, anchor_valid = sample_anchors(
        row_keys,
        batch["segment_ids"],
        batch["loss_mask"],
        cfg.num_anchors,
        cfg.anchor_scheme,
        cfg.anchors_per_document,
    )
    blocks = make_blocks(batch, anchor_index, anchor_valid, cfg)
    layer_ids = tuple(cfg.drafter.target_layer_ids)
    if cfg.needs_target_distribution:  # the forward also runs to the last layer, whose states predict the labels
        layer_ids += (target.cfg.num_layers - 1,)
    _, hidden = target(
        batch["tokens"], batch["segment_ids"], batch["positions"], hidden_layers=layer_ids, return_logits=False
    )
    features = jnp.concatenate(hidden[: len(cfg.drafter.target_layer_ids)], axis=-1)
    if cfg.needs_target_distribution:
        # The label at anchor + k is predicted from position anchor + k - 1, k = 1..K.
        index = jnp.minimum(anchor_index[:, :, None] + jnp.arange(cfg.drafter.num_scored), batch["tokens"].shape[1] - 1)
        # The last layer's hidden state is already after the final norm (`layer_outputs`).
        last = jnp.take_along_axis(hidden[-1], index.reshape(index.shape[0], -1, 1), axis=1)
        target_hidden = last.reshape(*index.shape, -1)
        blocks = blocks.replace(target_hidden=jax.lax.stop_gradient(target_hidden))
    if cfg.drafter.kind_spec.embeds_realised_tokens:
        realised = jnp.concatenate([blocks.tokens[..., :1], blocks.labels[..., :-1]], axis=-1)
        blocks = blocks.replace(realised_embeds=jax.lax.stop_gradient(target.embed(realised)))
    block_embeds = target.embed(blocks.tokens)
    return jax.lax.stop_gradient(features), jax.lax.stop_gradient(block_embeds), blocks


def row_keys(step_key: jax.Array, row_ids: jax.Array) -> jax.Array:
    """The anchor keys of the global batch rows `row_ids` [R] at the step of `step_key`."""
    return jax.vmap(lambda r: jax.random.fold_in(step_key, r))(row_ids)


def lm_head_cross_entropy(
    unembed: Callable[[jax.Array], jax.Array],
    hidden: jax.Array,
    labels: jax.Array,
    *,
    chunk_blocks: int,
    target_hidden: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """hidden [R, N, K, D], labels [R, N, K] -> (loss, label CE, hit), each [R, N, K] fp32/bool.

    The loss is the cross-entropy of the label, or, given `target_hidden` [R, N, K, D] (the
    target's normed states that predict the labels), the KL divergence from the target's
    distribution to the drafter's: the target's logits come from the same frozen LM head. The
    label CE (no gradient) is -log q(label) either way; a hit is a slot whose label holds the
    largest logit.

    Works on `chunk_blocks` blocks of every row at a time, so the logits of all blocks never
    exist at once. The LM head is frozen (it gets no gradient), so the whole backward pass of a
    chunk is d(loss)/d(hidden) = (softmax - p) · W^T, p the onehot of the label or the target's
    distribution: the forward pass computes it while the chunk's logits exist and keeps that
    [.., D] product, and the backward pass only scales it by each slot's incoming gradient. One
    LM-head matmul fewer than recomputing the logits backwards, and no [.., vocab] tensor kept
    between the passes.

    Vocab-parallel (docs/design.md §8): where the layout splits the LM head over vocab, a chunk's
    logits stay split over vocab too. The chunk's hidden states are gathered over the vocab's
    mesh axes instead of the LM head; logsumexp reduces across the vocab shards, and the label's
    logit and the onehot are one entry per slot, which XLA reads from (or adds to) the shard
    holding it and all-reduces: one value per slot.
    """

    def chunk(h, y, *target_h):  # -> (loss, label CE, hit, d loss / d h)
        with jax.named_scope("lm_head"):
            logits_of = vocab_parallel_logits(unembed, h.shape)
            logits, pullback = jax.vjp(logits_of, h)
            top = jnp.max(logits, axis=-1, keepdims=True)
            exp = jnp.exp(logits - top)
            total = jnp.sum(exp, axis=-1, keepdims=True)
            label = y[..., None]
            label_logit = jnp.take_along_axis(logits, label, axis=-1)[..., 0]
            log_total = jnp.log(total[..., 0]) + top[..., 0]
            label_ce = log_total - label_logit
            if target_h:
                target_log_p = jax.nn.log_softmax(logits_of(target_h[0]), axis=-1)
                target_p = jnp.exp(target_log_p)
                loss = jnp.sum(target_p * (target_log_p - logits), axis=-1) + log_total
                (grad_hidden,) = pullback(exp / total - target_p)
            else:
                loss = label_ce
                (grad_hidden,) = pullback(_add_at(exp / total, label, -1.0))
            # A hit: the label holds the largest logit. (Ties, which argmax would break towards
            # the lowest id, also count; an argmax, a variadic reduce, costs XLA:CPU as much as
            # the rest of the cross-entropy.)
            return loss, label_ce, label_logit >= top[..., 0], grad_hidden

    xs = (hidden, labels) if target_hidden is None else (hidden, labels, target_hidden)
    loss, label_ce, correct, grad_hidden = jax.lax.stop_gradient(map_block_chunks(chunk, xs, chunk_blocks, remat=False))
    # Value: the loss exactly (the bracket is x - x = 0). Gradient: grad_hidden for the hidden
    # states, none for the frozen LM head.
    linear = jnp.sum(hidden.astype(jnp.float32) * grad_hidden.astype(jnp.float32), axis=-1)
    return loss + (linear - jax.lax.stop_gradient(linear)), label_ce, correct


def _add_at(x: jax.Array, index: jax.Array, value: float) -> jax.Array:
    """x [..., V] with `value` added at x[..., index[..., 0]] (one entry per row)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows.at[jnp.arange(rows.shape[0]), index.reshape(-1)].add(value).reshape(x.shape)


def dpace_weights(prob: jax.Array, scored: jax.Array, alpha: float) -> jax.Array:
    """D-PACE slot weights (arXiv 2605.18810): prob, scored [..., K] -> [..., K] fp32.

    prob is the drafter's probability of the label. A slot's draft is accepted only if every
    earlier one was, so s = (1 − α)·p + α (smoothed towards 1) is multiplied along the block:
    c_k = Π_{j ≤ k} s_j estimates that slots up to k are accepted. A slot's weight is the
    expected number of accepted slots from it on, Σ_{j ≥ k} c_j. Slots that are not scored
    multiply by 1 and add nothing; their weight is 0.
    """
    smoothed = jnp.where(scored, (1 - alpha) * prob + alpha, 1.0)
    reach = jnp.where(scored, jnp.cumprod(smoothed, axis=-1), 0.0)
    return jnp.where(scored, jax.lax.cumsum(reach, axis=reach.ndim - 1, reverse=True), 0.0)


def slot_weights(label_ce: jax.Array, label_mask: jax.Array, cfg: ObjectiveConfig) -> jax.Array:
    """[..., K] weight of each slot's loss (docs/design.md §3.3), a constant to the gradient:
    exp(-j/γ) for the j-th draft of a block, or D-PACE's. 'dpace' reads the label's probability
    off its cross-entropy, already computed: no second LM-head pass."""
    if cfg.loss == "dpace":
        prob = jnp.exp(-jax.lax.stop_gradient(label_ce))
        return jax.lax.stop_gradient(dpace_weights(prob, label_mask, cfg.dpace_alpha))
    decay = jnp.exp(-jnp.arange(label_mask.shape[-1], dtype=jnp.float32) / cfg.loss_decay_gamma)
    return label_mask * decay


def loss_denominator(weights: jax.Array, blocks: Blocks, cfg: ObjectiveConfig) -> jax.Array:
    """These rows' share of what the global Σ w·CE is divided by: Σw ('dflash'), or documents
    ('dpace', so the loss scale does not depend on how documents are packed into rows)."""
    if cfg.loss == "dpace":
        return blocks.documents.sum().astype(jnp.float32)
    return weights.sum().astype(jnp.float32)


def metric_sums(
    weighted_ce: jax.Array, denominator: jax.Array, correct: jax.Array, blocks: Blocks
) -> dict[str, jax.Array]:
    """Additive statistics (sum them over micro-batches and steps, then `summarize`). "weight"
    is the loss's denominator (`loss_denominator`)."""
    hit = correct & blocks.label_mask
    leading_hits = jnp.cumprod(hit, axis=-1).sum(-1)  # accepted draft tokens per block
    return {
        "weighted_ce": weighted_ce.astype(jnp.float32),
        "weight": denominator.astype(jnp.float32),
        "slot_hits": hit.sum((0, 1)).astype(jnp.float32),
        "slot_scored": blocks.label_mask.sum((0, 1)).astype(jnp.float32),
        "tau_sum": jnp.where(blocks.valid, 1 + leading_hits, 0).sum().astype(jnp.float32),
        "blocks": blocks.valid.sum().astype(jnp.float32),
    }


def summarize(sums: dict) -> dict[str, float]:
    """Metric sums (host values) -> loss, accuracy, per-slot accuracy, tau_train."""
    slot_acc = np.asarray(sums["slot_hits"]) / np.maximum(np.asarray(sums["slot_scored"]), 1)
    out = {
        "loss": float(sums["weighted_ce"] / max(float(sums["weight"]), 1e-9)),  # Σ w·CE / denominator
        "accuracy": float(sums["slot_hits"].sum() / max(float(sums["slot_scored"].sum()), 1)),
        "tau_train": float(sums["tau_sum"] / max(float(sums["blocks"]), 1)),
    }
    out.update({f"acc_slot_{k + 1}": float(a) for k, a in enumerate(slot_acc)})
    return out
