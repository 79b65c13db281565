"""XPress against what vLLM PR #54448 loads and computes (its `qwen3_xpress.py` and
`spec_decode/xpress/speculator.py`; docs/design.md §12): the export's config keys, tensor names
and shapes as `qwen3_xpress.py` reads them, the refined logits
of a block against a float64 reference of the refiner's math fed the exported tensors
(tests/support/xpress_reference.py), the mixer's causality, and the Jacobi walk: vLLM's passes,
which reach the sequential walk's drafts in B - 1 passes and then stay there. Lossless decoding
and training are the kind-parametrized tests' (test_speculative.py, test_kind_objectives.py, ...)."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.numpy import load_file

from dflash_jax.decoding.draft_vocab import DraftVocabulary, FullVocabulary
from dflash_jax.decoding.kinds import WALKS
from dflash_jax.decoding.sampling import GREEDY
from dflash_jax.errors import ModelError
from dflash_jax.models.drafter_config import DrafterConfig
from dflash_jax.models.formats.hf import export_drafter, load_drafter
from support import xpress_reference as ref
from support.decoding_models import MASK_ID, VOCAB, make_drafter, make_target, perturbed

BLOCK, RANK, MLP, HIDDEN = 8, 8, 16, 32
# An XPress drafter on DFlash's backbone: the layout the vLLM PR itself loads.
PR_LAYOUT = dict(block_size=BLOCK, kind="xpress", xpress_rank=RANK, xpress_mlp_hidden=MLP, xpress_backbone="dflash")


@pytest.fixture(scope="module")
def target():
    return make_target(seed=1)


@pytest.fixture(scope="module")
def drafter(target):
    """Every parameter moved off its initial value (mix.L off zero), strongly enough that the
    refiner's bias changes drafts."""
    fresh = make_drafter(target, seed=2, **PR_LAYOUT)
    return perturbed(fresh, scale=0.5)


@pytest.fixture(scope="module")
def export(drafter, tmp_path_factory):
    out = export_drafter(drafter, tmp_path_factory.mktemp("xpress") / "export", dtype=jnp.float32)
    return out, json.loads((out / "config.json").read_text()), load_file(out / "model.safetensors")


def _t(x):
    return torch.tensor(np.asarray(x, np.float64))


def _assert_close(got, expected):
    """Equal up to float32's rounding at the size of the biggest finite logit."""
    expected = np.asarray(expected)
    scale = float(np.abs(expected[np.isfinite(expected)]).max())
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * scale)


def _head_tensors(export) -> dict:
    return {name: _t(value) for name, value in export[2].items()}


# qwen3_xpress.py's head tensors (xpress_head.*, torch's [out, in]) and the backbone's as its
# DFlash loader names them, for a drafter of one layer.
HEAD_SHAPES = {
    "xpress_head.w1.weight": (VOCAB, RANK),
    "xpress_head.down_h.weight": (RANK, HIDDEN),
    "xpress_head.down_g.weight": (RANK, HIDDEN),
    "xpress_head.in_proj.weight": (RANK, 3 * RANK),
    "xpress_head.mix.L": (RANK, BLOCK, BLOCK),
    "xpress_head.mlp.gate_proj.weight": (MLP, RANK),
    "xpress_head.mlp.up_proj.weight": (MLP, RANK),
    "xpress_head.mlp.down_proj.weight": (RANK, MLP),
    "xpress_head.w2.weight": (VOCAB, RANK),
}
BACKBONE = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
    f"layers.0.{name}"
    for name in (
        *(f"self_attn.{p}_proj.weight" for p in "qkvo"),
        "self_attn.q_norm.weight",
        "self_attn.k_norm.weight",
        *(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
    )
}


