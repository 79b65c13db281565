"""Domino (models/kinds/domino.py) against a numpy re-statement of docs/design.md §8: its heads'
logits in float64, the shift (slot k's correction reads the GRU state after the tokens up to
slot k, the anchor first), the greedy walk as the argmax chain, the SpecForge export read back,
and lossless greedy decoding."""

from __future__ import annotations

import json
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from dflash_jax.decoding.draft_vocab import FullVocabulary
from dflash_jax.decoding.generate import TargetDecoder
from dflash_jax.decoding.kinds import WALKS
from dflash_jax.decoding.sampling import SamplingConfig
from dflash_jax.decoding.speculative import SpeculativeDecoder
from dflash_jax.errors import ModelError
from dflash_jax.models.drafter_config import DrafterConfig
from dflash_jax.models.formats.hf import export_drafter, load_drafter
from dflash_jax.models.kinds import domino
from dflash_jax.training import objective
from dflash_jax.training.kinds.domino import terms as domino_terms
from support import decoding_models
from support.blocks import scored_blocks
from support.decoding_models import MASK_ID, make_target, random_prompts

H, G, E, V, L = 12, 6, 5, 20, 5


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


def gru_states(x, w_ih, w_hh):
    """torch.nn.GRU(bias=False), gates r, z, n: x [L, H] -> the state after each input [L, G]."""
    g = np.zeros(w_hh.shape[1])
    out = []
    for x_t in x:
        ir, iz, i_n = np.split(w_ih @ x_t, 3)
        hr, hz, hn = np.split(w_hh @ g, 3)
        r, z = sigmoid(ir + hr), sigmoid(iz + hz)
        g = (1 - z) * np.tanh(i_n + r * hn) + z * g
        out.append(g)
    return np.stack(out)


def reference_logits(unary, hidden, realised, params, first, shift=0):
    """§8: slot k ≥ first adds W2·silu(W1·[h_k; g_k]), g_k the GRU state after realised[:k+1];
    `shift` reads g_{k+shift} instead (an off-by-one)."""
    w_ih, w_hh, w1, w2 = params
    states = gru_states(realised, w_ih, w_hh)
    out = unary.copy()
    for k in range(first, len(unary)):
        j = min(max(k + shift, 0), len(unary) - 1)
        x = np.concatenate([hidden[k], states[j]]) @ w1
        out[k] += (x / (1 + np.exp(-x))) @ w2
    return out


def heads_f64(seed=0):
    cfg = types.SimpleNamespace(hidden_size=H, gru_hidden_dim=G, emb_dim=E, vocab_size=V)
    return domino.KIND.heads(cfg, compute_dtype=jnp.float64, init_std=0.4, param_dtype=jnp.float64, rngs=nnx.Rngs(seed))


def numpy_params(heads):
    gru, proj = heads["prefix_gru"], heads["embed_proj"]
    return [np.asarray(a) for a in (gru.weight_ih_l0[...], gru.weight_hh_l0[...], *domino.kernels(proj))]


@pytest.mark.parametrize("first", [0, 1, 2])
def test_head_logits_match_the_reference_in_float64_and_an_off_by_one_does_not(first):
    with jax.enable_x64(True):
        heads = heads_f64()
        rng = np.random.default_rng(first)
        unary, hidden, realised = rng.normal(size=(L, V)), rng.normal(size=(L, H)), rng.normal(size=(L, H))
        states = heads["prefix_gru"](jnp.asarray(realised))
        w = domino.kernels(heads["embed_proj"])
        ours = domino.corrected(
            first, jnp.arange(L), jnp.asarray(unary), domino.correction(w, jnp.asarray(hidden), states)
        )
        assert ours.dtype == jnp.float64
        params = numpy_params(heads)
        np.testing.assert_allclose(
            ours, reference_logits(unary, hidden, realised, params, first), rtol=1e-12, atol=1e-12
        )
        for shift in (-1, 1):
            shifted = reference_logits(unary, hidden, realised, params, first, shift)
            assert np.abs(np.asarray(ours) - shifted)[first + (shift < 0) :].min(axis=-1).max() > 1e-3
        # The first slots keep the unary logits exactly.
        np.testing.assert_array_equal(ours[:first], unary[:first])


@pytest.fixture(scope="module")
def target():
    return make_target(seed=1)


def make_drafter(target, block_size=4):
    """Off its initial values, with a correction large enough to change drafts."""
    drafter = decoding_models.make_drafter(
        target, seed=2, block_size=block_size, kind="domino", gru_hidden_dim=8, emb_dim=8
    )
    return decoding_models.perturbed(drafter, scale=0.3)


def test_greedy_walk_is_the_argmax_chain(target):
    drafter = make_drafter(target)
    rng = np.random.default_rng(0)
    hidden = jnp.asarray(rng.normal(size=(3, 4, target.cfg.hidden_size)), jnp.float32)
    anchor = jnp.asarray([5, 9, 11], jnp.int32)
    drafts, logits, proposed = WALKS["domino"](
        FullVocabulary(target), drafter, hidden, anchor, SamplingConfig(), jax.random.key(0), 0.0, target.embed
    )
    # A block of 4 proposes 3 drafts, as SpecForge decodes it: the last slot is trained, not proposed.
    assert drafter.cfg.num_drafts == 3 and drafts.shape == (3, 3)
    np.testing.assert_array_equal(proposed, [3, 3, 3])
    params = numpy_params({"prefix_gru": drafter.prefix_gru, "embed_proj": drafter.embed_proj})
    unary = np.asarray(target.unembed(hidden), np.float64)
    for b in range(3):
        realised = [int(anchor[b])]
        for k in range(3):  # the chain: each argmax is the next GRU input
            embeds = np.asarray(target.embed(jnp.asarray(realised)), np.float64)
            expected = reference_logits(unary[b, : k + 1], np.asarray(hidden[b, : k + 1]), embeds, params, 1)[k]
            np.testing.assert_allclose(logits[b, k], expected, rtol=2e-4, atol=2e-4)
            assert int(drafts[b, k]) == int(np.argmax(expected))
            realised.append(int(drafts[b, k]))
    assert (np.asarray(logits[:, 1:]) != np.asarray(unary[:, 1:3])).all()  # corrected from slot 1 on


