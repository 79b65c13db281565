"""Scanned layers (models/layers/layer_stack.py): segments follow the layer pattern, and a model whose
layers run under scans over stacked weights computes what the unrolled one does: the target's
logits, every layer's hidden state, the features of a forward that stops inside a scanned segment
and cached decoding, loaded from the same checkpoint; the drafter's output and gradients under
each remat policy."""

from __future__ import annotations

import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec

from dflash_jax.models import parameters, sharding
from dflash_jax.models.architecture import RopeConfig
from dflash_jax.models.drafter import DFlashDrafter
from dflash_jax.models.drafter_config import DrafterConfig
from dflash_jax.models.formats.hf import load_target
from dflash_jax.models.layers.block_attention import block_context_mask
from dflash_jax.models.layers.layer_stack import REMAT_POLICIES, LayerStack, Segment, segments
from dflash_jax.training import warm_start
from support.simulated_devices import run_script

SEQ = 24


def test_segments_follow_the_layer_pattern():
    linear, full, sliding, dense, moe = "linear", "full", "sliding", "dense", "moe"
    # Plain: one scan over every layer.
    assert segments([full] * 6) == (Segment(0, 1, 6),)
    # Hybrid 3:1 over 10 layers: two whole periods scanned, the two layers after them a scan of their own.
    assert segments(([linear] * 3 + [full]) * 2 + [linear] * 2) == (Segment(0, 4, 2), Segment(8, 1, 2))
    # Sliding/full alternation, Gemma's 5:1, 64 layers of 3:1: the shortest period that covers all.
    assert segments([sliding, full] * 18) == (Segment(0, 2, 18),)
    assert segments(([sliding] * 5 + [full]) * 10) == (Segment(0, 6, 10),)
    assert segments(([linear] * 3 + [full]) * 16) == (Segment(0, 4, 16),)
    # First k dense layers, then experts: the dense layers alone (k = 1) or scanned (k = 3).
    assert segments([dense] + [moe] * 60) == (Segment(0), Segment(1, 1, 60))
    assert segments([dense] * 3 + [moe] * 58) == (Segment(0, 1, 3), Segment(3, 1, 58))
    # Nothing repeats: every layer alone; and scan=False.
    assert segments([linear, full, sliding]) == (Segment(0), Segment(1), Segment(2))
    assert segments([full] * 3, scan=False) == (Segment(0), Segment(1), Segment(2))
    assert [Segment(2, 3, 4).layer(1, 2), Segment(2, 3, 4).stop] == [7, 14]


def test_stacked_parameters_have_an_unsplit_leading_layers_axis():
    path = "layers.0.stacked.1.self_attn.q_proj.kernel"
    assert parameters.param_axes(path) == (sharding.LAYERS, sharding.EMBED, sharding.HEADS)
    assert parameters.param_axes("layers.1.self_attn.q_proj.kernel") == (sharding.EMBED, sharding.HEADS)
    mesh = {"data": 1, "fsdp": 2, "tensor": 2}
    assert parameters.param_spec(mesh, path, (4, 64, 64)) == PartitionSpec(None, "fsdp", "tensor")
    assert parameters.zero_spec({"data": 4}, path, (4, 64, 64)) == PartitionSpec(None, "data", None)
    experts = "layers.1.stacked.0.mlp.experts.gate_proj"
    assert parameters.param_spec({"fsdp": 4}, experts, (60, 8, 64, 32)) == PartitionSpec(None, "fsdp", None, None)


@pytest.fixture(scope="module")
def hybrid_checkpoint(make_hf_checkpoint, tmp_path_factory):
    """Qwen3.5's 3:1 linear/full pattern over 10 layers: two periods and two linear layers after."""
    return make_hf_checkpoint(tmp_path_factory.mktemp("hybrid"), arch="qwen3_5_text", num_hidden_layers=10)


# name -> (checkpoint arch, layers, the segments, the layer ids of a forward that stops inside a
# scanned segment, the most dot_generals the scanned forward may hold against the unrolled one's).
CASES = {
    "plain": ("qwen3", 4, (Segment(0, 1, 4),), (0, 2), 0.3),
    "hybrid": ("qwen3_5_text", 10, (Segment(0, 4, 2), Segment(8, 1, 2)), (1, 5, 6), 0.55),
    # gpt-oss: sliding and full attention alternating, experts everywhere
    "alternating": ("gpt_oss", 4, (Segment(0, 2, 2),), (0, 2), 0.6),
    # DeepSeek-V3: the first layer dense, the rest experts
    "dense_first": ("deepseek_v3", 5, (Segment(0), Segment(1, 1, 4)), (1, 3), 0.55),
}