def test_export_is_what_vllms_loader_reads(drafter, export):
    out, config, tensors = export
    assert config["architectures"] == ["Qwen3XPressModel"] and config["model_type"] == "qwen3"
    wanted = dict(
        xpress_block_size=BLOCK,
        block_size=BLOCK,
        xpress_rank=RANK,
        xpress_mlp_hidden=MLP,
        xpress_num_passes=6,
        sample_from_anchor=False,
    )
    assert {k: config[k] for k in wanted} == wanted
    # The backbone's keys alone under dflash_config (what a strict loader allows); the full
    # vocabulary (vLLM refuses a draft_vocab_size below vocab_size).
    assert config["dflash_config"] == {"mask_token_id": MASK_ID, "target_layer_ids": [0, 1]}
    assert config.get("draft_vocab_size", VOCAB) == config["vocab_size"] == VOCAB
    # Every tensor under the name and shape the loader maps; no LM head or embedding of its own.
    assert set(tensors) == BACKBONE | set(HEAD_SHAPES)
    assert {name: tuple(tensors[name].shape) for name in HEAD_SHAPES} == HEAD_SHAPES
    # mix.L raw (the loader folds L ⊙ tril + I itself): the parameter as it is, upper triangle included.
    np.testing.assert_array_equal(tensors["xpress_head.mix.L"], drafter.xpress_head.mix.L[...])
    assert np.abs(np.triu(tensors["xpress_head.mix.L"], 1)).max() > 0
    # in_proj's columns: [0, r) down_h, [r, 2r) down_g, [2r, 3r) w1 (the fused path splits them so).
    np.testing.assert_array_equal(tensors["xpress_head.in_proj.weight"], drafter.xpress_head.in_proj.kernel[...].T)

    loaded = load_drafter(out)
    assert loaded.cfg == drafter.cfg
    jax.tree.map(np.testing.assert_array_equal, nnx.state(drafter), nnx.state(loaded))


def test_refined_logits_of_a_block_are_the_references(drafter, export):
    """Every slot's bias, the anchor's included, from the exported tensors by the serving fold."""
    rng = np.random.default_rng(0)
    hidden = jnp.asarray(rng.normal(size=(3, BLOCK, HIDDEN)), jnp.float32)
    previous = jnp.asarray(rng.integers(0, VOCAB, (3, BLOCK)), jnp.int32)
    head = drafter.xpress_head
    with jax.default_matmul_precision("highest"):
        got = head.bias(head.latent(head.hidden_part(hidden), previous))
    expected = ref.refiner_bias(_t(hidden), torch.tensor(np.asarray(previous)).long(), _head_tensors(export))
    _assert_close(got, expected)
    assert float(expected.abs().mean()) > 0.1  # a bias that matters


def test_the_mixer_is_causal(drafter):
    """Changing the token before slot j leaves the slots before j as they were and moves slot j."""
    rng = np.random.default_rng(1)
    head = drafter.xpress_head
    part = head.hidden_part(jnp.asarray(rng.normal(size=(2, BLOCK, HIDDEN)), jnp.float32))
    previous = jnp.asarray(rng.integers(0, VOCAB, (2, BLOCK)), jnp.int32)
    bias = np.asarray(head.bias(head.latent(part, previous)))
    for j in range(BLOCK):
        changed = np.asarray(head.bias(head.latent(part, previous.at[:, j].set((previous[:, j] + 1) % VOCAB))))
        np.testing.assert_array_equal(changed[:, :j], bias[:, :j])
        assert np.all(np.abs(changed[:, j] - bias[:, j]).max(-1) > 1e-4)


# 40 of the 64 tokens, in no particular order.
DRAFT_TOKENS = np.random.default_rng(9).permutation(VOCAB)[:40].astype(np.int32)


def _walk(target, drafter, passes, draft_tokens, hidden, anchor):
    """The walk's (drafts, logits) with `passes` Jacobi passes (the drafter's parameters)."""
    with_passes = nnx.merge(*nnx.split(drafter))
    with_passes.cfg = dataclasses.replace(drafter.cfg, xpress_num_passes=passes)
    vocab = FullVocabulary(target) if draft_tokens is None else DraftVocabulary(target, draft_tokens)
    with jax.default_matmul_precision("highest"):
        drafts, logits, proposed = WALKS["xpress"](vocab, with_passes, hidden, anchor, GREEDY, jax.random.key(0), 0.0)
    assert np.asarray(proposed).tolist() == [BLOCK - 1] * len(anchor)
    return np.asarray(drafts), np.asarray(logits)


