"""Our Domino export in SpecForge's own torch module (`specforge` 0.2.0's `DominoDraftModel` and
`OnlineDominoModel`; `.ci/run` installs it, as the README's test section does; without it these
tests skip): its config.json builds SpecForge's drafter and the weights load with no key missing
or left over; then, in float64 on the same weights, SpecForge's loss terms, its λ curriculum and
its greedy draft walk equal ours."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors.torch import load_file

from dflash_jax.decoding.draft_vocab import FullVocabulary
from dflash_jax.decoding.kinds import WALKS
from dflash_jax.decoding.sampling import SamplingConfig
from dflash_jax.models.drafter import DFlashDrafter
from dflash_jax.models.formats.hf import export_drafter, load_drafter
from dflash_jax.models.transformer import Transformer
from dflash_jax.training import objective
from dflash_jax.training.kinds.domino import base_loss_weight
from dflash_jax.training.kinds.domino import terms as domino_terms
from support.blocks import scored_blocks
from support.decoding_models import MASK_ID, make_drafter, perturbed, target_config

# Not in the `test` extra: specforge==0.2.0 pins torch, transformers and sglang exactly.
specforge_domino = pytest.importorskip(
    "specforge.modeling.draft.domino", reason='SpecForge is not installed: pip install --no-deps "specforge==0.2.0"'
)
from specforge.algorithms.common.dflash_family_model import OnlineDominoModel  # noqa: E402
from specforge.training.strategies.base import linear_lambda_base  # noqa: E402

BLOCK, GAMMA = 5, 4.0


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(our float64 target and Domino drafter, SpecForge's DominoDraftModel on the same weights
    in float64, its `OnlineDominoModel` over our target's head and embeddings)."""
    with jax.enable_x64(True):
        f64 = dict(param_dtype=jnp.float64, compute_dtype=jnp.float64)
        target = Transformer(target_config(), rngs=nnx.Rngs(1), **f64)
        drafter = perturbed(
            make_drafter(target, block_size=BLOCK, kind="domino", gru_hidden_dim=8, emb_dim=6), scale=0.3
        )
        # The correction as large as the unary logits, and the GRU state a large part of it, so
        # that the realised tokens decide drafts.
        for w in (drafter.embed_proj[2].kernel, drafter.prefix_gru.weight_ih_l0, drafter.prefix_gru.weight_hh_l0):
            w[...] = w[...] * 10
        out = export_drafter(drafter, tmp_path_factory.mktemp("domino") / "export", dtype=jnp.float32)
        ours = DFlashDrafter(drafter.cfg, rngs=nnx.Rngs(0), **f64)
        loaded = nnx.state(load_drafter(out))
        nnx.update(ours, jax.tree.map(lambda x: x.astype(jnp.float64), loaded))

    config = json.loads((out / "config.json").read_text())
    theirs = specforge_domino.DominoDraftModel(transformers.Qwen3Config(**config))
    missing, unexpected = theirs.load_state_dict(load_file(out / "model.safetensors"), strict=False)
    assert (missing, unexpected) == ([], [])
    theirs = theirs.double().eval()
    lm_head = torch.nn.Linear(target.cfg.hidden_size, target.cfg.vocab_size, bias=False).double()
    lm_head.weight.data = torch.from_numpy(np.asarray(target.lm_head.kernel[...]).T.copy())
    embed = torch.nn.Embedding.from_pretrained(torch.from_numpy(np.asarray(target.embed_tokens.embedding[...])))
    online = OnlineDominoModel(
        draft_model=theirs,
        target_lm_head=lm_head,
        target_embed_tokens=embed,
        mask_token_id=MASK_ID,
        block_size=BLOCK,
        attention_backend="sdpa",
        loss_decay_gamma=GAMMA,
        shift_label=True,
    )
    return target, ours, theirs, online


