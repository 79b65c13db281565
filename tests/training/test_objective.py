"""The DFlash objective: anchors, blocks, the strict context mask, chunked CE, the 'dflash' and
'dpace' losses, and tau."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dflash_jax.data.synthetic import packed_batch
from dflash_jax.models.architecture import RopeConfig, TransformerConfig
from dflash_jax.models.drafter import DFlashDrafter
from dflash_jax.models.drafter_config import DrafterConfig
from dflash_jax.models.transformer import Transformer
from dflash_jax.training import objective
from dflash_jax.training.loss import drafter_loss
from support.blocks import objective_config

VOCAB, MASK = 64, 63
# These tests check values, not speed: compile without LLVM optimization (twice as fast).
FAST_COMPILE = {"xla_backend_optimization_level": 0}
TARGET = TransformerConfig(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    rope=RopeConfig(10000.0),
)


def _cfg(**overrides):
    kw = dict(
        block_size=4,
        mask_token_id=MASK,
        num_anchors=6,
        loss="dflash",  # the paper's position decay, which most references below compute
        loss_decay_gamma=4.0,
        target_layer_ids=(0, 2),
        attention_chunk_blocks=4,
        lm_head_chunk_blocks=4,
    )
    return objective_config(TARGET, **{**kw, **overrides})


def _row(tokens, segment_ids, loss_mask):
    segment_ids = np.asarray([segment_ids], np.int32)
    positions = np.zeros_like(segment_ids)
    for s in set(segment_ids[0]) - {0}:
        where = segment_ids[0] == s
        positions[0, where] = np.arange(where.sum())
    return {
        "tokens": jnp.asarray([tokens], jnp.int32),
        "segment_ids": jnp.asarray(segment_ids),
        "positions": jnp.asarray(positions),
        "loss_mask": jnp.asarray([loss_mask], jnp.int32),
    }


# Two documents and padding: doc 1 = positions 0..5 (response from 3), doc 2 = 6..9 (response from 8).
ROW = _row(
    tokens=[10, 11, 12, 13, 14, 15, 20, 21, 22, 23, 0, 0],
    segment_ids=[1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 0, 0],
    loss_mask=[0, 0, 0, 1, 1, 1, 0, 0, 1, 1, 0, 0],
)
# Anchors whose next token is a response token of the same document ('row', the original scheme).
CANDIDATES = {2, 3, 4, 7, 8}
# ... that are response tokens themselves, as at inference ('response' and 'document').
RESPONSE_CANDIDATES = {3, 4, 8}


def _sample(seed, num_anchors, scheme, row=ROW, anchors_per_document=0):
    keys = objective.row_keys(jax.random.key(seed), jnp.arange(row["tokens"].shape[0]))
    index, valid = objective.sample_anchors(
        keys, row["segment_ids"], row["loss_mask"], num_anchors, scheme, anchors_per_document
    )
    return np.asarray(index[0])[np.asarray(valid[0])]


@pytest.mark.parametrize("scheme, candidates", [("row", CANDIDATES), ("response", RESPONSE_CANDIDATES)])
def test_anchors_are_distinct_candidates_and_uniform(scheme, candidates):
    counts = np.zeros(12)
    for seed in range(600):
        chosen = _sample(seed, 2, scheme)
        assert len(chosen) == 2 and len(set(chosen)) == 2
        assert set(chosen) <= candidates
        counts[chosen] += 1
    # Uniform: each candidate is picked with probability 2 / len(candidates).
    np.testing.assert_allclose(counts[sorted(candidates)] / 600, 2 / len(candidates), atol=0.08)


@pytest.mark.parametrize(
    "scheme, candidates", [("row", CANDIDATES), ("response", RESPONSE_CANDIDATES), ("document", RESPONSE_CANDIDATES)]
)
def test_rows_with_few_candidates_get_invalid_anchors(scheme, candidates):
    assert set(_sample(0, 8, scheme)) == candidates


# A long document (positions 0..29, response from 2) and a short one (30..35, response from 32).
TWO_DOCS = _row(
    tokens=list(range(36)),
    segment_ids=[1] * 30 + [2] * 6,
    loss_mask=[0, 0] + [1] * 28 + [0, 0] + [1] * 4,
)
SHORT_DOC_CANDIDATES = {32, 33, 34}


@pytest.mark.slow
def test_document_scheme_gives_every_document_its_share_uniformly():
    counts = np.zeros(36)
    short_doc_share = {"row": 0, "document": 0}
    for seed in range(400):
        for scheme in short_doc_share:
            chosen = _sample(seed, 4, scheme, TWO_DOCS)
            assert len(chosen) == 4 and len(set(chosen)) == 4
            short_doc_share[scheme] += len(set(chosen) & SHORT_DOC_CANDIDATES)
            if scheme == "document":
                # Two rounds over two documents: exactly 2 anchors each.
                assert len(set(chosen) & SHORT_DOC_CANDIDATES) == 2
                counts[chosen] += 1
    # Uniform inside each document: 2 of the short document's 3, 2 of the long one's 27.
    np.testing.assert_allclose(counts[sorted(SHORT_DOC_CANDIDATES)] / 400, 2 / 3, atol=0.08)
    np.testing.assert_allclose(counts[2:29] / 400, 2 / 27, atol=0.05)
    # Uniform over the row, the short document gets ~4 * 3/30 anchors per row, not 2.
    assert short_doc_share["row"] / 400 < 0.6


def test_document_cap_limits_a_documents_share():
    chosen = _sample(0, 10, "document", TWO_DOCS, anchors_per_document=3)
    assert len(chosen) == 6  # 3 per document, the other 4 slots invalid
    assert len(set(chosen) & SHORT_DOC_CANDIDATES) == 3


def test_a_rows_anchors_do_not_depend_on_the_rest_of_the_batch():
    row = {k: jnp.pad(v, ((0, 0), (0, 24))) for k, v in ROW.items()}  # padded to TWO_DOCS' length
    batch = {k: jnp.concatenate([TWO_DOCS[k], row[k], TWO_DOCS[k]], 0) for k in ROW}
    step_key = jax.random.key(7)
    index, valid = objective.sample_anchors(
        objective.row_keys(step_key, jnp.arange(3)), batch["segment_ids"], batch["loss_mask"], 4, "document"
    )
    alone, alone_valid = objective.sample_anchors(
        objective.row_keys(step_key, jnp.asarray([1])), row["segment_ids"], row["loss_mask"], 4, "document"
    )
    np.testing.assert_array_equal(index[1], alone[0])
    np.testing.assert_array_equal(valid[1], alone_valid[0])
    assert not np.array_equal(index[0], index[2])  # same row content, another row: other anchors


def test_blocks_inputs_labels_and_strict_context():
    anchors = jnp.asarray([[3, 8, 0]], jnp.int32)
    valid = jnp.asarray([[True, True, False]])
    blocks = objective.make_blocks(ROW, anchors, valid, _cfg())
    np.testing.assert_array_equal(
        blocks.tokens[0], [[13, MASK, MASK, MASK], [22, MASK, MASK, MASK], [10, MASK, MASK, MASK]]
    )
    np.testing.assert_array_equal(blocks.positions[0, :2], [[3, 4, 5, 6], [2, 3, 4, 5]])
    np.testing.assert_array_equal(blocks.labels[0, 0], [14, 15, 20])
    # Anchor 3: slots 1, 2 in the document; slot 3 crosses into doc 2. Anchor 8: slot 1 only,
    # then padding. The invalid anchor scores nothing.
    np.testing.assert_array_equal(blocks.label_mask[0], [[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    np.testing.assert_array_equal(blocks.documents, [2])
    # Strictly before the anchor, same document only.
    expected = np.zeros((3, 12), bool)
    expected[0, 0:3] = True
    expected[1, 6:8] = True
    np.testing.assert_array_equal(blocks.ctx_mask[0], expected)


@pytest.mark.parametrize("distill", [False, True])
def test_chunked_cross_entropy_matches_dense_values_and_gradients(distill):
    rng = np.random.default_rng(0)
    hidden = jnp.asarray(rng.normal(size=(2, 7, 3, 16)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, 50, (2, 7, 3)), jnp.int32)
    head = jnp.asarray(rng.normal(size=(16, 50)), jnp.float32)
    target_hidden = jnp.asarray(rng.normal(size=hidden.shape), jnp.float32) if distill else None

    def dense(h, head):
        log_q = jax.nn.log_softmax(h @ head, -1)
        label_ce = -jnp.take_along_axis(log_q, labels[..., None], -1)[..., 0]
        loss = label_ce
        if distill:  # KL(p_target || q), the target's logits from the same head
            log_p = jax.nn.log_softmax(target_hidden @ head, -1)
            loss = (jnp.exp(log_p) * (log_p - log_q)).sum(-1)
        return loss, label_ce, log_q.argmax(-1) == labels

    def chunked(h, head):  # the head a traced value, as the frozen target's weights in the step
        return objective.lm_head_cross_entropy(
            lambda x: x @ head, h, labels, chunk_blocks=3, target_hidden=target_hidden
        )

    w = jnp.asarray(rng.random((2, 7, 3)), jnp.float32)

    @functools.partial(jax.jit, static_argnums=0, compiler_options=FAST_COMPILE)
    def values_and_grads(fn, h, head):
        return fn(h, head), jax.grad(lambda h: (fn(h, head)[0] * w).sum())(h)

    (loss_dense, ce_dense, hit_dense), g_dense = values_and_grads(dense, hidden, head)
    (loss, ce, hit), g = values_and_grads(chunked, hidden, head)
    np.testing.assert_allclose(loss, loss_dense, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ce, ce_dense, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(hit, hit_dense)
    np.testing.assert_allclose(g, g_dense, rtol=1e-5, atol=1e-5)
    if distill:  # the KL is not the label's CE: the target's distribution is what is scored
        assert np.abs(np.asarray(loss) - np.asarray(ce)).min() > 1e-3
    # The gradient flows to the hidden states only: the LM head is the frozen target's.
    g_head = jax.jit(jax.grad(lambda head: (chunked(hidden, head)[0] * w).sum()))(head)
    np.testing.assert_array_equal(g_head, np.zeros_like(head))


def test_documents_are_counted_per_row():
    segment_ids = jnp.asarray([[1, 1, 2, 2, 3, 0], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0], [1, 2, 3, 4, 5, 6]])
    np.testing.assert_array_equal(objective.count_documents(segment_ids), [3, 1, 0, 6])


def _reference_dpace_weights(prob, scored, alpha):
    """D-PACE's definition, slot by slot: w_k = Σ_{j ≥ k, scored} Π_{i ≤ j, scored} s_i."""
    weights = np.zeros_like(prob)
    for block in np.ndindex(prob.shape[:-1]):
        p, m = prob[block], scored[block]
        for k in np.flatnonzero(m):
            for j in range(k, len(p)):
                if m[j]:
                    weights[block + (k,)] += np.prod([(1 - alpha) * p[i] + alpha for i in range(j + 1) if m[i]])
    return weights


