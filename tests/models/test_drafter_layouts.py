"""Drafters shaped like the released ones: per-layer `layer_types` with sliding-window layers
(SpecForge's DFlash mask), heads of their own, and their export format."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from transformers import Qwen3Config

from dflash_jax.data.synthetic import packed_batch
from dflash_jax.errors import ConfigError
from dflash_jax.models.architecture import RopeConfig, TransformerConfig
from dflash_jax.models.drafter import DFlashDrafter
from dflash_jax.models.drafter_config import DrafterConfig
from dflash_jax.models.formats.hf import load_drafter
from dflash_jax.models.layers.block_attention import block_attention, block_context_mask
from dflash_jax.models.transformer import Transformer
from dflash_jax.training import objective, step
from dflash_jax.training.config.run_config import resolve
from dflash_jax.training.config.schema import base_config
from dflash_jax.training.drafters import export_params
from dflash_jax.training.mesh import batch_sharding, make_mesh
from support import training_runs
from support.dflash_mask import block_attention_under, dflash_training_mask

S, F = "sliding_attention", "full_attention"
BLOCK = 4
# Row: document 1 at 0..13, document 2 at 14..21, padding at 22..23 (as tests/models/test_drafter.py).
SEG = np.array([1] * 14 + [2] * 8 + [0] * 2)
POS = np.concatenate([np.arange(14), np.arange(8), [0, 0]])
ANCHORS = np.array([5, 10, 16])
DOC_START = np.array([0, 0, 14])


@pytest.mark.parametrize(
    "window, causal, implementation",
    [
        (6, True, "xla"),  # a sliding layer: window longer than the block
        (0, True, "xla"),  # full layers of a config with is_causal=true
        (6, False, "xla"),  # sliding layers of a config with is_causal=false
        # A window shorter than the block bounds the block too; the fused kernel has no window
        # (such layers run XLA).
        (3, True, "fused"),
    ],
)
def test_block_attention_follows_specforge_mask_with_gradients(window, causal, implementation):
    rng = np.random.default_rng(0)
    b, n, kv, g, h = 2, 5, 2, 2, 16
    seg = np.repeat(SEG[None], b, 0)
    anchors = np.stack([rng.choice(np.flatnonzero(SEG), n, replace=False) for _ in range(b)])
    q, k_blk, v_blk = (jnp.asarray(rng.normal(size=(b, n, BLOCK, heads, h)), jnp.float32) for heads in (kv * g, kv, kv))
    k_ctx, v_ctx = (jnp.asarray(rng.normal(size=(b, len(SEG), kv, h)), jnp.float32) for _ in range(2))
    positions = jnp.asarray(POS[anchors][..., None] + np.arange(BLOCK))
    ctx_positions = jnp.asarray(np.repeat(POS[None], b, 0))
    ctx_mask = block_context_mask(jnp.asarray(seg), jnp.asarray(anchors))
    reference_mask = dflash_training_mask(seg, anchors, BLOCK, window=window, causal=causal)

    def loss(args, ours):
        if ours:
            out = block_attention(
                *args,
                ctx_mask,
                blocks_per_chunk=2,
                implementation=implementation,
                window=window,
                causal=causal,
                positions=positions,
                ctx_positions=ctx_positions,
            )
        else:
            out = block_attention_under(*args, reference_mask)
        return jnp.sum(jnp.sin(out)), out

    args = (q, k_ctx, v_ctx, k_blk, v_blk)
    with jax.default_matmul_precision("highest"):
        (_, expected), expected_grads = jax.value_and_grad(loss, has_aux=True)(args, False)
        (_, out), grads = jax.value_and_grad(loss, has_aux=True)(args, True)
    np.testing.assert_allclose(out, expected, atol=1e-5)
    for ours, reference in zip(grads, expected_grads):
        np.testing.assert_allclose(ours, reference, atol=1e-4, rtol=1e-4)


def sliding_drafter(**fields) -> DFlashDrafter:
    cfg = DrafterConfig(
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope=RopeConfig(10000.0),
        vocab_size=128,
        num_target_layers=4,
        target_layer_ids=(0, 2),
        mask_token_id=127,
        block_size=BLOCK,
        layer_types=(S, S),
        sliding_window=6,
        **fields,
    )
    return DFlashDrafter(cfg, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def drafter():
    return sliding_drafter()


@pytest.fixture(scope="module")
def inputs():
    rng = np.random.default_rng(1)
    features = jnp.asarray(rng.normal(size=(1, len(SEG), 2 * 64)), jnp.float32)
    embeds = jnp.asarray(rng.normal(size=(1, len(ANCHORS), BLOCK, 64)), jnp.float32)
    return features, embeds, jnp.asarray(POS[ANCHORS][None, :, None] + np.arange(BLOCK))


@nnx.jit
def train_forward(drafter, features, embeds, block_positions):
    mask = block_context_mask(jnp.asarray(SEG)[None], jnp.asarray(ANCHORS)[None])
    with jax.default_matmul_precision("highest"):
        return drafter(
            embeds, block_positions, drafter.context(features), jnp.asarray(POS)[None], mask, blocks_per_chunk=2
        )


@nnx.jit
def decode_block(drafter, features, embeds, block_positions, n):
    """Block n drafted against a cache of its document's context before the anchor."""
    start, anchor = jnp.asarray(DOC_START)[n], jnp.asarray(ANCHORS)[n]
    # One write of a fixed 16 slots of which the context before the anchor is kept.
    written = jax.lax.dynamic_slice_in_dim(jnp.pad(features, ((0, 0), (0, 16), (0, 0))), start, 16, axis=1)
    with jax.default_matmul_precision("highest"):
        cache = drafter.new_cache(1, 32)
        cache = drafter.extend_context(cache, written, jnp.arange(16)[None], jnp.array([anchor - start]))
        return drafter.decode(embeds[:, n], block_positions[:, n], cache)