@pytest.mark.parametrize("step, lam", [(0, 1.0), (3, 0.4), (9, 0.0)])
def test_loss_terms_equal_specforges_in_float64(models, step, lam):
    target, drafter, _, online = models
    rng = np.random.default_rng(step)
    rows, blocks_per_row = 2, 3
    anchors = rng.integers(0, MASK_ID, (rows, blocks_per_row, 1))
    labels = rng.integers(0, MASK_ID, (rows, blocks_per_row, BLOCK))
    realised = np.concatenate([anchors, labels[..., :-1]], axis=-1)  # SpecForge's prev_ids
    mask = rng.random((rows, blocks_per_row, BLOCK)) > 0.2
    hidden = rng.normal(size=(rows, blocks_per_row, BLOCK, target.cfg.hidden_size))
    with jax.enable_x64(True):
        cfg = objective.ObjectiveConfig(
            loss="dflash",
            dpace_alpha=0.5,  # unread: the position decay weighs the slots
            loss_decay_gamma=GAMMA,
            base_loss_weight=1.0,
            base_loss_decay=0.5,
            total_steps=10,
            drafter=drafter.cfg,
        )
        # λ is an fp32 scalar: SpecForge's curriculum to fp32's precision, then the same λ on both sides.
        ours_lam = float(base_loss_weight(cfg, step))
        assert ours_lam == pytest.approx(linear_lambda_base(step, 10, 1.0, 0.5), rel=1e-7)
        assert ours_lam == pytest.approx(lam, rel=1e-7)
        blocks = scored_blocks(labels, mask, realised_embeds=target.embed(jnp.asarray(realised)))
        ours, weights, hits = domino_terms(drafter, target.unembed, jnp.asarray(hidden), blocks, cfg, step)
        assert ours.dtype == jnp.float64

    # The slot weights are fp32 constants in training; SpecForge's weighting, to fp32's precision,
    # then the same weights on both sides, so that the rest is compared in float64.
    np.testing.assert_allclose(weights, mask * np.exp(-np.arange(BLOCK) / GAMMA), rtol=1e-7)
    weight_mask = torch.from_numpy(np.asarray(weights, np.float64))
    with torch.no_grad():
        final, base, den, correct, *_ = online._domino_objective_chunk_terms(
            torch.from_numpy(hidden),
            torch.from_numpy(realised),
            torch.from_numpy(labels),
            weight_mask,
            torch.from_numpy(mask.astype(np.float64)),
        )
    np.testing.assert_allclose(float(ours), float((1 - ours_lam) * final + ours_lam * base), rtol=1e-12)
    assert int(np.sum(np.asarray(hits) & mask)) == int(correct)


def test_greedy_walk_equals_specforges_in_float64(models):
    """SpecForge drafts slot k's token from the tokens realised up to slot k (the anchor, then its
    own drafts), as our walk does; the last slot's draft is ours alone (its loop stops at Bk - 1)."""
    target, drafter, theirs, online = models
    rng = np.random.default_rng(7)
    hidden = rng.normal(size=(4, BLOCK, target.cfg.hidden_size))
    anchor = rng.integers(0, MASK_ID, 4)
    with jax.enable_x64(True):
        drafts, _, _ = WALKS["domino"](
            FullVocabulary(target),
            drafter,
            jnp.asarray(hidden),
            jnp.asarray(anchor, jnp.int32),
            SamplingConfig(),
            jax.random.key(0),
            0.0,
            target.embed,
        )
    block = np.concatenate([anchor[:, None], np.full((4, BLOCK - 1), MASK_ID)], axis=1)
    reference_target = torch.nn.Module()
    reference_target.lm_head, reference_target.model = online.lm_head, torch.nn.Module()
    reference_target.model.embed_tokens = online.embed_tokens
    with torch.no_grad():
        expected = theirs._sample_draft_tokens(reference_target, torch.from_numpy(hidden), torch.from_numpy(block))
    np.testing.assert_array_equal(np.asarray(drafts)[:, : BLOCK - 1], expected.numpy())
    # The correction decides drafts: the unary argmax alone differs from them somewhere.
    assert (np.argmax(np.asarray(target.unembed(jnp.asarray(hidden))), -1)[:, 1:-1] != expected.numpy()[:, 1:]).any()
