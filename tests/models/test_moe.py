"""The MoE MLP against transformers' own blocks (Qwen3-MoE, Qwen3.5-MoE, Qwen3-Next, gpt-oss), fp32,
with weights read the ways checkpoints hold them (fused, one tensor per expert, MXFP4)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors.numpy import load_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from dflash_jax.models.architecture import MoeConfig
from dflash_jax.models.families import FAMILIES, qwen3_moe
from dflash_jax.models.layers.moe import TILE_ROWS, MoE, grouped_matmul
from dflash_jax.models.weight_maps import WeightMap
from support.simulated_devices import run_script

HIDDEN, EXPERTS, EXPERT_DIM = 64, 8, 32
SMALL = dict(hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=64)


class DictSource:
    """An in-memory checkpoint with the reader interface weight maps take."""

    def __init__(self, tensors: dict[str, np.ndarray]):
        self.tensors = tensors

    def names(self) -> set[str]:
        return set(self.tensors)

    def get(self, name: str) -> np.ndarray:
        return self.tensors[name]


def torch_tensors(module: torch.nn.Module, prefix: str = "") -> DictSource:
    return DictSource({prefix + k: v.detach().numpy() for k, v in module.state_dict().items()})


def moe_config(family: str, hf_config) -> MoeConfig:
    """The MoE settings the family reads from a transformers config."""
    return FAMILIES[family].config(hf_config.to_dict()).moe


def load_moe(source: DictSource, prefix: str, config: MoeConfig, family: str, matmul: str = "auto") -> MoE:
    """Our MoE with every parameter read from `source` as the target loader reads a checkpoint:
    through the family's weight map, under `prefix`."""
    abstract = nnx.eval_shape(
        lambda: MoE(HIDDEN, config, param_dtype=jnp.float32, compute_dtype=jnp.float32, rngs=nnx.Rngs(0), matmul=matmul)
    )
    graphdef, state = nnx.split(abstract)

    weights = WeightMap(FAMILIES[family].tensors, prefix)

    def read(path, leaf):
        value, name = weights.read(source, [str(getattr(p, "key", p)) for p in path], None)
        assert value.shape == leaf.shape, (name, value.shape, leaf.shape)
        return jnp.asarray(value)

    pure = jax.tree_util.tree_map_with_path(read, nnx.to_pure_dict(state))
    nnx.replace_by_pure_dict(state, pure)
    return nnx.merge(graphdef, state)


def randomize(module: torch.nn.Module, seed: int, std: float = 0.1) -> torch.nn.Module:
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, std)
    return module.eval()


def run_both(hf_block, moe: MoE, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    with torch.no_grad():
        ref = hf_block(torch.from_numpy(x))
    ref = ref[0] if isinstance(ref, tuple) else ref  # GptOssMLP also returns the router scores
    with jax.default_matmul_precision("highest"):
        ours = jax.jit(lambda m, x: m(x))(moe, jnp.asarray(x))
    return ref.numpy(), np.asarray(ours)


def chosen_experts(moe: MoE, x: np.ndarray) -> np.ndarray:
    """[tokens, A] the experts the router picks."""
    return np.asarray(jax.jit(lambda m, t: m.route(t)[1])(moe, jnp.asarray(x.reshape(-1, HIDDEN))))


def inputs(shape, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def qwen3_moe_block(norm_topk_prob: bool, top_k: int = 2):
    config = transformers.Qwen3MoeConfig(
        num_experts=EXPERTS,
        num_experts_per_tok=top_k,
        moe_intermediate_size=EXPERT_DIM,
        norm_topk_prob=norm_topk_prob,
        **SMALL,
    )
    block = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(config)
    return config, randomize(block, seed=1)


@pytest.mark.parametrize("norm_topk_prob,matmul", [(True, "auto"), (False, "ragged_dot")])
def test_qwen3_moe_equals_transformers(norm_topk_prob, matmul):
    hf_config, block = qwen3_moe_block(norm_topk_prob)
    config = moe_config("qwen3_moe", hf_config)
    assert config.norm_topk_prob == norm_topk_prob and config.shared_expert_intermediate_size == 0
    # transformers holds Qwen experts fused as gate_up_proj [E, 2I, D]: the concatenated layout.
    moe = load_moe(torch_tensors(block), "", config, "qwen3_moe", matmul)
    x = inputs((3, 40, HIDDEN))  # 240 rows over 8 experts: groups of both more and fewer than TILE_ROWS
    ref, ours = run_both(block, moe, x)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-5)
    sizes = np.bincount(np.asarray(chosen_experts(moe, x)).ravel(), minlength=EXPERTS)
    assert sizes.max() > TILE_ROWS and sizes.min() < TILE_ROWS


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next"])
def test_shared_expert_block_equals_transformers(family):
    kw = dict(
        num_experts=EXPERTS,
        num_experts_per_tok=3,
        moe_intermediate_size=EXPERT_DIM,
        shared_expert_intermediate_size=48,
        layer_types=["full_attention"],
        num_hidden_layers=1,
        **SMALL,
    )
    if family == "qwen3_5_moe":
        hf_config = transformers.Qwen3_5MoeTextConfig(**kw)
        block = transformers.models.qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeSparseMoeBlock(hf_config)
    else:
        hf_config = transformers.Qwen3NextConfig(norm_topk_prob=True, **kw)
        block = transformers.models.qwen3_next.modeling_qwen3_next.Qwen3NextSparseMoeBlock(hf_config)
    block = randomize(block, seed=2)
    registered = "qwen3_5" if family == "qwen3_5_moe" else family  # the Qwen3.5 family holds both
    config = moe_config(registered, hf_config)
    assert config.shared_expert_intermediate_size == 48 and config.norm_topk_prob
    moe = load_moe(torch_tensors(block), "", config, registered)
    ref, ours = run_both(block, moe, inputs((2, 24, HIDDEN), seed=3))
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-5)


