"""Sharding by name: the spec of every parameter, target and drafter, for each layout.

The tables below are what lands where; they are written out by hand so that a change to the
rules (models/parameters.py, models/sharding.py) shows up here as a readable diff.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from dflash_jax.models import parameters, sharding
from dflash_jax.models.drafter import DFlashDrafter
from dflash_jax.models.drafter_config import DrafterConfig
from dflash_jax.models.families import target_config
from dflash_jax.models.transformer import Transformer

TARGETS = Path(__file__).resolve().parents[2] / "configs" / "targets"
QWEN3_8B = target_config(json.loads((TARGETS / "Qwen3-8B.json").read_text()))
QWEN3_4B = target_config(json.loads((TARGETS / "Qwen3-4B.json").read_text()))
HUB_TARGETS = {"qwen3-8b": QWEN3_8B, "qwen3-4b-tied": QWEN3_4B}

MESHES = {  # layout name -> a mesh shape that selects it (8 devices)
    "data": {"data": 8, "fsdp": 1, "tensor": 1},
    "fsdp": {"data": 2, "fsdp": 4, "tensor": 1},
    "tensor": {"data": 2, "fsdp": 1, "tensor": 4},
    "fsdp+tensor": {"data": 1, "fsdp": 2, "tensor": 4},
}
ALL = "every device"  # in DRAFTER_ZERO_SPECS: the mesh axes of size > 1, in mesh order
REST = "data x fsdp"  # the mesh axes of size > 1 other than tensor

# Frozen target: parameter (end of its path) -> spec, per layout. Norm scales are never split.
TARGET_SPECS = {
    "data": {
        "embed_tokens.embedding": P(),
        "q_proj.kernel": P(),
        "k_proj.kernel": P(),
        "v_proj.kernel": P(),
        "o_proj.kernel": P(),
        "gate_proj.kernel": P(),
        "up_proj.kernel": P(),
        "down_proj.kernel": P(),
        "lm_head.kernel": P(),
    },
    "fsdp": {
        "embed_tokens.embedding": P("fsdp", None),  # vocab
        "q_proj.kernel": P("fsdp", None),  # embed
        "k_proj.kernel": P("fsdp", None),
        "v_proj.kernel": P("fsdp", None),
        "o_proj.kernel": P(None, "fsdp"),
        "gate_proj.kernel": P("fsdp", None),
        "up_proj.kernel": P("fsdp", None),
        "down_proj.kernel": P(None, "fsdp"),
        "lm_head.kernel": P(None, "fsdp"),  # vocab: the vocab-parallel cross-entropy
    },
    "tensor": {
        "embed_tokens.embedding": P("tensor", None),
        "q_proj.kernel": P(None, "tensor"),  # heads
        "k_proj.kernel": P(None, "tensor"),  # kv heads
        "v_proj.kernel": P(None, "tensor"),
        "o_proj.kernel": P("tensor", None),
        "gate_proj.kernel": P(None, "tensor"),  # mlp
        "up_proj.kernel": P(None, "tensor"),
        "down_proj.kernel": P("tensor", None),
        "lm_head.kernel": P(None, "tensor"),
    },
    "fsdp+tensor": {
        "embed_tokens.embedding": P(("fsdp", "tensor"), None),
        "q_proj.kernel": P("fsdp", "tensor"),
        "k_proj.kernel": P("fsdp", "tensor"),
        "v_proj.kernel": P("fsdp", "tensor"),
        "o_proj.kernel": P("tensor", "fsdp"),
        "gate_proj.kernel": P("fsdp", "tensor"),
        "up_proj.kernel": P("fsdp", "tensor"),
        "down_proj.kernel": P("tensor", "fsdp"),
        "lm_head.kernel": P(None, ("fsdp", "tensor")),  # vocab over both; embed left whole
    },
}

# Trained state (drafter master weights and AdamW moments): split over all 8 devices in every
# layout, along embed (e.g. ('data', 'fsdp') on data=2 x fsdp=4); with a tensor axis, heads and
# MLP over `tensor` as the compute splits them, embed over the rest.
DRAFTER_ZERO_SPECS = {
    "fc.kernel": P(None, ALL),
    "q_proj.kernel": P(ALL, None),
    "k_proj.kernel": P(ALL, None),
    "v_proj.kernel": P(ALL, None),
    "o_proj.kernel": P(None, ALL),
    "gate_proj.kernel": P(ALL, None),
    "up_proj.kernel": P(ALL, None),
    "down_proj.kernel": P(None, ALL),
}
DRAFTER_ZERO_SPECS_TENSOR = {
    "fc.kernel": P(None, ALL),
    "q_proj.kernel": P(REST, "tensor"),
    "k_proj.kernel": P(REST, "tensor"),
    "v_proj.kernel": P(REST, "tensor"),
    "o_proj.kernel": P("tensor", REST),
    "gate_proj.kernel": P(REST, "tensor"),
    "up_proj.kernel": P(REST, "tensor"),
    "down_proj.kernel": P("tensor", REST),
}


def normalized(spec: P) -> tuple:
    """P(None, None) and P() mean the same; compare without trailing Nones."""
    entries = list(spec)
    while entries and entries[-1] is None:
        entries.pop()
    return tuple(entries)


def leaves(tree):
    return [(sharding.dotted(path), leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(tree)]


def expected_for(table: dict, name: str, mesh=None) -> P:
    if name.endswith("norm.weight"):
        return P()
    spec = next(spec for suffix, spec in table.items() if name.endswith(suffix))
    every = tuple(a for a in sharding.MESH_AXES if (mesh or {}).get(a, 1) > 1)
    rest = tuple(a for a in every if a != "tensor")
    named = {ALL: every, REST: rest}
    return P(*[(named[s] if len(named[s]) > 1 else named[s][0]) if s in named else s for s in spec])


def abstract_params(model_fn):
    return nnx.split(nnx.eval_shape(model_fn))[1]


@functools.cache
def target_leaves(name: str) -> list:
    """A hub target's named parameters (shapes only, bfloat16), traced once for every layout."""
    return leaves(abstract_params(lambda: Transformer(HUB_TARGETS[name], param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))))


