"""The drafter kinds on the DFlash backbone (docs/design.md "Drafter kinds"): DFlash2's grouped
dynamic convolution against its reference, identity at initialisation, the layouts the engines
load (z-lab's `DFlash2DraftModel`, vLLM's `Qwen3DSparkModel`), and export -> load -> the same
decoding."""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.numpy import load_file

from dflash_jax.decoding.sampling import SamplingConfig
from dflash_jax.decoding.speculative import SpeculativeDecoder
from dflash_jax.models import kinds
from dflash_jax.models.drafter import DFlashDrafter
from dflash_jax.models.drafter_config import DrafterConfig
from dflash_jax.models.formats.hf import export_drafter, load_drafter
from dflash_jax.models.kinds.dflash2 import grouped_dynamic_conv
from support import kind_references as ref
from support.decoding_models import MASK_ID, VOCAB, make_target, random_prompts

HEAD_FIELDS = dict(
    selector_rank=8, selector_top_k=6, markov_rank=8, gru_hidden_dim=8, emb_dim=8, xpress_rank=8, xpress_mlp_hidden=16
)


def head_fields(kind):
    return {f.name: HEAD_FIELDS[f.name] for f in dataclasses.fields(kinds.KINDS[kind].fields) if f.name in HEAD_FIELDS}


@pytest.fixture(scope="module")
def target():
    return make_target(seed=1)


def make_drafter(target, kind, seed=2, block_size=4, num_layers=2):
    cfg = DrafterConfig.for_target(
        target.cfg,
        num_layers=num_layers,
        mask_token_id=MASK_ID,
        block_size=block_size,
        target_layer_ids=(0, 1),
        kind=kind,
        **head_fields(kind),
    )
    make = lambda: DFlashDrafter(cfg, rngs=nnx.Rngs(seed))  # noqa: E731
    graphdef, _ = nnx.split(nnx.eval_shape(make))
    return nnx.merge(graphdef, jax.jit(lambda: nnx.split(make())[1])())  # one compiled init, not op by op


