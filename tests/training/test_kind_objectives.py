"""The drafter kinds' objectives against float64 references of their trainers' code
(tests/support/kind_references.py, tests/support/xpress_reference.py): DFlash2's unary + candidate
loss, DSpark's CE + L1 + confidence loss, XPress's teacher-forced + Jacobi rounds + backbone loss,
values and gradients, and their blocks on packed rows."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from dflash_jax.data.synthetic import packed_batch
from dflash_jax.models import kinds
from dflash_jax.models.architecture import RopeConfig, TransformerConfig
from dflash_jax.models.drafter import DFlashDrafter
from dflash_jax.models.drafter_config import DrafterConfig
from dflash_jax.models.transformer import Transformer
from dflash_jax.models.weight_maps import checkpoint_name
from dflash_jax.training import objective
from dflash_jax.training.kinds import TERMS
from dflash_jax.training.loss import drafter_loss
from support import kind_references as ref
from support import xpress_reference
from support.blocks import objective_config

VOCAB, MASK, HIDDEN = 64, 63, 32
FAST_COMPILE = {"xla_backend_optimization_level": 0}
TARGET = TransformerConfig(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    intermediate_size=48,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    rope=RopeConfig(10000.0),
)
HEAD_FIELDS = dict(
    selector_rank=8, selector_top_k=6, markov_rank=8, xpress_rank=8, xpress_mlp_hidden=16, xpress_backbone_weight=0.7
)


def head_fields(kind):
    return {f.name: HEAD_FIELDS[f.name] for f in dataclasses.fields(kinds.KINDS[kind].fields) if f.name in HEAD_FIELDS}


def _cfg(kind, **overrides):
    kw = dict(
        block_size=4,
        mask_token_id=MASK,
        num_anchors=6,
        loss="dflash",  # the position decay, which the references compute (not every kind's own)
        loss_decay_gamma=4.0,
        target_layer_ids=(0, 2),
        attention_chunk_blocks=4,
        lm_head_chunk_blocks=2,  # several chunks, the last one padded
        kind=kind,
        selector_alpha=0.7,
        **head_fields(kind),
    )
    return objective_config(TARGET, **{**kw, **overrides})


def _drafter(kind, seed=1):
    cfg = DrafterConfig.for_target(
        TARGET, num_layers=1, mask_token_id=MASK, block_size=4, target_layer_ids=(0, 2), kind=kind, **head_fields(kind)
    )
    make = lambda: DFlashDrafter(cfg, rngs=nnx.Rngs(seed))  # noqa: E731
    graphdef, _ = nnx.split(nnx.eval_shape(make))
    return nnx.merge(graphdef, jax.jit(lambda: nnx.split(make())[1], compiler_options=FAST_COMPILE)())


def _t(x):
    return torch.tensor(np.asarray(x, np.float64), requires_grad=True)


def _random_blocks(rng, slots, distill):
    """Blocks of 3 rows x 5 anchors ([R, N, K] labels): some slots unscored, some labels the
    unary top candidates' and some not."""
    shape = (3, 5, slots)
    labels = rng.integers(0, VOCAB, shape)
    anchors = rng.integers(0, VOCAB, shape[:2])
    mask = rng.random(shape) < 0.8
    target_hidden = rng.normal(size=(*shape, HIDDEN)) if distill else None
    blocks = objective.Blocks(
        tokens=jnp.asarray(np.concatenate([anchors[..., None], np.full(shape, MASK)], -1)[..., : slots + 1], jnp.int32),
        positions=None,
        labels=jnp.asarray(labels, jnp.int32),
        label_mask=jnp.asarray(mask),
        valid=None,
        ctx_mask=None,
        documents=None,
        target_hidden=None if target_hidden is None else jnp.asarray(target_hidden, jnp.float32),
    )
    return blocks, labels, anchors, mask, target_hidden