def gpt_oss_block(seed: int):
    hf_config = transformers.GptOssConfig(
        num_local_experts=EXPERTS, num_experts_per_tok=3, intermediate_size=EXPERT_DIM, **SMALL
    )
    block = transformers.models.gpt_oss.modeling_gpt_oss.GptOssMLP(hf_config)
    # Weights large enough that the SwiGLU clamps (limit 7) act on part of the values.
    return hf_config, randomize(block, seed=seed, std=0.6)


def test_gpt_oss_equals_transformers():
    hf_config, block = gpt_oss_block(seed=4)
    config = moe_config("gpt_oss", hf_config)
    assert (config.router, config.activation) == ("topk_softmax", "clamped_swiglu")
    moe = load_moe(torch_tensors(block), "", config, "gpt_oss")
    x = inputs((2, 20, HIDDEN), seed=5)
    # The test means something only if the clamps are hit (and not everywhere).
    pre = np.einsum("td,edf->tef", x.reshape(-1, HIDDEN), block.experts.gate_up_proj.detach().numpy())
    clamped = np.mean(np.abs(pre) > hf_config.swiglu_limit)
    assert 0.05 < clamped < 0.6, clamped
    ref, ours = run_both(block, moe, x)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-5 * np.abs(ref).max())


def test_dispatch_drops_nothing_when_every_token_picks_the_same_experts():
    hf_config, block = qwen3_moe_block(norm_topk_prob=True)
    # Positive inputs and a router that scores expert 3 highest, then expert 5, for every token.
    with torch.no_grad():
        block.gate.weight.fill_(-0.05)
        block.gate.weight[3] = 0.1
        block.gate.weight[5] = 0.05
    moe = load_moe(torch_tensors(block), "", moe_config("qwen3_moe", hf_config), "qwen3_moe")
    x = np.abs(inputs((2, 50, HIDDEN), seed=6)) + 0.1
    assert (np.sort(chosen_experts(moe, x), axis=-1) == [3, 5]).all()  # one group of 100 rows per expert
    ref, ours = run_both(block, moe, x)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize("impl", ["tiled", "ragged_dot", "fused"])
def test_grouped_matmul_equals_a_matmul_per_group(impl):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((90, 16)).astype(np.float32)
    w = rng.standard_normal((8, 16, 12)).astype(np.float32)
    matmul = jax.jit(lambda x, w, s: grouped_matmul(x, w, s, impl=impl))
    # Empty groups, a group of every row, groups below, at and above TILE_ROWS and the fused
    # kernel's 64-row tiles (interpret mode on CPU), several groups in one tile.
    for sizes in ([0, 7, 0, 40, 1, 33, 0, 9], [0, 0, 0, 0, 0, 0, 0, 90], [1, 1, 1, 32, 0, 0, 55, 0]):
        starts = np.cumsum([0, *sizes])
        expected = np.concatenate([x[a:b] @ w[g] for g, (a, b) in enumerate(zip(starts[:-1], starts[1:]))])
        with jax.default_matmul_precision("highest"):
            got = matmul(jnp.asarray(x), jnp.asarray(w), jnp.asarray(sizes, jnp.int32))
        np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-5, err_msg=str(sizes))