@pytest.mark.parametrize("layout", list(MESHES))
@pytest.mark.parametrize("target", list(HUB_TARGETS))
def test_every_target_parameter_spec(layout, target):
    mesh = MESHES[layout]
    assert sharding.layout_of(mesh) == layout.split("+")[-1]
    cfg, params = HUB_TARGETS[target], target_leaves(target)
    assert len(params) == 3 + 11 * cfg.num_layers - (1 if cfg.tie_word_embeddings else 0)
    for name, leaf in params:
        got = parameters.param_spec(mesh, name, leaf.shape)
        assert normalized(got) == normalized(expected_for(TARGET_SPECS[layout], name)), (layout, name, got)


@pytest.mark.parametrize("layout", list(MESHES))
def test_drafter_state_is_split_over_every_device(layout):
    """ZeRO: master weights and both AdamW moments, in every layout; scalars and norms whole."""
    mesh = MESHES[layout]
    cfg = DrafterConfig.for_target(QWEN3_8B, num_layers=2, mask_token_id=151669, block_size=16)
    params = abstract_params(lambda: DFlashDrafter(cfg, rngs=nnx.Rngs(0)))
    opt_state = jax.eval_shape(optax.adamw(1e-3).init, params)
    checked = 0
    for name, leaf in leaves({"params": params, "opt_state": opt_state}):
        got = parameters.zero_spec(mesh, name, leaf.shape)
        if leaf.ndim == 0 or name.endswith("norm.weight"):
            assert normalized(got) == (), (name, got)
            continue
        table = DRAFTER_ZERO_SPECS_TENSOR if "tensor" in layout else DRAFTER_ZERO_SPECS
        assert normalized(got) == normalized(expected_for(table, name, mesh)), (layout, name, got)
        checked += 1
    assert checked == 3 * (1 + 7 * cfg.num_layers)  # params, mu, nu


