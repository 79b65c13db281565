"""The family registry (models/families/) and the weight-map engine (models/weight_maps.py) its
tables run on. The families' numbers against transformers are tests/models/test_families.py's."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dflash_jax.errors import ModelError
from dflash_jax.models import families
from dflash_jax.models.architecture import layer_attention, layer_window
from dflash_jax.models.layers.attention import packed_causal_pairs
from dflash_jax.models.layers.linear_attention import CHUNK
from dflash_jax.models.sharding import dotted
from dflash_jax.models.transformer import decoder_layer, layer_kind, layer_macs
from dflash_jax.models.weight_maps import Tensor, WeightMap, chain, checkpoint_name, split, transpose

FAMILY_MODULES = Path(families.__file__).parent
TARGETS = Path(__file__).resolve().parents[2] / "configs" / "targets"


class Source:
    def __init__(self, tensors: dict[str, np.ndarray]):
        self.tensors = tensors

    def names(self) -> set[str]:
        return set(self.tensors)

    def get(self, name: str) -> np.ndarray:
        return self.tensors[name]


def test_every_module_is_a_family_and_the_error_names_every_architecture():
    modules = sorted(p.stem for p in FAMILY_MODULES.glob("*.py") if p.stem != "__init__")
    assert sorted(families.FAMILIES) == modules  # a family's name is its module's
    architectures = [a for f in families.FAMILIES.values() for a in f.architectures]
    assert len(architectures) == len(set(architectures)) == len(families.ARCHITECTURES)
    with pytest.raises(ModelError, match="unsupported target architecture") as error:
        families.target_config({"architectures": ["MistralForCausalLM"]})
    assert all(a in str(error.value) for a in architectures)


def test_each_published_config_reads_as_its_family():
    """The public config.json files the plans read: their families and layer patterns."""
    expected = {
        "Qwen3-8B.json": ("qwen3", 36, 0),
        "Qwen3-30B-A3B.json": ("qwen3_moe", 48, 48),
        "Qwen3.5-35B-A3B.json": ("qwen3_5", 40, 40),
        "gpt-oss-20b.json": ("gpt_oss", 24, 24),
        "DeepSeek-V3.json": ("deepseek_v3", 61, 58),
        "Kimi-K2.5.json": ("deepseek_v3", 61, 60),
        "MiniMax-M2.json": ("minimax_m2", 62, 62),
        "gemma-4-31B-it.json": ("gemma4", 60, 0),
        "gemma-4-26B-A4B-it.json": ("gemma4", 30, 30),
    }
    for name, (family, layers, moe_layers) in expected.items():
        hf = json.loads((TARGETS / name).read_text())
        assert families.find(hf)[0].name == family, name
        cfg = families.target_config(hf)
        assert (cfg.num_layers, len(cfg.moe_layers)) == (layers, moe_layers), name
    gemma = families.target_config(json.loads((TARGETS / "gemma-4-31B-it.json").read_text()))
    assert (gemma.head_dim, gemma.num_kv_heads, gemma.sliding_window) == (256, 16, 1024)
    full = gemma.full_attention
    assert (full.head_dim, full.num_kv_heads, full.values_from_keys, full.rope.kind) == (512, 4, True, "proportional")
    qwen3_5 = families.target_config(json.loads((TARGETS / "Qwen3.5-35B-A3B.json").read_text()))
    assert qwen3_5.layer_types[:4] == ("linear_attention",) * 3 + ("full_attention",)
    assert qwen3_5.zero_centered_norm and qwen3_5.attention_output_gate and qwen3_5.qk_norm
    assert families.weight_map(json.loads((TARGETS / "Qwen3.5-35B-A3B.json").read_text())).prefix == (
        "model.language_model."
    )


def weight_macs(layer: nnx.Module, experts_per_token: float) -> float:
    """Multiply-adds a token of a layer's weight matmuls, read from its parameters: every matrix
    once, the stacked experts' by the share of them a token is routed to (biases, norms, scales
    and the conv's taps are no matmul weights)."""
    total = 0
    for path, x in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(nnx.state(layer, nnx.Param))):
        name = dotted(path)
        if x.ndim < 2 or name.endswith(("_bias", "conv1d.weight")):
            continue
        total += x.size * experts_per_token if ".experts." in f".{name}" else x.size
    return total