def trained_like(drafter, seed=0):
    """The drafter with every parameter moved off its initial value (identity convolutions
    included), so that no part can hide behind a zero or an identity."""
    _, state = nnx.split(drafter)
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    moved = [x + 0.05 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    nnx.update(drafter, jax.tree.unflatten(treedef, moved))
    return drafter


@pytest.mark.parametrize("taps, group_size", [(2, 16), pytest.param(3, 8, marks=pytest.mark.slow)])
def test_grouped_dynamic_conv_matches_reference_values_and_gradients(taps, group_size):
    rng = np.random.default_rng(taps)
    x = rng.normal(size=(3, 5, 32))
    delta = rng.normal(size=(3, 5, taps, 32 // group_size))
    base = rng.normal(size=(taps, 32))
    cotangent = rng.normal(size=x.shape)

    def loss(x, delta, base):
        return jnp.sum(grouped_dynamic_conv(x, delta, base) * cotangent)

    args = [jnp.asarray(a, jnp.float32) for a in (x, delta, base)]
    value, grads = jax.value_and_grad(loss, argnums=(0, 1, 2))(*args)
    ts = [torch.tensor(a, requires_grad=True) for a in (x, delta, base)]
    expected = (ref.grouped_dynamic_conv(*ts, group_size) * torch.tensor(cotangent)).sum()
    expected.backward()
    np.testing.assert_allclose(float(value), float(expected), rtol=1e-5)
    for got, want in zip(grads, ts):
        np.testing.assert_allclose(got, want.grad, rtol=1e-5, atol=1e-5)
    # Nothing crosses the block start: the first position sees itself only.
    out = np.asarray(grouped_dynamic_conv(*args))
    np.testing.assert_allclose(out[:, 0], (base[0] + np.repeat(delta[:, 0, 0], group_size, -1)) * x[:, 0], rtol=1e-5)


def _deep_update(dst: dict, src: dict) -> dict:
    for key, value in src.items():
        dst[key] = _deep_update(dst[key], value) if isinstance(value, dict) else value
    return dst


def _forward_and_decode(drafter, target):
    """The drafter's hidden states for two blocks, by the training forward and by decoding."""
    graphdef, state = nnx.split((drafter, target))
    with jax.default_matmul_precision("highest"):
        return _jitted_hidden_states(graphdef, state)


@functools.partial(jax.jit, static_argnums=0)
def _jitted_hidden_states(graphdef, state):
    return _hidden_states(*nnx.merge(graphdef, state))


def _hidden_states(drafter, target):
    rng = np.random.default_rng(0)
    features = jnp.asarray(rng.normal(size=(1, 12, 2 * 32)), jnp.float32)
    positions = jnp.arange(12)[None]
    anchors = jnp.asarray([[4, 9]])
    block = jnp.concatenate([jnp.asarray([[[3], [8]]]), jnp.full((1, 2, 3), MASK_ID)], -1)
    block_positions = anchors[..., None] + jnp.arange(4)
    ctx_mask = positions[:, None, :] < anchors[..., None]
    trained = drafter(target.embed(block), block_positions, drafter.context(features), positions, ctx_mask)
    cache = drafter.extend_context(drafter.new_cache(1, 16), features[:, :9], positions[:, :9], jnp.asarray([9]))
    decoded = drafter.decode(target.embed(block[:, 1]), block_positions[:, 1], cache)
    return trained, decoded


def test_fresh_dflash2_drafter_is_its_dflash_backbone(target):
    """Identity convolutions at initialisation: with the same backbone weights, a fresh DFlash2
    drafter's hidden states are DFlash's, in training and in decoding."""
    dflash = trained_like(make_drafter(target, "dflash"))
    dflash2 = make_drafter(target, "dflash2", seed=7)
    state = nnx.state(dflash2)
    nnx.replace_by_pure_dict(state, _deep_update(nnx.to_pure_dict(state), nnx.to_pure_dict(nnx.state(dflash))))
    nnx.update(dflash2, state)
    want, got = _forward_and_decode(dflash, target), _forward_and_decode(dflash2, target)
    moved = _forward_and_decode(trained_like(dflash2, seed=1), target)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(want[0][:, 1], want[1], rtol=1e-4, atol=1e-5)  # decode = training
    # Trained convolutions change the states, in training and decoding alike.
    assert np.abs(moved[0] - want[0]).max() > 1e-2
    np.testing.assert_allclose(moved[0][:, 1], moved[1], rtol=1e-4, atol=1e-5)


def _backbone_names(cfg) -> set[str]:
    layer = [f"self_attn.{p}_proj.weight" for p in "qkvo"] + ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    layer += [f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    layer += ["input_layernorm.weight", "post_attention_layernorm.weight"]
    return {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
        f"layers.{i}.{name}" for i in range(cfg.num_layers) for name in layer
    }


# The kinds' own tensors as the engines name them (z-lab's DFlash2 safetensors; vLLM's DSpark
# loader prefixes `model.` to every name but lm_head), by their shapes in torch's [out, in].
KIND_TENSORS = {
    "dflash2": lambda c: {
        **{
            f"layers.{i}.{conv}.{name}": shape
            for i in range(c.num_layers)
            for conv in ("attention_conv", "mlp_conv")
            for name, shape in (
                ("base_kernel", (2, c.conv_kernel_size, c.hidden_size)),
                (
                    "kernel_projection.weight",
                    (2 * c.conv_kernel_size * c.hidden_size // c.conv_group_size, c.hidden_size),
                ),
            )
        },
        "candidate_selector.hidden_projection.weight": (c.selector_rank, c.hidden_size),
        "candidate_selector.predecessor_codebook": (c.vocab_size, c.selector_rank),
        "candidate_selector.successor_codebook": (c.vocab_size, c.selector_rank),
    },
    "dspark": lambda c: {
        "markov_head.markov_w1.weight": (c.vocab_size, c.markov_rank),
        "markov_head.markov_w2.weight": (c.vocab_size, c.markov_rank),
        "confidence_head.proj.weight": (1, c.hidden_size + c.markov_rank),
        "confidence_head.proj.bias": (1,),
    },
    # vLLM's qwen3_xpress.py (tests/models/test_xpress.py checks them against its loader), and
    # the convolutions of DFlash2's layers, its default backbone.
    "xpress": lambda c: {
        **{k: v for k, v in KIND_TENSORS["dflash2"](c).items() if "_conv." in k},
        "xpress_head.w1.weight": (c.vocab_size, c.xpress_rank),
        **{f"xpress_head.down_{x}.weight": (c.xpress_rank, c.hidden_size) for x in "hg"},
        "xpress_head.in_proj.weight": (c.xpress_rank, 3 * c.xpress_rank),
        "xpress_head.mix.L": (c.xpress_rank, c.block_size, c.block_size),
        "xpress_head.mlp.gate_proj.weight": (c.xpress_mlp_hidden, c.xpress_rank),
        "xpress_head.mlp.up_proj.weight": (c.xpress_mlp_hidden, c.xpress_rank),
        "xpress_head.mlp.down_proj.weight": (c.xpress_rank, c.xpress_mlp_hidden),
        "xpress_head.w2.weight": (c.vocab_size, c.xpress_rank),
    },
}


@pytest.mark.parametrize("kind", ["dflash2", *(pytest.param(k, marks=pytest.mark.slow) for k in ("dspark", "xpress"))])
def test_export_in_the_engines_layout_loads_back_and_decodes_the_same(target, kind, tmp_path):
    drafter = trained_like(make_drafter(target, kind))
    cfg = drafter.cfg
    out = export_drafter(drafter, tmp_path / kind, dtype=jnp.float32)
    config = json.loads((out / "config.json").read_text())
    tensors = load_file(out / "model.safetensors")
    kind_names = KIND_TENSORS[kind](cfg)
    assert set(tensors) == _backbone_names(cfg) | set(kind_names)
    assert {name: tuple(tensors[name].shape) for name in kind_names} == kind_names
    assert config["model_type"] == "qwen3" and config["block_size"] == 4
    if kind == "dflash2":
        assert config["architectures"] == ["DFlash2DraftModel"]
        assert config["dflash_config"] == {
            "block_size": 4,
            "conv_group_size": 16,
            "conv_kernel_size": 2,
            "selector_rank": 8,
            "selector_top_k": 6,
            "mask_token_id": MASK_ID,
            "target_layer_ids": [0, 1],
        }
    elif kind == "xpress":  # on DFlash2's layers, as the vLLM PR author's fork reads it
        assert config["architectures"] == ["Qwen3XPressDFlash2Model"] and config["xpress_block_size"] == 4
        convs = {"conv_kernel_size": 2, "conv_group_size": 16}
        assert config["dflash_config"] == {"mask_token_id": MASK_ID, "target_layer_ids": [0, 1], **convs}
    else:  # what vLLM's qwen3_dspark.py and DeepSpec read
        assert config["architectures"] == ["Qwen3DSparkModel"]
        wanted = dict(markov_rank=8, markov_head_type="vanilla", enable_confidence_head=True)
        wanted.update(confidence_head_with_markov=True, mask_token_id=MASK_ID, target_layer_ids=[0, 1])
        assert {k: config[k] for k in wanted} == wanted
        assert not any(name.startswith(("embed_tokens", "lm_head")) for name in tensors)  # shared with the target

    loaded = load_drafter(out)
    assert loaded.cfg == cfg
    jax.tree.map(np.testing.assert_array_equal, nnx.state(drafter), nnx.state(loaded))
    prompts = random_prompts(5, (6, 17, 9))
    # Greedy (DSpark: truncated at a confidence threshold) and sampled.
    settings = [(SamplingConfig(), 0.5 if kind == "dspark" else 0.0), (SamplingConfig(0.9, top_k=20), 0.0)]
    for sampling, threshold in settings:
        kw = dict(max_prompt_len=32, max_new_tokens=16, batch_size=2, sampling=sampling)
        a = SpeculativeDecoder(target, drafter, confidence_threshold=threshold, **kw).generate(prompts, seed=3)
        b = SpeculativeDecoder(target, loaded, confidence_threshold=threshold, **kw).generate(prompts, seed=3)
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x.tokens, y.tokens)
            np.testing.assert_array_equal(x.step_lengths, y.step_lengths)


def _released(kind: str) -> dict:
    """A config.json as the released drafters write it: z-lab's DFlash2 (its dflash_config
    carries the selector and convolution sizes, an output multiplier and a logit soft-cap),
    DeepSpec's DSpark (its training-time architecture name, the fields at the top level)."""
    common = dict(
        model_type="qwen3",
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_theta": 500000.0, "rope_type": "default"},
        vocab_size=300,
        max_position_embeddings=4096,
        num_target_layers=12,
    )
    if kind == "dflash2":
        return dict(
            common,
            architectures=["DFlash2DraftModel"],
            dflash_config=dict(
                block_size=16,
                conv_group_size=16,
                conv_kernel_size=2,
                final_logit_softcapping=20.0,
                mask_token_id=299,
                output_multiplier=0.25,
                selector_rank=32,
                selector_top_k=16,
                target_layer_ids=[1, 5, 9],
            ),
        )
    return dict(
        common,
        architectures=["DSparkDraftModel"],
        block_size=7,
        mask_token_id=299,
        target_layer_ids=[1, 5, 9],
        markov_rank=32,
        markov_head_type="vanilla",
        enable_confidence_head=True,
        confidence_head_with_markov=True,
    )


@pytest.mark.parametrize("kind", ["dflash2", "dspark"])
def test_a_reduced_draft_vocabulary_is_refused_whatever_the_kind(kind):
    with pytest.raises(
        ValueError, match="^drafter config.json has draft_vocab_size=100 and vocab_size=300: .* not supp"
    ):
        DrafterConfig.from_hf({**_released(kind), "draft_vocab_size": 100})
    assert DrafterConfig.from_hf({**_released(kind), "draft_vocab_size": 300}).kind == kind


def test_released_configs_read_as_the_engines_read_them():
    dflash2 = DrafterConfig.from_hf(_released("dflash2"))
    assert (dflash2.kind, dflash2.block_size, dflash2.selector_rank, dflash2.selector_top_k) == ("dflash2", 16, 32, 16)
    assert (dflash2.output_multiplier, dflash2.final_logit_softcapping) == (0.25, 20.0)
    assert (dflash2.mask_token_id, dflash2.target_layer_ids, dflash2.num_drafts) == (299, (1, 5, 9), 15)
    assert DrafterConfig.from_hf(dflash2.to_hf()) == dflash2
    dspark = DrafterConfig.from_hf(_released("dspark"))
    assert (dspark.kind, dspark.block_size, dspark.markov_rank, dspark.target_layer_ids) == ("dspark", 7, 32, (1, 5, 9))
    assert (dspark.num_drafts, dspark.verify_size) == (7, 8)  # every slot drafts; the anchor is verified too
    assert DrafterConfig.from_hf(dspark.to_hf()) == dspark


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(kind="medusa"), r"kind='medusa' is not one of dflash, dflash2, dspark, domino, xpress"),
        (dict(kind="dflash2", conv_group_size=24), r"conv_group_size=24 must divide hidden_size=32"),
        (dict(kind="dflash2", selector_top_k=65), r"selector_top_k=65 must be in \[1, vocab_size=64\]"),
        (dict(kind="dflash2", conv_kernel_size=5), r"conv_kernel_size=5 must be in \[1, block_size=4\]"),
        (dict(kind="dspark", markov_rank=0), r"markov_rank=0 must be at least 1"),
        (dict(kind="xpress", xpress_num_passes=0), r"xpress_num_passes=0 must be at least 1"),
        (dict(kind="xpress", xpress_backbone_weight=-0.5), r"xpress_backbone_weight=-0.5 must be at least 0"),
    ],
)
def test_kind_errors_are_one_line(target, fields, message):
    with pytest.raises(ValueError, match=f"^{message}"):
        DrafterConfig.for_target(target.cfg, num_layers=1, mask_token_id=MASK_ID, block_size=4, **fields)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(markov_head_type="gated"), "only markov_head_type='vanilla' is supported"),
        (dict(confidence_head_with_markov=False), "only confidence_head_with_markov=True is supported"),
    ],
)
def test_dspark_layouts_we_cannot_load_are_refused(change, message):
    with pytest.raises(ValueError, match=message):
        DrafterConfig.from_hf({**_released("dspark"), **change})
    assert VOCAB == 64