@pytest.mark.parametrize("draft_tokens", [None, DRAFT_TOKENS], ids=["full", "draft_vocab"])
def test_jacobi_walk_is_vllms_and_reaches_the_sequential_walk(target, drafter, export, draft_tokens):
    rng = np.random.default_rng(2)
    hidden = jnp.asarray(rng.normal(size=(8, BLOCK, HIDDEN)), jnp.float32)
    anchor = jnp.asarray(rng.integers(0, VOCAB - 1, 8), jnp.int32)
    with jax.default_matmul_precision("highest"):
        base = np.asarray(target.unembed(hidden), np.float64)
    if draft_tokens is not None:  # the reference sees the backbone's logits -inf outside the draft vocabulary
        outside = np.ones(VOCAB, bool)
        outside[draft_tokens] = False
        base[..., outside] = -np.inf
    tensors, h, a, base = _head_tensors(export), _t(hidden), torch.tensor(np.asarray(anchor)).long(), _t(base)
    sequential = ref.sequential_drafts(h, base, a, tensors).numpy()
    walked = {passes: _walk(target, drafter, passes, draft_tokens, hidden, anchor) for passes in (1, 3, 6)}
    for passes, (drafts, logits) in walked.items():  # fewer than B - 1: vLLM's Jacobi iterate, and its logits
        np.testing.assert_array_equal(drafts, ref.jacobi_drafts(h, base, a, tensors, passes).numpy())
        before = ref.jacobi_drafts(h, base, a, tensors, passes - 1)
        _assert_close(logits, ref.refined_logits(h, base, a, before, tensors))
        # After p passes the first p slots are the sequential walk's.
        np.testing.assert_array_equal(drafts[:, :passes], sequential[:, :passes])
    assert np.any(walked[1][0] != sequential)  # the passes matter
    for passes in (BLOCK - 1, BLOCK + 2):  # the fixed point
        np.testing.assert_array_equal(_walk(target, drafter, passes, draft_tokens, hidden, anchor)[0], sequential)
    if draft_tokens is not None:
        assert set(sequential.ravel()) <= set(draft_tokens.tolist())


def _released(**changes) -> dict:
    """A config.json as the authors' converter writes it: z-lab's DFlash config plus the XPress keys."""
    config = dict(
        architectures=["Qwen3XPressModel"],
        model_type="qwen3",
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        vocab_size=300,
        max_position_embeddings=4096,
        num_target_layers=12,
        block_size=16,
        dflash_config=dict(mask_token_id=299, target_layer_ids=[1, 5, 9]),
        xpress_rank=32,
        xpress_mlp_hidden=64,
        xpress_block_size=16,
        xpress_num_passes=6,
        sample_from_anchor=False,
    )
    return {**config, **changes}


def test_released_configs_read_as_vllm_reads_them():
    cfg = DrafterConfig.from_hf(_released())
    assert (cfg.kind, cfg.block_size, cfg.num_drafts, cfg.first_draft_slot) == ("xpress", 16, 15, 1)
    assert (cfg.xpress_rank, cfg.xpress_mlp_hidden, cfg.xpress_num_passes) == (32, 64, 6)
    assert DrafterConfig.from_hf(cfg.to_hf()) == cfg
    # vLLM's defaults where a key is absent.
    bare = _released()
    for key in ("xpress_rank", "xpress_mlp_hidden", "xpress_num_passes", "xpress_block_size", "sample_from_anchor"):
        del bare[key]
    cfg = DrafterConfig.from_hf(bare)
    assert (cfg.block_size, cfg.xpress_rank, cfg.xpress_mlp_hidden, cfg.xpress_num_passes) == (16, 256, 512, 6)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(sample_from_anchor=True), "sample_from_anchor=true are not supported"),
        (dict(xpress_selector=True), "candidate selector seed"),
        (dict(draft_vocab_size=100), "reduced draft vocabulary"),
        (dict(xpress_block_size=8), "xpress_block_size=8 and block_size=16: they must be equal"),
        (
            dict(architectures=["Qwen3XPressDFlash2Model"]),
            "on DFlash2's backbone lacks dflash_config's conv_kernel_size and conv_group_size",
        ),
    ],
)
def test_xpress_layouts_we_cannot_load_are_refused(change, message):
    with pytest.raises(ModelError, match=message):
        DrafterConfig.from_hf(_released(**change))