def test_export_is_specforges_layout_and_loads_back(target, tmp_path):
    drafter = make_drafter(target)
    cfg = drafter.cfg
    out = export_drafter(drafter, tmp_path / "domino", dtype=jnp.float32)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DominoDraftModel"]
    wanted = dict(projector_type="domino", pure_draft_prefix_len=1, emb_dim=8, gru_hidden_dim=8, shift_label=True)
    assert {k: config["dflash_config"][k] for k in wanted} == wanted
    tensors = load_file(out / "model.safetensors")
    D = cfg.hidden_size
    heads = {
        "prefix_gru.weight_ih_l0": (24, D),
        "prefix_gru.weight_hh_l0": (24, 8),
        "embed_proj.0.weight": (8, D + 8),
        "embed_proj.2.weight": (cfg.vocab_size, 8),
    }
    assert {name: tuple(tensors[name].shape) for name in heads} == heads
    loaded = load_drafter(out)
    assert loaded.cfg == cfg
    jax.tree.map(np.testing.assert_array_equal, nnx.state(drafter), nnx.state(loaded))
    with pytest.raises(ModelError, match="^Domino drafters without shift_label are not supported$"):
        DrafterConfig.from_hf({**config, "dflash_config": {**config["dflash_config"], "shift_label": False}})
    # SpecForge's training configs say the backbone's architecture and name Domino by its projector.
    as_specforge_trains_it = {**config, "architectures": ["DFlashDraftModel"]}
    assert DrafterConfig.from_hf(as_specforge_trains_it) == cfg
    unknown = {**as_specforge_trains_it, "dflash_config": {**config["dflash_config"], "projector_type": "mlp"}}
    with pytest.raises(
        ModelError, match=r"^drafter config.json has projector_type='mlp': only 'dspark', 'domino' load"
    ):
        DrafterConfig.from_hf(unknown)
    with pytest.raises(ModelError, match="that projector belongs to kind 'domino'$"):
        DrafterConfig.from_hf({**config, "architectures": ["DFlash2DraftModel"]})


def test_greedy_decoding_is_lossless(target):
    prompts = random_prompts(5, (6, 17, 9))
    kw = dict(max_prompt_len=32, max_new_tokens=16, batch_size=2)
    expected = TargetDecoder(target, **kw).generate(prompts)
    got = SpeculativeDecoder(target, make_drafter(target), **kw).generate(prompts)
    for x, y in zip(expected, got):
        np.testing.assert_array_equal(x.tokens, y.tokens)


# (base_loss_decay, step, λ) with base_loss_weight 0.6 over a 10-step run: λ falls from 0.6 to 0
# over the first 5 steps, SpecForge's curriculum, or stays (decay 0).
@pytest.mark.parametrize("decay, step, lam", [(0.5, 0, 0.6), (0.5, 3, 0.24), (0.5, 7, 0.0), (0.0, 7, 0.6)])
def test_loss_terms_mix_the_final_and_unary_cross_entropies(target, decay, step, lam):
    drafter = make_drafter(target)
    rng = np.random.default_rng(1)
    shape = (1, 2, 4)
    labels = rng.integers(0, MASK_ID, shape).astype(np.int32)
    anchors = rng.integers(0, MASK_ID, shape[:2] + (1,)).astype(np.int32)
    realised = jnp.asarray(np.concatenate([anchors, labels[..., :-1]], axis=-1))
    mask = np.ones(shape, bool)
    mask[0, 1, 3] = False
    blocks = scored_blocks(labels, mask, realised_embeds=target.embed(realised))
    cfg = objective.ObjectiveConfig(
        loss="dflash",
        dpace_alpha=0.5,  # unread: the position decay weighs the slots
        loss_decay_gamma=4.0,
        base_loss_weight=0.6,
        base_loss_decay=decay,
        total_steps=10,
        drafter=drafter.cfg,
    )
    hidden = jnp.asarray(rng.normal(size=(*shape, target.cfg.hidden_size)), jnp.float32)
    total, weights, _ = jax.jit(domino_terms, static_argnums=(0, 1, 4))(
        drafter, target.unembed, hidden, blocks, cfg, jnp.int32(step)
    )
    params = numpy_params({"prefix_gru": drafter.prefix_gru, "embed_proj": drafter.embed_proj})
    unary = np.asarray(target.unembed(hidden), np.float64)
    expected = 0.0
    for n in range(2):
        embeds = np.asarray(blocks.realised_embeds[0, n], np.float64)
        final = reference_logits(unary[0, n], np.asarray(hidden[0, n], np.float64), embeds, params, 1)
        for k in range(4):
            w = mask[0, n, k] * np.exp(-k / 4.0)  # the position decay from slot 0, which drafts too
            ce = [np.logaddexp.reduce(x) - x[labels[0, n, k]] for x in (final[k], unary[0, n, k])]
            expected += w * ((1 - lam) * ce[0] + lam * ce[1])
    np.testing.assert_allclose(float(total), expected, rtol=2e-4)