@pytest.fixture(
    scope="module",
    params=[
        "plain",
        *(pytest.param(name, marks=pytest.mark.slow) for name in ("hybrid", "alternating", "dense_first")),
    ],
)
def targets(request, make_hf_checkpoint, tmp_path_factory):
    arch, layers, *_ = CASES[request.param]
    if request.param in ("plain", "hybrid"):  # the checkpoints other tests share, written when asked
        path = request.getfixturevalue({"plain": "qwen3_checkpoint", "hybrid": "hybrid_checkpoint"}[request.param])
    else:
        path = make_hf_checkpoint(tmp_path_factory.mktemp(request.param), arch=arch, num_hidden_layers=layers)
    kw = dict(param_dtype=jnp.float32, compute_dtype=jnp.float32)
    return request.param, load_target(path, scan_layers=False, **kw), load_target(path, scan_layers=True, **kw)


def _rows(batch=2):
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 128, (batch, SEQ)))
    # Two documents in the first row, so packed rows pass through the scanned mixers too.
    segment_ids = jnp.ones_like(tokens).at[0, 15:].set(2)
    positions = jnp.broadcast_to(jnp.arange(SEQ), tokens.shape).at[0, 15:].add(-15)
    return tokens, segment_ids, positions


def _jit(model, fn):
    graphdef, state = nnx.split(model)
    return jax.jit(lambda state, *args: fn(nnx.merge(graphdef, state), *args)), state


def test_scanned_target_equals_unrolled(targets):
    name, unrolled, scanned = targets
    _, num_layers, expected_segments, partial, most_dots = CASES[name]
    assert scanned.segments == expected_segments
    stack = next(layer for layer in scanned.layers if isinstance(layer, LayerStack))
    assert stack.stacked[0].input_layernorm.weight[...].shape == (stack.segment.repeats, 64)
    rows = _rows()

    def forward(model, *rows):
        return model(*rows, hidden_layers=tuple(range(num_layers)))

    def features(model, *rows):
        return model.features(*rows, partial)

    def decode(model, tokens):
        logits, feats, cache = model.decode(tokens, model.new_cache(tokens.shape[0], SEQ + 4), feature_layers=partial)
        return logits, feats, cache.layers

    with jax.default_matmul_precision("highest"):
        results, programs = [], []
        for model in (unrolled, scanned):
            run_forward, state = _jit(model, forward)
            run_features, _ = _jit(model, features)
            run_decode, _ = _jit(model, decode)
            results.append((run_forward(state, *rows), run_features(state, *rows), run_decode(state, rows[0])))
            programs.append(run_forward.lower(state, *rows).as_text())
    for a, b in zip(jax.tree.leaves(results[0]), jax.tree.leaves(results[1])):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=2e-5)
    # Every layer's own weights, sliced out of their stack, and what a warm start copies of them.
    for i in range(num_layers):
        for a, b in zip(jax.tree.leaves(nnx.state(unrolled.layers[i])), jax.tree.leaves(nnx.state(scanned.layer(i)))):
            np.testing.assert_array_equal(np.asarray(b), np.asarray(a))
    drafter = DFlashDrafter(
        DrafterConfig.for_target(unrolled.cfg, num_layers=1, mask_token_id=1, block_size=4, target_layer_ids=(0,)),
        rngs=nnx.Rngs(0),
    )
    params = nnx.state(drafter)
    warm = [warm_start.from_target_layer(params, warm_start.target_layer_params(m, 3), 3) for m in (unrolled, scanned)]
    for a, b in zip(jax.tree.leaves(warm[0]), jax.tree.leaves(warm[1])):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a))
    # The scanned program holds one period of each scanned segment (plain: 1 layer of 4; hybrid: 5 of 10).
    dots = [program.count("dot_general") for program in programs]
    assert dots[1] <= most_dots * dots[0], dots


@pytest.mark.slow
def test_relayout_moves_the_weights_between_layouts(hybrid_checkpoint):
    kw = dict(param_dtype=jnp.float32, compute_dtype=jnp.float32)
    unrolled = load_target(hybrid_checkpoint, scan_layers=False, **kw)
    scanned = load_target(hybrid_checkpoint, scan_layers=True, **kw)
    before = scanned.layers[0].stacked[1].mlp.up_proj.kernel[...]
    relaid = scanned.relayout(scan_layers=False)
    assert before.is_deleted()  # the stacked weights were given up, not copied
    assert relaid.segments == unrolled.segments
    for a, b in zip(jax.tree.leaves(nnx.state(unrolled)), jax.tree.leaves(nnx.state(relaid))):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a))
    again = relaid.relayout(scan_layers=True)
    assert again.segments == (Segment(0, 4, 2), Segment(8, 1, 2))
    for i in range(unrolled.cfg.num_layers):
        for a, b in zip(jax.tree.leaves(nnx.state(unrolled.layers[i])), jax.tree.leaves(nnx.state(again.layer(i)))):
            np.testing.assert_array_equal(np.asarray(b), np.asarray(a))