def test_on_dflash2s_backbone_it_is_the_forks_layout_and_a_fresh_one_is_dflashs(target, tmp_path):
    """xpress_backbone='dflash2' (the default): DFlash2's convolutions in every layer, exported as the vLLM PR's
    fork loads `Qwen3XPressDFlash2Model` (its DFlash2 layers read the convolutions' sizes from
    dflash_config); a fresh one's convolutions are the identity, so it drafts as XPress on DFlash's."""
    sizes = dict(block_size=BLOCK, kind="xpress", xpress_rank=RANK, xpress_mlp_hidden=MLP)
    convolved = make_drafter(target, seed=4, conv_kernel_size=3, conv_group_size=8, **sizes)  # the default backbone
    plain = make_drafter(target, seed=4, **PR_LAYOUT)
    rng = np.random.default_rng(4)
    block = jnp.asarray(rng.integers(0, VOCAB, (1, 2, BLOCK)), jnp.int32)
    features = jnp.asarray(rng.normal(size=(1, 12, 2 * HIDDEN)), jnp.float32)
    positions = jnp.arange(12)[None]
    block_positions = jnp.asarray([[[3 + k for k in range(BLOCK)], [7 + k for k in range(BLOCK)]]])
    ctx_mask = positions[:, None, :] < jnp.asarray([[3, 7]])[..., None]

    def hidden(drafter):
        return drafter(target.embed(block), block_positions, drafter.context(features), positions, ctx_mask)

    np.testing.assert_allclose(hidden(convolved), hidden(plain), rtol=1e-5, atol=1e-6)
    trained = perturbed(convolved, scale=0.5)
    assert np.abs(np.asarray(hidden(trained)) - np.asarray(hidden(plain))).max() > 1e-2

    out = export_drafter(trained, tmp_path / "export", dtype=jnp.float32)
    config, tensors = json.loads((out / "config.json").read_text()), load_file(out / "model.safetensors")
    assert config["architectures"] == ["Qwen3XPressDFlash2Model"] and "xpress_backbone" not in config
    assert config["dflash_config"] == dict(
        mask_token_id=MASK_ID, target_layer_ids=[0, 1], conv_kernel_size=3, conv_group_size=8
    )
    convs = {
        f"layers.0.{conv}.{name}": shape
        for conv in ("attention_conv", "mlp_conv")
        for name, shape in (
            ("base_kernel", (2, 3, HIDDEN)),
            ("kernel_projection.weight", (2 * 3 * HIDDEN // 8, HIDDEN)),
        )
    }
    assert set(tensors) == BACKBONE | set(HEAD_SHAPES) | set(convs)
    assert {name: tuple(tensors[name].shape) for name in convs} == convs
    loaded = load_drafter(out)
    assert loaded.cfg == trained.cfg and loaded.cfg.xpress_backbone == "dflash2"
    jax.tree.map(np.testing.assert_array_equal, nnx.state(trained), nnx.state(loaded))
    with pytest.raises(ModelError, match=r"^xpress_backbone='dflash3' is not one of dflash2, dflash$"):
        make_drafter(target, xpress_backbone="dflash3", **sizes)


def test_a_fresh_head_starts_with_an_identity_mixer(target):
    drafter = make_drafter(target, seed=3, **PR_LAYOUT)
    head = drafter.xpress_head
    assert not np.any(head.mix.L[...])
    x = jnp.asarray(np.random.default_rng(3).normal(size=(2, BLOCK, RANK)), jnp.float32)
    np.testing.assert_array_equal(head.mix(x), x)
    assert float(np.std(head.w1.embedding[...])) == pytest.approx(0.02, rel=0.2)  # normal(0.02), as the others