@pytest.mark.parametrize("name", sorted(p.name for p in TARGETS.glob("*.json")))
def test_each_kind_of_layer_counts_its_weights_and_its_attention(name):
    """`layer_macs` of each kind of layer of every published target (Gemma 4's own layer too): the
    weights its module holds, a token each, plus what attends (scores and outputs over the tiles
    below the diagonal; latent attention's N + R wide keys and U wide values; Gated DeltaNet's
    chunked delta rule)."""
    cfg = families.target_config(json.loads((TARGETS / name).read_text()))
    rows, seq_len = 2, 640
    first_of_kind = {layer_kind(cfg, i): i for i in reversed(range(cfg.num_layers))}
    for index in first_of_kind.values():
        layer = nnx.eval_shape(
            lambda i=index: decoder_layer(
                cfg,
                i,
                attention="xla",
                dtypes=dict(param_dtype=jnp.bfloat16, compute_dtype=jnp.bfloat16),
                rngs=nnx.Rngs(0),
            )
        )
        layer_type = cfg.layer_types[index]
        share = cfg.moe.num_experts_per_token / cfg.moe.num_experts if cfg.moe else 0
        if layer_type == "linear_attention":
            lin = cfg.linear_attention
            per_head = 2 * CHUNK * (lin.head_k_dim + lin.head_v_dim) + 3 * lin.head_k_dim * lin.head_v_dim
            attends = rows * seq_len * lin.num_v_heads * per_head
        elif cfg.latent_attention is not None:
            latent = cfg.latent_attention
            width = latent.qk_nope_head_dim + latent.qk_rope_head_dim + latent.v_head_dim
            attends = rows * packed_causal_pairs(seq_len) * cfg.num_heads * width
        else:
            pairs = packed_causal_pairs(seq_len, layer_window(cfg, layer_type))
            attends = 2 * rows * pairs * cfg.num_heads * layer_attention(cfg, layer_type).head_dim
        expected = rows * seq_len * weight_macs(layer, share) + attends
        assert layer_macs(cfg, index, rows, seq_len) == pytest.approx(expected, rel=1e-12), (name, index)


def test_a_block_no_family_builds_is_one_line():
    cfg = families.target_config(json.loads((TARGETS / "Qwen3-8B.json").read_text()))
    assert families.decoder_layer(cfg) is None  # the shared pre-norm block
    gemma = families.target_config(json.loads((TARGETS / "gemma-4-31B-it.json").read_text()))
    assert families.decoder_layer(gemma) is families.FAMILIES["gemma4"].layer
    with pytest.raises(ModelError, match=r"block 'qwen3' is not supported \(supported: pre_norm, gemma4\)"):
        families.decoder_layer(dataclasses.replace(cfg, block="qwen3"))


def test_a_qwen_hybrid_without_layer_types_has_every_fourth_layer_full():
    """Qwen3-Next's release leaves layer_types out (transformers fills them from
    full_attention_interval); reading every layer as full attention would miss its linear layers."""
    hf = json.loads((TARGETS / "Qwen3-8B.json").read_text())
    hf.update(
        architectures=["Qwen3NextForCausalLM"],
        num_hidden_layers=8,
        full_attention_interval=4,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
    )
    cfg = families.target_config(hf)
    assert cfg.layer_types == (("linear_attention",) * 3 + ("full_attention",)) * 2
    assert cfg.moe.norm_topk_prob and cfg.moe_layers == tuple(range(8))


def test_rows_are_tried_in_order_and_the_checkpoint_picks_its_layout():
    rows = (
        Tensor("experts.{expert}.{proj}.weight", "experts.{proj:gate_proj|down_proj}", transpose),
        Tensor("experts.gate_up", "experts.gate_proj", chain(split(0, 2, axis=1), transpose)),
        Tensor("mlp.gate.weight", "mlp.router.kernel", transpose),
    )
    weights = WeightMap(rows, prefix="model.")
    per_expert = {f"model.layers.1.experts.{e}.gate_proj.weight": np.full((3, 2), e, np.float32) for e in range(4)}
    fused = {"model.layers.1.experts.gate_up": np.arange(24, dtype=np.float32).reshape(2, 6, 2)}
    other = {"model.layers.1.mlp.gate.weight": np.ones((4, 2)), "lm_head.weight": np.ones((5, 2))}
    path = ["layers", 1, "experts", "gate_proj"]

    stacked, name = weights.read(Source({**per_expert, **other}), path, None)
    assert name == "model.layers.1.experts.{expert}.gate_proj.weight"
    assert stacked.shape == (4, 2, 3) and (stacked[:, 0, 0] == np.arange(4)).all()  # every expert held
    first_half, _ = weights.read(Source({**fused, **other}), path, None)
    np.testing.assert_array_equal(first_half, fused["model.layers.1.experts.gate_up"][:, :3].swapaxes(1, 2))

    # The generic rows: kernels transposed, the LM head outside the prefix, other names as they are.
    assert weights.read(Source(other), ["layers", 1, "mlp", "router", "kernel"], None)[0].shape == (2, 4)
    assert weights.read(Source(other), ["lm_head", "kernel"], None)[1] == "lm_head.weight"
    assert checkpoint_name(["layers", 0, "mlp", "up_proj", "kernel"]) == ("layers.0.mlp.up_proj.weight", True)
    assert checkpoint_name(["norm", "weight"], "model.") == ("model.norm.weight", False)

    with pytest.raises(KeyError) as missing:  # every layout it could have been in, named
        weights.read(Source(other), path, None)
    layouts = ("experts.0.gate_proj.weight", "experts.gate_up", "experts.gate_proj")  # the last: its own name
    assert missing.value.args[0] == tuple(f"model.layers.1.{n}" for n in layouts)
    with pytest.raises(KeyError):  # {proj:gate_proj|down_proj} does not match up_proj
        WeightMap(rows[:1]).read(
            Source({"model.layers.1.experts.0.up_proj.weight": np.ones(1)}), path[:3] + ["up_proj"], None
        )