def _drafter_inputs(cfg: DrafterConfig, blocks=3, block_size=4):
    keys = jax.random.split(jax.random.key(0), 3)
    anchors = jnp.asarray([[2, 9, 15]])
    ctx_positions = jnp.arange(SEQ)[None]
    return (
        jax.random.normal(keys[0], (1, blocks, block_size, cfg.hidden_size)),
        anchors[..., None] + jnp.arange(block_size),
        jax.random.normal(keys[1], (1, SEQ, cfg.hidden_size)),
        ctx_positions,
        block_context_mask(jnp.ones((1, SEQ), jnp.int32), anchors),
    )


@pytest.fixture(scope="module", params=["dflash", pytest.param("dflash2", marks=pytest.mark.slow)])
def drafters(request):
    """Unrolled and scanned drafters of one kind (DFlash2: convolutions around every sublayer)
    over the same parameters, and the unrolled one's output and gradients."""
    # Three sliding layers then a full one: a scan over the three, the full layer alone.
    cfg = DrafterConfig(
        hidden_size=64,
        intermediate_size=96,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope=RopeConfig(theta=10000.0),
        vocab_size=128,
        num_target_layers=4,
        target_layer_ids=(0, 2),
        mask_token_id=127,
        layer_types=("sliding_attention",) * 3 + ("full_attention",),
        sliding_window=8,
        kind=request.param,
        selector_rank=8,
        selector_top_k=4,
    )
    unrolled = DFlashDrafter(cfg, rngs=nnx.Rngs(0))
    scanned = DFlashDrafter(cfg, scan_layers=True, rngs=nnx.Rngs(0))
    assert scanned.segments == (Segment(0, 1, 3), Segment(3))
    graphdefs = {False: nnx.split(unrolled)[0], True: nnx.split(scanned)[0]}
    params = nnx.split(unrolled)[1]  # the same parameters: the drafter stacks them in the forward pass
    inputs = _drafter_inputs(cfg)

    def loss(params, scan, policy):
        hidden = nnx.merge(graphdefs[scan], params)(*inputs, blocks_per_chunk=2, remat_policy=policy)
        return jnp.sum(hidden * jnp.cos(hidden)), hidden

    grad = jax.jit(jax.grad(loss, has_aux=True), static_argnums=(1, 2))
    with jax.default_matmul_precision("highest"):
        return grad, params, grad(params, False, None)


@pytest.mark.parametrize("policy", [None, *(pytest.param(p, marks=pytest.mark.slow) for p in REMAT_POLICIES)])
def test_scanned_drafter_equals_unrolled_under_every_remat_policy(drafters, policy):
    grad, params, reference = drafters
    with jax.default_matmul_precision("highest"):
        result = grad(params, True, policy)
    for a, b in zip(jax.tree.leaves(reference), jax.tree.leaves(result)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6, err_msg=str(policy))


SHARDED = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from dflash_jax.models import sharding
    from dflash_jax.models.formats.hf import load_target
    from dflash_jax.training.mesh import make_mesh

    kw = dict(param_dtype=jnp.float32, compute_dtype=jnp.float32)
    plain = load_target(path, **kw)
    mesh = make_mesh(1, 4, 2)  # experts over fsdp x tensor: each device runs its own, inside the scan
    scanned = load_target(path, mesh=mesh, scan_layers=True, **kw)
    experts = scanned.layers[1].stacked[0].mlp.experts.gate_proj[...]
    assert experts.sharding.spec == jax.sharding.PartitionSpec(None, ("fsdp", "tensor"), None, None), experts.sharding
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 128, (4, 24)))
    rows = (tokens, jnp.ones_like(tokens), jnp.broadcast_to(jnp.arange(24), tokens.shape))

    def run(model, mesh=None):
        def forward(*rows):
            logits, hidden = model(*rows, hidden_layers=(0, 2, 4))
            return logits, *hidden
        if mesh is None:
            return jax.jit(forward)(*rows)
        with sharding.activation_sharding(mesh):
            return jax.jit(forward)(*rows)

    with jax.default_matmul_precision("highest"):
        expected = run(plain)
        for a, b in zip(expected, run(scanned, mesh)):
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=2e-5)
        relaid = scanned.relayout(scan_layers=False)  # still placed by the rules, layer by layer
        kernel = relaid.layers[2].mlp.experts.gate_proj[...]
        assert kernel.sharding.spec == jax.sharding.PartitionSpec(("fsdp", "tensor"), None, None), kernel.sharding
        for a, b in zip(expected, run(relaid, mesh)):
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=2e-5)
    print("OK")
    """
)


@pytest.mark.slow
def test_scanned_experts_on_a_mesh_equal_one_device(make_hf_checkpoint, tmp_path):
    """A DeepSeek-V3 target loaded stacked onto 8 simulated devices (experts split, so each
    scanned layer runs them expert-parallel) computes what one device does unrolled, and relayout
    keeps every weight where the sharding rules put it."""
    path = make_hf_checkpoint(tmp_path / "ckpt", arch="deepseek_v3", num_hidden_layers=5)
    code = f"path = {str(path)!r}\n" + SHARDED
    result = run_script(code, devices=8, import_dir=str(Path(__file__).resolve().parents[2]))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "OK" in result.stdout