def block_one(drafter, features, embeds, block_positions):
    """Block 1 (anchor 10) from the training forward and from decoding: [L, D] each."""
    return (
        train_forward(drafter, features, embeds, block_positions)[0, 1],
        decode_block(drafter, features, embeds, block_positions, 1)[0],
    )


def test_sliding_layers_decode_as_they_train(drafter, inputs):
    trained = train_forward(drafter, *inputs)
    for n in range(len(ANCHORS)):
        np.testing.assert_allclose(decode_block(drafter, *inputs, n), trained[:, n], atol=1e-5)


@pytest.mark.parametrize(
    "position, changes",
    [
        (4, False),  # anchor 10, window 6: offset 0 sees 5..9, offset 3 only 8 and 9
        (5, True),
        (9, True),
    ],
)
def test_sliding_context_window_ends_at_the_anchor(drafter, inputs, position, changes):
    features, embeds, block_positions = inputs
    base = block_one(drafter, features, embeds, block_positions)
    bumped = block_one(drafter, features.at[0, position].add(1.0), embeds, block_positions)
    for before, after in zip(base, bumped):  # training, decoding
        delta = np.abs(np.asarray(after - before)).max(-1)  # per block offset
        if changes:
            assert delta[0] > 1e-4
        else:
            assert (delta == 0).all()


def test_sliding_layers_see_their_block_causally(drafter, inputs):
    features, embeds, block_positions = inputs
    base = block_one(drafter, features, embeds, block_positions)
    bumped = block_one(drafter, features, embeds.at[0, 1, 2].add(1.0), block_positions)  # offset 2
    for before, after in zip(base, bumped):  # training, decoding
        np.testing.assert_array_equal(after[:2], before[:2])
        assert float(jnp.abs(after[2:] - before[2:]).max()) > 1e-4


def test_is_causal_false_lets_sliding_layers_see_their_whole_block(inputs):
    features, embeds, block_positions = inputs
    drafter = sliding_drafter(is_causal=False)
    base = train_forward(drafter, features, embeds, block_positions)
    out = train_forward(drafter, features, embeds.at[0, 1, 2].add(1.0), block_positions)
    assert float(jnp.abs(out[0, 1, :2] - base[0, 1, :2]).max()) > 1e-4


# A released-style drafter config.json (z-lab's and SpecForge's Qwen3.5 drafters), tiny.
RELEASED = {
    "architectures": ["DFlashDraftModel"],
    "model_type": "qwen3",
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 5,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "layer_types": [S, S, S, S, F],
    "max_window_layers": 5,
    "use_sliding_window": True,
    "sliding_window": 8,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_theta": 10000000.0, "rope_type": "default"},
    "vocab_size": 128,
    "max_position_embeddings": 262144,
    "tie_word_embeddings": False,
    "num_target_layers": 6,
    "dflash_config": {"block_size": 4, "mask_token_id": 127, "target_layer_ids": [1, 3, 5]},
}


def test_released_config_reads_as_transformers_reads_it():
    cfg = DrafterConfig.from_hf(RELEASED)
    assert cfg.layer_types == (S, S, S, S, F) and cfg.sliding_window == 8 and cfg.is_causal is None
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.block_size) == (4, 2, 32, 4)
    assert [cfg.attention_pattern(i) for i in range(5)] == [(8, True)] * 4 + [(0, False)]
    # Without layer_types, transformers' Qwen3Config makes the layers from max_window_layers on sliding.
    implicit = {k: v for k, v in RELEASED.items() if k != "layer_types"} | {"max_window_layers": 3}
    assert list(DrafterConfig.from_hf(implicit).layer_types) == Qwen3Config(**implicit).layer_types
    # transformers drops the window unless use_sliding_window: sliding layers then have none.
    with pytest.raises(ValueError, match="use_sliding_window=true"):
        DrafterConfig.from_hf(RELEASED | {"use_sliding_window": False})
    assert DrafterConfig.from_hf(RELEASED | {"is_causal": False}).attention_pattern(0) == (8, False)