def _jax_terms(kind, drafter, hidden, head, blocks, cfg):
    """(Σ w·loss, per-slot outputs, d/d hidden, d/d the head's parameters) of the kind's terms."""
    graphdef, params = nnx.split(drafter)

    def total(hidden, params):
        d = nnx.merge(graphdef, params)
        unembed = lambda h: h @ head  # noqa: E731
        value, weights, hits = TERMS[kind](d, unembed, hidden, blocks, cfg)
        return value, (weights, hits)

    with jax.default_matmul_precision("highest"):
        run = jax.jit(jax.value_and_grad(total, argnums=(0, 1), has_aux=True), compiler_options=FAST_COMPILE)
        (value, aux), (g_hidden, g_params) = run(hidden, params)
    return value, aux, g_hidden, nnx.to_pure_dict(g_params)


@pytest.mark.parametrize("distill", [False, True], ids=["ce", "distill"])
def test_dflash2_terms_match_the_reference_values_and_gradients(distill):
    rng = np.random.default_rng(0)
    cfg, drafter = _cfg("dflash2", distill=distill), _drafter("dflash2")
    blocks, labels, anchors, mask, target_hidden = _random_blocks(rng, 3, distill)
    # Hidden states that put some labels among the top candidates, some not.
    head = rng.normal(size=(HIDDEN, VOCAB)) / np.sqrt(HIDDEN)
    hidden = (
        rng.normal(size=(*labels.shape, HIDDEN)) + 2.0 * head.T[labels] * (rng.random(labels.shape) < 0.5)[..., None]
    )
    # Slot 0 (the anchor's) drafts nothing: it takes no part in the loss.
    block_hidden = np.concatenate([rng.normal(size=(*labels.shape[:2], 1, HIDDEN)), hidden], axis=2)
    value, (weights, hits), g_block, g_params = _jax_terms(
        "dflash2", drafter, jnp.asarray(block_hidden, jnp.float32), jnp.asarray(head, jnp.float32), blocks, cfg
    )
    np.testing.assert_array_equal(g_block[:, :, 0], 0.0)
    g_hidden = g_block[:, :, 1:]

    selector = drafter.candidate_selector
    a, b = _t(selector.predecessor_codebook[...]), _t(selector.successor_codebook[...])
    p, h, w = _t(selector.hidden_projection.kernel[...]), _t(hidden), torch.tensor(head)
    expected = ref.dflash2_loss(
        h.flatten(0, 1),
        w,
        torch.tensor(labels).flatten(0, 1),
        torch.tensor(mask).flatten(0, 1),
        torch.tensor(anchors).flatten(),
        (a, b),
        p,
        top_k=6,
        alpha=0.7,
        gamma=4.0,
        target_logits=None if target_hidden is None else torch.tensor(target_hidden).flatten(0, 1) @ w,
    )
    expected.backward()
    np.testing.assert_allclose(float(value), float(expected), rtol=1e-5)
    np.testing.assert_allclose(weights, np.asarray(mask) * np.exp(-np.arange(3) / 4.0), rtol=1e-6)
    np.testing.assert_allclose(g_hidden, h.grad, rtol=1e-4, atol=1e-6)
    sel = g_params["candidate_selector"]
    np.testing.assert_allclose(sel["predecessor_codebook"], a.grad, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(sel["successor_codebook"], b.grad, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(sel["hidden_projection"]["kernel"], p.grad, rtol=1e-4, atol=1e-6)
    assert float(np.abs(b.grad).sum()) > 0 and 0 < np.asarray(hits).sum() < hits.size
    # A hit is a label among the true top candidates that the teacher-forced selector picks.
    logits = hidden @ head
    top = np.argsort(-logits, -1)[..., :6]
    assert not np.any(np.asarray(hits) & ~(top == labels[..., None]).any(-1))


def test_dspark_terms_match_the_reference_values_and_gradients():
    rng = np.random.default_rng(1)
    cfg, drafter = _cfg("dspark"), _drafter("dspark")
    blocks, labels, anchors, mask, target_hidden = _random_blocks(rng, 4, True)
    mask = np.cumprod(mask, -1).astype(bool)  # make_blocks scores a prefix of each block
    blocks = blocks.replace(label_mask=jnp.asarray(mask))
    head = rng.normal(size=(HIDDEN, VOCAB)) / np.sqrt(HIDDEN)
    hidden = rng.normal(size=(*labels.shape, HIDDEN))
    value, (weights, _), g_hidden, g_params = _jax_terms(
        "dspark", drafter, jnp.asarray(hidden, jnp.float32), jnp.asarray(head, jnp.float32), blocks, cfg
    )

    markov, confidence = drafter.markov_head, drafter.confidence_head
    w1, w2 = _t(markov.markov_w1.embedding[...]), _t(markov.markov_w2.kernel[...])
    cw, cb = _t(confidence.proj.kernel[...][:, 0]), _t(confidence.proj.bias[...][0])
    h, w = _t(hidden), torch.tensor(head)
    expected = ref.dspark_loss(
        h.flatten(0, 1),
        w,
        torch.tensor(labels).flatten(0, 1),
        torch.tensor(mask, dtype=torch.float64).flatten(0, 1),
        torch.tensor(anchors).flatten(),
        (w1, w2),
        (cw, cb),
        torch.tensor(target_hidden).flatten(0, 1) @ w,
    )
    expected.backward()
    np.testing.assert_allclose(float(value), float(expected), rtol=1e-5)
    np.testing.assert_allclose(weights, mask * np.exp(-np.arange(4) / 4.0), rtol=1e-6)
    np.testing.assert_allclose(g_hidden, h.grad, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(g_params["markov_head"]["markov_w1"]["embedding"], w1.grad, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(g_params["markov_head"]["markov_w2"]["kernel"], w2.grad, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(g_params["confidence_head"]["proj"]["kernel"][:, 0], cw.grad, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(g_params["confidence_head"]["proj"]["bias"][0], cb.grad, rtol=1e-4, atol=1e-6)


def _checkpoint_tensors(module, prefix):
    """The module's parameters as torch leaves under their export names, in torch's layout, and
    the way back to ours: name -> (tensor, its path in the module, whether it is transposed)."""
    found = {}
    for path, value in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(nnx.state(module))):
        keys = (prefix, *(str(p.key) for p in path))
        name, transposed = checkpoint_name(keys)
        array = np.asarray(value, np.float64)
        found[name] = (_t(array.T if transposed else array), keys[1:], transposed)
    return found


@pytest.mark.parametrize("loss, distill", [("dflash", False), ("dpace", True)], ids=["dflash-ce", "dpace-distill"])
def test_xpress_terms_match_the_reference_values_and_gradients(loss, distill):
    rng = np.random.default_rng(2)
    cfg, drafter = _cfg("xpress", loss=loss, distill=distill), _drafter("xpress")
    head_module = drafter.xpress_head
    head_module.mix.L[...] = jnp.asarray(0.3 * rng.normal(size=head_module.mix.L.shape), jnp.float32)  # not 0
    blocks, labels, anchors, mask, target_hidden = _random_blocks(rng, 3, distill)
    # Hidden states that make some labels the backbone's argmax, some not; the anchor's slot too.
    head = rng.normal(size=(HIDDEN, VOCAB)) / np.sqrt(HIDDEN)
    hidden = (
        rng.normal(size=(*labels.shape, HIDDEN)) + 2.0 * head.T[labels] * (rng.random(labels.shape) < 0.5)[..., None]
    )
    hidden = np.concatenate([rng.normal(size=(*labels.shape[:2], 1, HIDDEN)), hidden], axis=2)
    value, (weights, hits), g_hidden, g_params = _jax_terms(
        "xpress", drafter, jnp.asarray(hidden, jnp.float32), jnp.asarray(head, jnp.float32), blocks, cfg
    )

    tensors = _checkpoint_tensors(head_module, "xpress_head")
    h = _t(hidden)
    expected = xpress_reference.loss(
        h.flatten(0, 1),
        torch.tensor(head),
        torch.tensor(labels).flatten(0, 1),
        torch.tensor(mask).flatten(0, 1),
        torch.tensor(anchors).flatten(),
        {name: t for name, (t, _, _) in tensors.items()},
        rounds=3,
        backbone_weight=drafter.cfg.xpress_backbone_weight,
        loss_name=loss,
        gamma=4.0,
        target_logits=None if target_hidden is None else torch.tensor(target_hidden).flatten(0, 1) @ torch.tensor(head),
    )
    expected.backward()
    np.testing.assert_allclose(float(value), expected.item(), rtol=1e-5)
    if loss == "dflash":
        np.testing.assert_allclose(weights, np.asarray(mask) * np.exp(-np.arange(3) / 4.0), rtol=1e-6)
    np.testing.assert_allclose(g_hidden, h.grad, rtol=1e-4, atol=1e-6)
    assert h.grad[:, :, 0].abs().sum().item() > 0  # the anchor's state reaches the refiner (mean, mixer)
    for name, (t, path, transposed) in tensors.items():
        got = functools.reduce(lambda tree, key: tree[key], path, g_params["xpress_head"])
        want = t.grad.numpy()
        np.testing.assert_allclose(got, want.T if transposed else want, rtol=1e-4, atol=1e-6, err_msg=name)
        assert float(np.abs(want).sum()) > 0, name
    # A hit: the teacher-forced refined logits pick the label.
    logits = xpress_reference.refined_logits(
        h.flatten(0, 1).detach(),
        h.flatten(0, 1).detach() @ torch.tensor(head),
        torch.tensor(anchors).flatten(),
        torch.tensor(labels).flatten(0, 1),
        {name: t.detach() for name, (t, _, _) in tensors.items()},
    )
    np.testing.assert_array_equal(
        np.asarray(hits).reshape(-1, 3), (logits.argmax(-1) == torch.tensor(labels).flatten(0, 1)).numpy()
    )
    assert 0 < np.asarray(hits).sum() < hits.size


def _row(tokens, segment_ids, loss_mask):
    segment_ids = np.asarray([segment_ids], np.int32)
    positions = np.zeros_like(segment_ids)
    for s in set(segment_ids[0]) - {0}:
        positions[0, segment_ids[0] == s] = np.arange((segment_ids[0] == s).sum())
    return {
        "tokens": jnp.asarray([tokens], jnp.int32),
        "segment_ids": jnp.asarray(segment_ids),
        "positions": jnp.asarray(positions),
        "loss_mask": jnp.asarray([loss_mask], jnp.int32),
    }


def test_dspark_blocks_label_every_slot_with_the_token_after_it():
    # Doc 1 = positions 0..6 (response 3..4, then 6), doc 2 = 7..9.
    row = _row(
        tokens=[10, 11, 12, 13, 14, 15, 16, 20, 21, 22, 0],
        segment_ids=[1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 0],
        loss_mask=[0, 0, 0, 1, 1, 0, 1, 0, 1, 1, 0],
    )
    anchors, valid = jnp.asarray([[3, 8, 0]]), jnp.asarray([[True, True, False]])
    dflash = objective.make_blocks(row, anchors, valid, _cfg("dflash"))
    dspark = objective.make_blocks(row, anchors, valid, _cfg("dspark"))
    np.testing.assert_array_equal(dspark.tokens, dflash.tokens)  # the same [anchor, MASK x 3] blocks
    np.testing.assert_array_equal(dflash.labels[0, :2], [[14, 15, 16], [22, 0, 0]])
    np.testing.assert_array_equal(dspark.labels[0, :2], [[14, 15, 16, 20], [22, 0, 0, 0]])
    # DFlash scores every response slot of the document; DSpark the prefix before the first gap.
    np.testing.assert_array_equal(dflash.label_mask[0], [[1, 0, 1], [1, 0, 0], [0, 0, 0]])
    np.testing.assert_array_equal(dspark.label_mask[0], [[1, 0, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]])


@pytest.fixture(scope="module")
def target():
    make = lambda: Transformer(TARGET, rngs=nnx.Rngs(0))  # noqa: E731
    graphdef, _ = nnx.split(nnx.eval_shape(make))
    return nnx.merge(graphdef, jax.jit(lambda: nnx.split(make())[1], compiler_options=FAST_COMPILE)())


@pytest.mark.parametrize("kind", ["dflash2", *(pytest.param(k, marks=pytest.mark.slow) for k in ("dspark", "xpress"))])
def test_loss_of_packed_rows_is_the_references_on_the_drafters_states(target, kind):
    """drafter_loss on packed rows: the reference loss of the drafter's own hidden states, the
    blocks' labels, and (DSpark) the target's distribution at the position before each label."""
    cfg, drafter = _cfg(kind), _drafter(kind, seed=3)
    batch = {k: jnp.asarray(v) for k, v in packed_batch(np.random.default_rng(0), 2, 40, VOCAB - 1).items()}
    keys = objective.row_keys(jax.random.key(0), jnp.arange(2))

    @functools.partial(jax.jit, compiler_options=FAST_COMPILE)
    def run(target_state, drafter_state):
        t, d = nnx.merge(nnx.graphdef(target), target_state), nnx.merge(nnx.graphdef(drafter), drafter_state)
        features, embeds, blocks = objective.frozen_inputs(t, batch, keys, cfg)
        loss, sums = drafter_loss(d, t.unembed, features, embeds, batch["positions"], blocks, cfg)
        hidden = d(embeds, blocks.positions, d.context(features), batch["positions"], blocks.ctx_mask)
        anchors, _ = objective.sample_anchors(
            keys, batch["segment_ids"], batch["loss_mask"], cfg.num_anchors, "document"
        )
        target_logits, _ = t(batch["tokens"], batch["segment_ids"], batch["positions"])
        return loss, sums, blocks, hidden, anchors, target_logits

    with jax.default_matmul_precision("highest"):
        loss, sums, blocks, hidden, anchors, target_logits = run(nnx.state(target), nnx.state(drafter))
    first = drafter.cfg.first_draft_slot
    flat = lambda x: torch.tensor(np.asarray(x)).flatten(0, 1)  # noqa: E731
    h = flat(np.asarray(hidden, np.float64)[:, :, first:])
    head = torch.tensor(np.asarray(target.lm_head.kernel[...], np.float64))
    labels, mask, anchor_tokens = flat(blocks.labels), flat(blocks.label_mask), flat(blocks.tokens[..., 0])
    if kind == "dflash2":
        selector = drafter.candidate_selector
        expected = ref.dflash2_loss(
            h,
            head,
            labels,
            mask,
            anchor_tokens,
            (
                torch.tensor(np.asarray(selector.predecessor_codebook[...], np.float64)),
                torch.tensor(np.asarray(selector.successor_codebook[...], np.float64)),
            ),
            torch.tensor(np.asarray(selector.hidden_projection.kernel[...], np.float64)),
            top_k=6,
            alpha=0.7,
            gamma=4.0,
        )
    elif kind == "xpress":  # the refiner reads every slot's state, the anchor's too
        expected = xpress_reference.loss(
            flat(np.asarray(hidden, np.float64)),
            head,
            labels,
            mask,
            anchor_tokens,
            {name: t.detach() for name, (t, _, _) in _checkpoint_tensors(drafter.xpress_head, "xpress_head").items()},
            rounds=3,
            backbone_weight=drafter.cfg.xpress_backbone_weight,
            loss_name="dflash",
            gamma=4.0,
        )
    else:
        before_label = np.minimum(np.asarray(anchors)[:, :, None] + np.arange(4), batch["tokens"].shape[1] - 1)
        rows = np.arange(2)[:, None, None]
        markov, confidence = drafter.markov_head, drafter.confidence_head
        expected = ref.dspark_loss(
            h,
            head,
            labels,
            mask.double(),
            anchor_tokens,
            (
                torch.tensor(np.asarray(markov.markov_w1.embedding[...], np.float64)),
                torch.tensor(np.asarray(markov.markov_w2.kernel[...], np.float64)),
            ),
            (
                torch.tensor(np.asarray(confidence.proj.kernel[...][:, 0], np.float64)),
                torch.tensor(float(confidence.proj.bias[...][0])),
            ),
            flat(np.asarray(target_logits, np.float64)[rows, before_label]),
        )
    assert float(sums["weight"]) > 0
    np.testing.assert_allclose(float(loss), float(expected), rtol=1e-4)
    np.testing.assert_allclose(float(sums["weight"]), float(ref.decay_weights(mask.double(), 4.0).sum()), rtol=1e-6)
    assert len(sums["slot_hits"]) == drafter.cfg.num_drafts