def test_the_logical_axes_of_every_parameter_are_named():
    names = dict(
        (n.split(".", 2)[-1] if n.startswith("layers.") else n, parameters.param_axes(n))
        for n, _ in target_leaves("qwen3-8b")
    )
    assert names["self_attn.q_proj.kernel"] == ("embed", "heads")
    assert names["self_attn.k_proj.kernel"] == ("embed", "kv_heads")
    assert names["self_attn.o_proj.kernel"] == ("heads", "embed")
    assert names["mlp.gate_proj.kernel"] == ("embed", "mlp")
    assert names["mlp.down_proj.kernel"] == ("mlp", "embed")
    assert names["embed_tokens.embedding"] == ("vocab", "embed")
    assert names["lm_head.kernel"] == ("embed", "vocab")
    assert names["self_attn.q_norm.weight"] == ("norm",)
    assert parameters.param_axes("fc.kernel") == ("features", "embed")
    with pytest.raises(
        KeyError, match="has no logical axes: add a partition rule for it to the module that defines it"
    ):
        parameters.param_axes("layers.0.mlp.new_proj.kernel")


def test_every_parameter_of_the_newer_families_has_axes():
    """Every parameter of the Kimi-K2.5, MiniMax-M2 and Gemma 4 26B-A4B targets (shapes only; two
    layers of each, a dense one and one with experts for Kimi)."""
    for name in ("Kimi-K2.5.json", "MiniMax-M2.json", "gemma-4-26B-A4B-it.json"):
        hf = json.loads((TARGETS / name).read_text())
        text = hf.get("text_config") or hf
        text["num_hidden_layers"] = 2
        text["layer_types"] = text.get("layer_types", ["full_attention"] * 6)[4:6]  # Gemma: sliding, full
        cfg = target_config(hf)
        params = leaves(abstract_params(lambda cfg=cfg: Transformer(cfg, rngs=nnx.Rngs(0))))
        axes = {n.split(".", 2)[-1] if n.startswith("layers.") else n: parameters.param_axes(n) for n, _ in params}
        if "gemma" in name:
            assert axes["post_feedforward_layernorm_1.weight"] == axes["layer_scalar"] == ("norm",)
            assert axes["moe.router.kernel"] == ("embed", None)
        else:
            assert axes["mlp.e_score_correction_bias"] == (None,)
        if name == "MiniMax-M2.json":
            assert axes["self_attn.q_norm.weight"] == ("norm",)  # over all heads
    kimi = target_config(json.loads((TARGETS / "Kimi-K2.5.json").read_text()))
    for param, expected in (
        ("self_attn.q_a_proj.kernel", ("embed", None)),
        ("self_attn.q_b_proj.kernel", (None, "heads")),
        ("self_attn.kv_a_proj_with_mqa.kernel", ("embed", None)),
        ("self_attn.kv_b_proj.kernel", (None, "heads")),
        ("self_attn.o_proj.kernel", ("heads", "embed")),
        ("mlp.shared_expert.down_proj.kernel", ("mlp", "embed")),
    ):
        assert parameters.param_axes(f"layers.1.{param}") == expected, param
    assert kimi.latent_attention.kv_lora_rank == 512


def test_rules_priority_and_divisibility():
    fsdp = sharding.RULES["fsdp"]
    mesh = MESHES["fsdp"]
    # logits of a chunk: vocab takes fsdp first, rows keep only data
    assert sharding.logical_to_spec(("batch", None, "vocab"), (8, 4, 1024), mesh, fsdp) == P("data", None, "fsdp")
    # the residual stream: rows over data x fsdp, the model dim whole
    assert sharding.logical_to_spec(("batch", "length", "embed"), (8, 4, 64), mesh, fsdp) == P(
        ("data", "fsdp"), None, None
    )
    # a dimension the mesh axes do not divide drops trailing axes, or stays whole
    assert sharding.logical_to_spec(("embed",), (6,), MESHES["data"], sharding.ZERO_RULES) == P(None)
    assert sharding.logical_to_spec(("embed", "mlp"), (6, 16), mesh, sharding.ZERO_RULES) == P("data", "fsdp")


def test_constrain_is_the_identity_outside_a_mesh_context():
    x = jnp.ones((4, 3))
    assert sharding.constrain(x, ("batch", "embed")) is x
    assert sharding.activation_spec(x.shape, ("batch", ...)) is None