def test_tiled_grouped_matmul_work_grows_with_rows_not_experts():
    """ragged_dot on CPU multiplies every row by every group's matrix; the tiled matmul does not."""
    x = jax.ShapeDtypeStruct((512, 64), jnp.float32)
    w = jax.ShapeDtypeStruct((64, 64, 64), jnp.float32)
    sizes = jax.ShapeDtypeStruct((64,), jnp.int32)

    def temp_bytes(impl):
        fn = jax.jit(lambda x, w, s: grouped_matmul(x, w, s, impl=impl))
        return fn.lower(x, w, sizes).compile().memory_analysis().temp_size_in_bytes

    # ragged_dot's masked copy of x per group alone is [64, 512, 64] fp32 = 8 MiB.
    assert temp_bytes("ragged_dot") >= 64 * 512 * 64 * 4 > 4 * temp_bytes("tiled")


def test_per_expert_checkpoint_written_by_save_pretrained(tmp_path):
    """What transformers writes for a Qwen MoE (one tensor per expert) loads into the stacked layout."""
    hf_config = transformers.Qwen3MoeConfig(
        num_experts=EXPERTS,
        num_experts_per_tok=2,
        moe_intermediate_size=EXPERT_DIM,
        intermediate_size=96,
        norm_topk_prob=True,
        num_hidden_layers=1,
        **SMALL,
    )
    torch.manual_seed(8)
    model = transformers.Qwen3MoeForCausalLM(hf_config).eval()
    randomize(model.model.layers[0].mlp, seed=8)
    model.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in tensors
    assert not any(name.endswith("gate_up_proj") for name in tensors)
    config = FAMILIES["qwen3_moe"].config(json.loads((tmp_path / "config.json").read_text())).moe
    moe = load_moe(DictSource(tensors), "model.layers.0.mlp.", config, "qwen3_moe")
    ref, ours = run_both(model.model.layers[0].mlp, moe, inputs((2, 16, HIDDEN), seed=9))
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-5)


def test_bad_settings_are_one_line_errors():
    with pytest.raises(ValueError, match="router 'top1'"):
        MoeConfig(num_experts=8, num_experts_per_token=2, expert_intermediate_size=4, router="top1")
    with pytest.raises(ValueError, match="num_experts_per_token=9"):
        MoeConfig(num_experts=8, num_experts_per_token=9, expert_intermediate_size=4)
    with pytest.raises(ValueError, match="MoE hidden_act 'gelu'"):
        qwen3_moe.moe_config({"hidden_act": "gelu"}, norm_topk_prob=True)
    # Missing experts: the names of both layouts they could have come in.
    with pytest.raises(KeyError, match=r"model\.layers\.0\.mlp\.experts\.0\.gate_proj\.weight.*experts\.gate_up_proj"):
        WeightMap(qwen3_moe.EXPERT_TENSORS).read(DictSource({}), ["layers", "0", "mlp", "experts", "gate_proj"], None)