@pytest.mark.parametrize("alpha", [0.0, 0.5, 0.8, 1.0])
def test_dpace_weights_follow_the_definition(alpha):
    rng = np.random.default_rng(7)
    prob = rng.random((3, 5, 7)).astype(np.float32)
    scored = rng.random((3, 5, 7)) < 0.7  # gaps inside blocks, and some blocks scored nowhere
    scored[0, 0] = False
    weights = objective.dpace_weights(jnp.asarray(prob), jnp.asarray(scored), alpha)
    np.testing.assert_allclose(weights, _reference_dpace_weights(prob, scored, alpha), rtol=1e-5, atol=1e-7)
    if alpha == 1.0:  # every slot certain: weight = scored slots from k on
        np.testing.assert_array_equal(weights, np.where(scored, np.cumsum(scored[..., ::-1], -1)[..., ::-1], 0))


def _keys(batch, seed):
    return objective.row_keys(jax.random.key(seed), jnp.arange(batch["tokens"].shape[0]))


def _build(make):
    """Initializes a module in one compiled program (eager init runs op by op, slowly)."""
    graphdef, _ = nnx.split(nnx.eval_shape(make))
    return nnx.merge(graphdef, jax.jit(lambda: nnx.split(make())[1], compiler_options=FAST_COMPILE)())