def test_export_writes_what_transformers_and_specforge_read():
    cfg = DrafterConfig.from_hf(RELEASED | {"is_causal": True})
    hf = cfg.to_hf()
    assert hf["layer_types"] == RELEASED["layer_types"]
    assert (hf["use_sliding_window"], hf["sliding_window"], hf["is_causal"]) == (True, 8, True)
    read = Qwen3Config(**hf)
    assert (read.layer_types, read.sliding_window) == (RELEASED["layer_types"], 8)
    assert DrafterConfig.from_hf(json.loads(json.dumps(hf))) == cfg
    full = DrafterConfig.from_hf(RELEASED | {"layer_types": [F] * 5, "use_sliding_window": False}).to_hf()
    assert (full["use_sliding_window"], full["sliding_window"], "is_causal" in full) == (False, None, False)
    assert Qwen3Config(**full).layer_types == [F] * 5


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"layer_types": (S, F)}, "layer_types has 2 entries for num_layers=5"),
        ({"layer_types": (S, S, S, S, "linear_attention")}, r"\['linear_attention'\] are not supported"),
        ({"sliding_window": 0}, "sliding_attention layers need a sliding_window > 0"),
        ({"sliding_window": -1}, "sliding_window=-1 must be at least 0"),
    ],
)
def test_layout_errors(fields, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(DrafterConfig.from_hf(RELEASED), **fields)


def test_training_config_fields_reach_the_drafter():
    config = base_config()
    config.target.path = str(training_runs.REPO / "assets" / "tiny-qwen3")
    config.drafter.num_layers = 3
    config.drafter.layer_types = (S, S, F)
    config.drafter.sliding_window = 8
    setup = resolve(config, num_devices=1, check_files=False)
    assert (setup.drafter.layer_types, setup.drafter.sliding_window) == ((S, S, F), 8)
    config.drafter.layer_types = (S, F)
    with pytest.raises(ConfigError, match=r"^drafter.layer_types has 2 entries for num_layers=3$"):
        resolve(config, num_devices=1, check_files=False)


@pytest.mark.slow
def test_released_layout_trains_one_step_exports_and_loads_back(tmp_path):
    """5 layers [S,S,S,S,F], 4/2 heads x 32 on a target with 2/1 heads x 64 (released drafters:
    32/8 x 128 on 24/4 x 256), reading 2 target layers."""
    target_cfg = TransformerConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=64,
        rope=RopeConfig(10000.0),
    )
    cfg = DrafterConfig.for_target(
        target_cfg,
        num_layers=5,
        mask_token_id=127,
        block_size=BLOCK,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        target_layer_ids=(0, 1),
        layer_types=(S, S, S, S, F),
        sliding_window=8,
    )
    mesh = make_mesh(1, 1)
    graphdef, target_params = nnx.split(Transformer(target_cfg, rngs=nnx.Rngs(1)))
    tx = optax.sgd(1e-2)
    state = step.init_train_state(cfg, tx, seed=0, compute_dtype=jnp.float32, mesh=mesh)
    before = jax.device_get(state.params)
    train_step = step.make_train_step(
        drafter_graphdef=step.drafter_graph(cfg, jnp.float32),
        target_graphdef=graphdef,
        target_params=target_params,
        tx=tx,
        cfg=objective.ObjectiveConfig(num_anchors=8, loss="dflash", loss_decay_gamma=4.0, dpace_alpha=0.5, drafter=cfg),
        grad_accum_steps=1,
        mesh=mesh,
        state_sharding=jax.tree.map(lambda x: x.sharding, state),
    )
    batch = jax.device_put(packed_batch(np.random.default_rng(0), 2, 48, 127), batch_sharding(mesh))
    state, metrics = train_step(state, target_params, batch)
    assert float(metrics["updates_applied"]) == 1 and float(metrics["weight"]) > 0
    moved = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - b).max()), jax.device_get(state.params), before)
    assert min(jax.tree.leaves(moved)) > 0  # every weight, the sliding layers' included, trained

    out = tmp_path / "export"
    export_params(cfg, state.params, str(out), dtype=jnp.float32)
    written = json.loads((out / "config.json").read_text())
    assert written["layer_types"] == [S, S, S, S, F] and written["sliding_window"] == 8
    assert (written["num_attention_heads"], written["num_key_value_heads"], written["head_dim"]) == (4, 2, 32)
    assert written["dflash_config"]["target_layer_ids"] == [0, 1] and written["num_target_layers"] == 2
    loaded = load_drafter(out)
    assert loaded.cfg == cfg
    jax.tree.map(np.testing.assert_array_equal, nnx.split(loaded)[1], jax.device_get(state.params))