def test_gpt_oss_layer_read_from_mxfp4_equals_transformers():
    """The layout transform: our experts read from `*_blocks`/`*_scales` give GptOssMLP's output when
    GptOssMLP holds what transformers' dequantization makes of the same tensors."""
    experts, intermediate = 8, 32
    hf_config = transformers.GptOssConfig(
        num_local_experts=experts, num_experts_per_tok=2, intermediate_size=intermediate, **SMALL
    )
    block = randomize(transformers.models.gpt_oss.modeling_gpt_oss.GptOssMLP(hf_config), seed=3, std=0.5)
    # Checkpoint layout: rows = output features, inputs packed 32 to a block; scales near 2**-3..2**0.
    rng = np.random.default_rng(4)
    gate_up, down = (
        (rng.integers(0, 256, (*rows, 16), dtype=np.uint8), rng.integers(124, 128, rows, dtype=np.uint8))
        for rows in ((experts, 2 * intermediate, HIDDEN // 32), (experts, HIDDEN, intermediate // 32))
    )
    with torch.no_grad():
        for param, (blocks, scales) in ((block.experts.gate_up_proj, gate_up), (block.experts.down_proj, down)):
            param.copy_(
                convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
            )
    tensors = {k: v.detach().numpy() for k, v in block.state_dict().items() if k.startswith("router.") or "bias" in k}
    for name, (blocks, scales) in (("gate_up_proj", gate_up), ("down_proj", down)):
        tensors[f"experts.{name}_blocks"], tensors[f"experts.{name}_scales"] = blocks, scales
    moe = load_moe(DictSource(tensors), "", moe_config("gpt_oss", hf_config), "gpt_oss")
    ref, ours = run_both(block, moe, inputs((2, 12, HIDDEN), seed=6))
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-5 * np.abs(ref).max())


EXPERT_PARALLEL = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from dflash_jax.models import parameters, sharding
    from dflash_jax.models.architecture import MoeConfig
    from dflash_jax.models.layers.moe import MoE
    from dflash_jax.training.planning import hlo as hlo_lib
    from dflash_jax.training.planning import hlo_text
    from dflash_jax.training.mesh import make_mesh

    # The layouts of (data, fsdp, tensor): experts over fsdp with tokens gathered over it; over
    # tensor alone, every device holding every token; over fsdp x tensor.
    MESHES = {"deepseek": ((2, 4, 1), (1, 1, 8)), "gpt_oss": ((1, 2, 4),)}
    CONFIGS = {  # DeepSeek-V3's routing and unscaled shared expert; gpt-oss' biased experts
        "deepseek": MoeConfig(num_experts=16, num_experts_per_token=4, expert_intermediate_size=32,
            router="sigmoid_grouped", num_groups=4, groups_kept=2, routed_scaling_factor=2.5,
            shared_expert_intermediate_size=48, shared_expert_gate=False),
        "gpt_oss": MoeConfig(num_experts=16, num_experts_per_token=3, expert_intermediate_size=32,
            router="topk_softmax", router_bias=True, expert_bias=True, activation="clamped_swiglu"),
    }

    class Layer(nnx.Module):  # the parameter paths of a decoder layer's MLP
        def __init__(self, config):
            self.mlp = MoE(64, config, param_dtype=jnp.float32, compute_dtype=jnp.float32, rngs=nnx.Rngs(0))

    x = jnp.asarray(np.random.default_rng(0).standard_normal((8, 40, 64)), jnp.float32)
    for name, config in CONFIGS.items():
        layer = Layer(config)
        graphdef, params = nnx.split(layer)
        params = jax.tree.map(lambda p: p + 0.05 * jax.random.normal(jax.random.key(1), p.shape), params)
        with jax.default_matmul_precision("highest"):
            expected = jax.jit(lambda p, x: nnx.merge(graphdef, p).mlp(x))(params, x)
        for shape in MESHES[name]:
            mesh = make_mesh(*shape)
            placed = jax.device_put(params, parameters.param_shardings(mesh, params))
            def forward(p, x):
                with sharding.activation_sharding(mesh):
                    return nnx.merge(graphdef, p).mlp(x)
            with jax.default_matmul_precision("highest"):
                step = jax.jit(forward).lower(placed, x).compile()
            got = step(placed, x)
            np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=2e-5, err_msg=f"{name} {shape}")
            # The experts stay where they are: no device gathers another's (only tokens move).
            hlo = step.as_text()
            gathered = [line for line in hlo.splitlines() if "all-gather(" in line and "f32[16," in line]
            assert not gathered, (name, shape, gathered[:2])
            # Each token is routed (logits [rows, 16 experts]) and put through the shared expert
            # ([rows, 48]) on one device: no dot has more rows than a device's share of the 320.
            module = hlo_text.Module(hlo)
            # The loop over routed pairs has a data-dependent length: the roofline counts it at the
            # trips the model states for balanced routing, never as an unknown loop.
            trips = {k.trips for k in hlo_lib.kernels(module) if k.flops}
            assert hlo_text.EXPECTED in trips and hlo_text.UNKNOWN not in trips, (name, shape, trips)
            for body in module.computations.values():
                for ins in body:
                    dims = hlo_text.dims(ins.type) if ins.opcode == "dot" else []
                    if len(dims) == 2 and dims[1] in (16, 48):
                        assert dims[0] <= 320 // 8, (name, shape, ins.type)
    print("OK")
    """
)


@pytest.mark.slow  # a subprocess on 8 simulated devices
def test_expert_parallel_forward_equals_one_device():
    """Under a mesh that splits the experts, each device runs its own experts on the tokens of its
    group (8 simulated devices, fsdp and tensor layouts, every output equal to one device's)."""
    result = run_script(EXPERT_PARALLEL, devices=8, import_dir=str(Path(__file__).resolve().parents[2]))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "OK" in result.stdout