def _drafter_config(num_layers):
    return DrafterConfig.for_target(
        TARGET, num_layers=num_layers, mask_token_id=MASK, block_size=4, target_layer_ids=(0, 2)
    )


@pytest.fixture(scope="module")
def models():
    target = _build(lambda: Transformer(TARGET, rngs=nnx.Rngs(0)))
    return target, _build(lambda: DFlashDrafter(_drafter_config(1), rngs=nnx.Rngs(1)))


def _fast_jit(fn):
    """Compiles `fn(*args)` where some args are NNX modules (split outside, merged inside)."""

    def call(*args):
        parts = [nnx.split(a) if isinstance(a, nnx.Module) else (None, a) for a in args]

        def inner(states):
            return fn(*(s if g is None else nnx.merge(g, s) for (g, _), s in zip(parts, states)))

        return jax.jit(inner, compiler_options=FAST_COMPILE)([s for _, s in parts])

    return call


def _batch(seed=0, rows=2, seq_len=40):
    return {k: jnp.asarray(v) for k, v in packed_batch(np.random.default_rng(seed), rows, seq_len, VOCAB - 1).items()}


def _log_softmax(logits):
    top = logits.max(-1, keepdims=True)
    return logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))


def _reference_weights(ce, label_mask, cfg):
    """The slot weights of docs/design.md §3.3, from float64 cross-entropies."""
    if cfg.loss == "dpace":
        return _reference_dpace_weights(np.exp(-ce), label_mask, cfg.dpace_alpha)
    return label_mask * np.exp(-np.arange(ce.shape[-1]) / cfg.loss_decay_gamma)


@pytest.mark.parametrize(
    "cfg",
    [
        _cfg(),
        pytest.param(_cfg(loss="dpace", dpace_alpha=0.3), marks=pytest.mark.slow),
        _cfg(loss="dpace", distill=True),
    ],
    ids=["dflash", "dpace", "dpace-distill"],
)
def test_loss_is_weighted_sum_of_slot_cross_entropies(models, cfg):
    target, drafter = models
    batch = _batch()

    @_fast_jit
    def run(target, drafter, batch):
        keys = _keys(batch, 0)
        features, embeds, blocks = objective.frozen_inputs(target, batch, keys, cfg)
        loss, sums = drafter_loss(drafter, target.unembed, features, embeds, batch["positions"], blocks, cfg)
        hidden = drafter(
            embeds,
            blocks.positions,
            drafter.context(features),
            batch["positions"],
            blocks.ctx_mask,
            blocks_per_chunk=cfg.num_anchors,
        )
        anchors, _ = objective.sample_anchors(
            keys, batch["segment_ids"], batch["loss_mask"], cfg.num_anchors, cfg.anchor_scheme
        )
        target_logits, _ = target(batch["tokens"], batch["segment_ids"], batch["positions"])
        return loss, sums, blocks, target.unembed(hidden[:, :, 1:]), target_logits, anchors

    with jax.default_matmul_precision("highest"):
        loss, sums, blocks, logits, target_logits, anchors = run(target, drafter, batch)
    log_q = _log_softmax(np.asarray(logits, np.float64))
    labels, label_mask = np.asarray(blocks.labels), np.asarray(blocks.label_mask)
    ce = -np.take_along_axis(log_q, labels[..., None], -1)[..., 0]
    slot_loss = ce
    if cfg.distill:  # KL from the target's distribution at the position before each label
        before_label = np.asarray(anchors)[:, :, None] + np.arange(labels.shape[-1])
        before_label = np.minimum(before_label, batch["tokens"].shape[1] - 1)
        rows = np.arange(labels.shape[0])[:, None, None]
        log_p = _log_softmax(np.asarray(target_logits, np.float64)[rows, before_label])
        slot_loss = (np.exp(log_p) * (log_p - log_q)).sum(-1)
    w = _reference_weights(ce, label_mask, cfg)
    assert w.sum() > 0
    # drafter_loss returns Σ w·loss; the step divides by the global sum of sums["weight"]: Σw
    # for 'dflash', the documents for 'dpace' (the batch's rows hold several each).
    np.testing.assert_allclose(float(loss), (w * slot_loss).sum(), rtol=1e-4)
    if cfg.distill:
        assert abs((w * ce).sum() - float(loss)) > 1e-2 * float(loss)
    documents = sum(len(set(row) - {0}) for row in np.asarray(batch["segment_ids"]))
    assert documents > batch["tokens"].shape[0]
    np.testing.assert_allclose(float(sums["weight"]), w.sum() if cfg.loss == "dflash" else documents, rtol=1e-6)
    hits = (log_q.argmax(-1) == labels) & np.asarray(blocks.label_mask)
    np.testing.assert_array_equal(sums["slot_hits"], hits.sum((0, 1)))
    np.testing.assert_array_equal(sums["slot_scored"], np.asarray(blocks.label_mask).sum((0, 1)))


def test_dpace_weights_are_constants_to_the_gradient(models):
    """The gradient of D-PACE's Σ w·CE is Σ w·dCE: w depends on the drafter, but only as a weight."""
    target, drafter = models
    cfg = _cfg(loss="dpace")
    batch = _batch(seed=3)

    @_fast_jit
    def gradients(target, drafter, batch):
        features, embeds, blocks = objective.frozen_inputs(target, batch, _keys(batch, 0), cfg)
        graphdef, params = nnx.split(drafter)

        def dense_ce(params):
            d = nnx.merge(graphdef, params)
            hidden = d(embeds, blocks.positions, d.context(features), batch["positions"], blocks.ctx_mask)
            logits = target.unembed(hidden[:, :, 1:]).astype(jnp.float32)
            return jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, blocks.labels[..., None], -1)[..., 0]

        def loss(params):
            d = nnx.merge(graphdef, params)
            return drafter_loss(d, target.unembed, features, embeds, batch["positions"], blocks, cfg)[0]

        constant = objective.dpace_weights(jnp.exp(-dense_ce(params)), blocks.label_mask, cfg.dpace_alpha)
        return jax.grad(loss)(params), jax.grad(lambda p: (constant * dense_ce(p)).sum())(params)

    with jax.default_matmul_precision("highest"):
        grads, expected = (jax.tree.leaves(g) for g in gradients(target, drafter, batch))
    for a, b in zip(grads, expected):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_drafter_never_sees_the_anchor_or_later_context(models):
    """d(block j output)/d(features at p) is zero unless p < anchor_j in the anchor's document."""
    target, drafter = models
    cfg = _cfg(num_anchors=4)
    batch = _batch(seed=1, rows=1, seq_len=24)

    @_fast_jit
    def influence(target, drafter, batch):
        features, embeds, blocks = objective.frozen_inputs(target, batch, _keys(batch, 3), cfg)

        def per_block(f):
            ctx = drafter.context(f)
            hidden = drafter(embeds, blocks.positions, ctx, batch["positions"], blocks.ctx_mask, blocks_per_chunk=2)
            return hidden[0].sum((1, 2))

        jacobian = jax.jacrev(per_block)(features)  # [N, 1, S, k*H]
        return jnp.abs(jacobian[:, 0]).sum(-1) > 0, blocks

    seen, blocks = influence(target, drafter, batch)
    anchors, valid = objective.sample_anchors(
        _keys(batch, 3), batch["segment_ids"], batch["loss_mask"], 4, cfg.anchor_scheme
    )
    anchors, valid, segment = np.asarray(anchors[0]), np.asarray(valid[0]), np.asarray(batch["segment_ids"][0])
    assert valid.sum() >= 2
    for j in np.flatnonzero(valid):
        expected = (np.arange(24) < anchors[j]) & (segment == segment[anchors[j]])
        assert expected.any()
        np.testing.assert_array_equal(np.asarray(seen[j]), expected, err_msg=f"block {j}")


def test_tau_train_counts_leading_hits_of_valid_blocks():
    label_mask = jnp.asarray([[[1, 1, 1], [1, 1, 1], [1, 0, 1], [1, 1, 1]]], bool)
    blocks = objective.Blocks(
        tokens=None,
        positions=None,
        labels=None,
        label_mask=label_mask,
        valid=jnp.asarray([[True, True, True, False]]),
        ctx_mask=None,
        documents=None,
    )
    correct = jnp.asarray([[[1, 1, 0], [0, 1, 1], [1, 1, 1], [1, 1, 1]]], bool)
    sums = objective.metric_sums(jnp.float32(2.0), jnp.float32(5.5), correct, blocks)
    # Leading hits: 2, 0, 1 (a slot that is not scored ends the run); the invalid block is ignored.
    assert float(sums["tau_sum"]) == (1 + 2) + (1 + 0) + (1 + 1)
    summary = objective.summarize(jax.device_get(sums))
    assert summary["tau_train"] == pytest.approx(6 / 3)
    assert summary["acc_slot_1"] == pytest.approx(3 / 4)
    assert summary["loss"] == pytest.approx(2.0 / 5.5)  # Σw·CE / denominator


@pytest.mark.slow
def test_rematerialized_layers_give_the_same_gradients(models):
    target, drafter = models
    batch = _batch(seed=2)

    def grads(remat):
        obj = _cfg(remat=remat)

        def run(target, drafter, batch):
            features, embeds, blocks = objective.frozen_inputs(target, batch, _keys(batch, 0), obj)
            graphdef, params = nnx.split(drafter)

            def loss(p):
                return drafter_loss(
                    nnx.merge(graphdef, p), target.unembed, features, embeds, batch["positions"], blocks, obj
                )[0]

            return jax.grad(loss)(params)

        remat_calls = str(jax.make_jaxpr(run)(target, drafter, batch)).count("remat2[")
        return remat_calls, jax.tree.leaves(_fast_jit(run)(target, drafter, batch))

    remat_calls, with_remat = grads(True)
    plain_calls, without = grads(False)
    assert remat_calls > plain_calls  # a rematerialized layer on top of attention's chunks
    for a, b in zip(with_remat, without):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
