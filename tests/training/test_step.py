"""The train step: sharding-invariance, learning, and skipping non-finite updates."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from dflash_jax.data.synthetic import packed_batch
from dflash_jax.models.architecture import (
    LatentAttentionConfig,
    LayerAttention,
    MoeConfig,
    RopeConfig,
    TransformerConfig,
)
from dflash_jax.models.drafter_config import DrafterConfig
from dflash_jax.models.transformer import Transformer
from dflash_jax.training import objective, step
from dflash_jax.training.mesh import batch_sharding, make_mesh
from dflash_jax.training.optim.optimizer import OptimizerConfig, make_optimizer

HERE = Path(__file__).resolve().parent

# A learnable toy: every document counts upwards (mod 15), so slot k must predict anchor + k.
VOCAB = 16
TARGET = TransformerConfig(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    rope=RopeConfig(10000.0),
)
# The new kinds of target layer train a drafter too: latent attention with sigmoid-routed experts
# (DeepSeek-V3), and Gemma 4's blocks (experts beside the MLP, full layers with their own heads
# and RoPE, scaled embeddings, soft-capped logits).
TARGETS = {
    "qwen3": TARGET,
    "deepseek_v3": dataclasses.replace(
        TARGET,
        num_kv_heads=4,
        head_dim=4,
        qk_norm=False,
        latent_attention=LatentAttentionConfig(16, 16, 8, 4, 8, softmax_scale=12**-0.5),
        moe=MoeConfig(
            8,
            2,
            16,
            router="sigmoid_grouped",
            num_groups=4,
            groups_kept=2,
            routed_scaling_factor=2.5,
            shared_expert_intermediate_size=16,
            shared_expert_gate=False,
        ),
        moe_layers=(1,),
    ),
    "gemma4": dataclasses.replace(
        TARGET,
        layer_types=("sliding_attention", "full_attention"),
        sliding_window=8,
        block="gemma4",
        mlp_activation="gelu_tanh",
        embedding_scale=32**0.5,
        final_logit_softcap=5.0,
        full_attention=LayerAttention(16, 1, RopeConfig(1e6, kind="proportional", partial_factor=0.25), True),
        moe=MoeConfig(8, 2, 16, activation="geglu"),
        moe_layers=(0, 1),
    ),
}
DRAFTER = DrafterConfig.for_target(TARGET, num_layers=1, mask_token_id=VOCAB - 1, block_size=4)
OBJECTIVE = objective.ObjectiveConfig(
    num_anchors=16,
    loss="dflash",
    dpace_alpha=0.5,  # the paper's, read where a test switches to loss="dpace"
    loss_decay_gamma=4.0,
    attention_chunk_blocks=8,
    lm_head_chunk_blocks=8,
    drafter=DRAFTER,
)
STEPS = 40


@pytest.mark.slow
def test_sharded_steps_match_one_device():
    """data=8, data=2 x fsdp=4 and data=2 x fsdp=2 x tensor=2 (sharded optimizer state; Muon and
    every drafter kind on the last) give the 1-device step."""
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        # Compiling without LLVM optimization halves the time; these tiny steps do not care.
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0",
    }
    result = subprocess.run(
        [sys.executable, str(HERE / "sharded_step_check.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,  # every layout, Muon and the drafter kinds: 14 compiled steps
    )
    assert result.returncode == 0 and "OK" in result.stdout, result.stdout[-3000:] + result.stderr[-3000:]


@pytest.fixture(scope="module", params=["qwen3"])
def trainer(request):
    target_cfg = TARGETS[request.param]
    mesh = make_mesh(1, 1)
    graphdef, target_params = nnx.split(nnx.eval_shape(lambda: Transformer(target_cfg, rngs=nnx.Rngs(1))))
    target_params = jax.jit(
        lambda: nnx.split(Transformer(target_cfg, rngs=nnx.Rngs(1)))[1],
        out_shardings=NamedSharding(mesh, PartitionSpec()),
    )()
    tx = make_optimizer(OptimizerConfig(learning_rate=3e-2, warmup_fraction=0.1), STEPS)

    def new_state():
        return step.init_train_state(DRAFTER, tx, seed=0, compute_dtype=jnp.float32, mesh=mesh)

    train_step = step.make_train_step(
        drafter_graphdef=step.drafter_graph(DRAFTER, jnp.float32),
        target_graphdef=graphdef,
        target_params=target_params,
        tx=tx,
        cfg=OBJECTIVE,
        grad_accum_steps=1,
        mesh=mesh,
        state_sharding=jax.tree.map(lambda x: x.sharding, new_state()),
    )

    def batch(seed):
        data = packed_batch(np.random.default_rng(seed), 4, 64, VOCAB - 1, counting=True)
        return jax.device_put(data, batch_sharding(mesh))

    return new_state, train_step, target_params, batch


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["dflash", "dpace"])
def test_gradient_accumulation_gives_the_update_of_one_big_batch(loss):
    """Σw·CE over the global batch divided by its global denominator (Σw for 'dflash', documents
    for 'dpace'): 1 x 16 rows and 4 x 4 rows give the same update (with plain SGD, so the update
    is the gradient itself)."""
    mesh = make_mesh(1, 1)
    graphdef, target_params = nnx.split(Transformer(TARGET, rngs=nnx.Rngs(1)))
    tx = optax.sgd(1.0)
    batch = jax.device_put(packed_batch(np.random.default_rng(5), 16, 64, VOCAB - 1), batch_sharding(mesh))
    updates, sums = [], []
    for accum in (1, 4):
        state = step.init_train_state(DRAFTER, tx, seed=0, compute_dtype=jnp.float32, mesh=mesh)
        before = jax.device_get(state.params)
        train_step = step.make_train_step(
            drafter_graphdef=step.drafter_graph(DRAFTER, jnp.float32),
            target_graphdef=graphdef,
            target_params=target_params,
            tx=tx,
            cfg=dataclasses.replace(OBJECTIVE, loss=loss),
            grad_accum_steps=accum,
            mesh=mesh,
            state_sharding=jax.tree.map(lambda x: x.sharding, state),
        )
        with jax.default_matmul_precision("highest"):
            state, metrics = train_step(state, target_params, batch)
        updates.append(jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), jax.device_get(state.params), before))
        sums.append(jax.device_get(metrics))
    assert sums[0]["weight"] > 0
    for key in ("weighted_ce", "weight", "slot_hits", "tau_sum", "blocks"):
        np.testing.assert_allclose(sums[1][key], sums[0][key], rtol=1e-5, err_msg=key)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7), updates[1], updates[0])
    assert max(float(np.abs(u).max()) for u in jax.tree.leaves(updates[0])) > 1e-4  # a real update


def test_muon_orthogonalizes_matrix_updates_at_adamw_size_and_decays_matrices_only():
    """train.optimizer='muon': a matrix's update has a flat spectrum (Newton-Schulz) whatever the
    gradient's, and about AdamW's RMS (0.2·lr), so one learning rate serves both; vectors get
    AdamW's sign-like first step; weight decay shrinks matrices, never norm scales."""
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(64, 32)), jnp.float32), "scale": jnp.ones(32)}
    skewed = np.outer(rng.normal(size=64), rng.normal(size=32)) + 0.01 * rng.normal(size=(64, 32))
    grads = {"w": jnp.asarray(skewed, jnp.float32), "scale": jnp.asarray(rng.normal(size=32), jnp.float32)}
    lr = 1e-2
    cfg = OptimizerConfig(optimizer="muon", learning_rate=lr, warmup_fraction=0.0, weight_decay=0.1, grad_clip_norm=1e9)
    tx = make_optimizer(cfg, 10)
    updates, _ = tx.update(grads, tx.init(params), params)

    def spread(m):
        singular = np.linalg.svd(np.asarray(m), compute_uv=False)
        return singular.max() / singular.min()

    assert spread(grads["w"]) > 1000 and spread(updates["w"]) < 5
    rms = float(np.sqrt(np.mean(np.asarray(updates["w"]) ** 2)))
    assert 0.15 * lr < rms < 0.25 * lr, rms
    np.testing.assert_array_equal(np.sign(updates["scale"]), -np.sign(grads["scale"]))
    zero = jax.tree.map(jnp.zeros_like, grads)
    decayed, _ = tx.update(zero, tx.init(params), params)
    np.testing.assert_allclose(decayed["w"], -lr * 0.1 * params["w"], rtol=1e-5)
    np.testing.assert_array_equal(decayed["scale"], np.zeros(32))


@pytest.mark.slow
@pytest.mark.parametrize("trainer", list(TARGETS), indirect=True)
def test_loss_decreases_and_tau_train_rises(trainer):
    new_state, train_step, target_params, batch = trainer
    state, history = new_state(), []
    for i in range(STEPS):
        state, metrics = train_step(state, target_params, batch(i))
        history.append(jax.device_get(metrics))

    def window(steps):
        return objective.summarize(jax.tree.map(lambda *x: np.sum(x, axis=0), *steps))

    first, last = window(history[:10]), window(history[-10:])
    assert last["loss"] < 0.6 * first["loss"], (first, last)
    assert last["tau_train"] > first["tau_train"] + 0.5, (first, last)
    assert int(state.step) == STEPS and int(state.skipped_updates) == 0


def test_non_finite_step_is_skipped_and_counted(trainer):
    new_state, train_step, target_params, batch = trainer
    poisoned = jax.tree.map(lambda x: x * jnp.nan, target_params)  # NaN features -> NaN loss
    state = new_state()
    before = jax.device_get((state.params, state.opt_state))

    state, metrics = train_step(state, poisoned, batch(0))
    after = jax.device_get((state.params, state.opt_state))
    jax.tree.map(np.testing.assert_array_equal, after, before)
    assert (int(state.step), int(state.skipped_updates), int(state.nonfinite_streak)) == (1, 1, 1)
    assert float(metrics["updates_applied"]) == 0 and np.isfinite(float(metrics["weighted_ce"]))

    state, metrics = train_step(state, target_params, batch(1))
    assert (int(state.step), int(state.skipped_updates), int(state.nonfinite_streak)) == (2, 1, 0)
    assert float(metrics["updates_applied"]) == 1
    # Applied: the optimizer moments moved (the weights too, once warmup's lr leaves 0).
    assert not all(jax.tree.leaves(jax.tree.map(np.array_equal, jax.device_get(state.opt_state), before[1])))


@pytest.mark.parametrize("attention, kernels", [("xla", False), ("fused", True)])
def test_the_configured_attention_code_is_what_the_step_traces(attention, kernels):
    target_cfg = dataclasses.replace(TARGET, head_dim=16)  # the fused kernels need head_dim >= 16
    drafter_cfg = DrafterConfig.for_target(target_cfg, num_layers=1, mask_token_id=VOCAB - 1, block_size=4)
    mesh = make_mesh(1, 1)
    graphdef, target_params = nnx.split(Transformer(target_cfg, attention=attention, rngs=nnx.Rngs(1)))
    state = step.init_train_state(drafter_cfg, optax.sgd(1.0), seed=0, compute_dtype=jnp.float32, mesh=mesh)
    train_step = step.make_train_step(
        drafter_graphdef=step.drafter_graph(drafter_cfg, jnp.float32, attention),
        target_graphdef=graphdef,
        target_params=target_params,
        tx=optax.sgd(1.0),
        cfg=dataclasses.replace(OBJECTIVE, drafter=drafter_cfg),
        grad_accum_steps=1,
        mesh=mesh,
        state_sharding=jax.tree.map(lambda x: x.sharding, state),
    )
    batch = jax.device_put(packed_batch(np.random.default_rng(0), 4, 64, VOCAB - 1), batch_sharding(mesh))
    assert ("pallas_call" in str(jax.make_jaxpr(train_step)(state, target_params, batch))) == kernels


def test_weight_average_follows_its_recursion_and_is_what_is_served():
    from dflash_jax.training.optim.ema import served_params

    params = {"w": jnp.ones((2, 3)), "scale": jnp.zeros(3)}
    tx = make_optimizer(OptimizerConfig(optimizer="adamw", learning_rate=0.1, ema_decay=0.9), 10)
    state = tx.init(params)
    expected = params
    for t in range(1, 5):
        grads = jax.tree.map(lambda p, t=t: jnp.full_like(p, t) * jnp.arange(p.size).reshape(p.shape), params)
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        rate = min(0.9, (1 + t) / (10 + t))  # the ramp: early weights fade fast
        expected = jax.tree.map(lambda e, p, r=rate: r * e + (1 - r) * p, expected, params)
    served = served_params(params, state)
    for got, want in zip(jax.tree.leaves(served), jax.tree.leaves(expected)):
        np.testing.assert_allclose(got, want, rtol=1e-6)
    assert not np.allclose(served["w"], params["w"])
    # Without the option the last weights are served, and the state holds no average.
    plain = make_optimizer(OptimizerConfig(optimizer="adamw"), 10)
    assert served_params(params, plain.init(params)) is params


def test_a_clip_left_to_the_kind_is_the_papers_where_the_kind_sets_none():
    """grad_clip_norm 0 (a kind without its own, or an OptimizerConfig built by hand) clips at the
    paper's 1.0: AdamW's updates are then those of 1.0, and not those of no clip (a large gradient
    clipped, then a small one, move AdamW's moments otherwise than unclipped)."""

    def updates(clip: float) -> list[np.ndarray]:
        params = {"w": jnp.zeros((2, 3))}
        tx = make_optimizer(OptimizerConfig(learning_rate=0.1, warmup_fraction=0.0, grad_clip_norm=clip), 10)
        state, out = tx.init(params), []
        for scale in (100.0, 0.01):
            grads = {"w": scale * jnp.arange(1.0, 7.0).reshape(2, 3)}
            update, state = tx.update(grads, state, params)
            out.append(np.asarray(update["w"]))
        return out

    unset, paper, none = updates(0.0), updates(1.0), updates(1e9)
    for got, want in zip(unset, paper):
        np.testing.assert_array_equal(got, want)
    assert not np.allclose(unset[1], none[1])


def test_muon_leaves_vocabulary_tables_to_adamw():
    from dflash_jax.models import kinds
    from dflash_jax.training.optim.muon import muon_labels

    params = {
        "layers": {"0": {"mlp": {"kernel": jnp.zeros((4, 6)), "scale": jnp.zeros(4)}}},
        "candidate_selector": {"predecessor_codebook": jnp.zeros((50, 8)), "hidden_projection": jnp.zeros((4, 8))},
        "markov_head": {"markov_w1": {"embedding": jnp.zeros((50, 8))}, "markov_w2": {"kernel": jnp.zeros((8, 50))}},
        "xpress_head": {
            "w1": {"embedding": jnp.zeros((50, 8))},
            "w2": {"kernel": jnp.zeros((8, 50))},
            "in_proj": {"kernel": jnp.zeros((24, 8))},
            "mix": {"L": jnp.zeros((8, 4, 4))},
        },
    }
    adam_params = (*kinds.get("dflash2").adam_params, *kinds.get("dspark").adam_params)
    labels = muon_labels(params, (*adam_params, *kinds.get("xpress").adam_params))
    assert labels["layers"]["0"]["mlp"] == {"kernel": "muon", "scale": "adam"}
    assert labels["candidate_selector"] == {"predecessor_codebook": "adam", "hidden_projection": "muon"}
    assert labels["markov_head"] == {"markov_w1": {"embedding": "adam"}, "markov_w2": {"kernel": "adam"}}
    assert labels["xpress_head"] == {
        "w1": {"embedding": "adam"},
        "w2": {"kernel": "adam"},
        "in_proj": {"kernel": "muon"},
        "mix": {"L": "adam"},  # not a matrix
    }


def test_a_drafter_started_from_a_target_layer_holds_its_weights():
    drafter_cfg = DrafterConfig.for_target(
        TARGET, num_layers=2, mask_token_id=VOCAB - 1, block_size=4, target_layer_ids=(0, 1)
    )
    target = Transformer(TARGET, rngs=nnx.Rngs(1))
    _, target_params = nnx.split(target)
    mesh = make_mesh(1, 1)
    kw = dict(seed=0, compute_dtype=jnp.float32, mesh=mesh)
    fresh = step.init_train_state(drafter_cfg, optax.sgd(1.0), **kw).params
    started = step.init_train_state(
        drafter_cfg, optax.sgd(1.0), target_params=target_params, init_from_target_layer=1, **kw
    ).params
    for i in range(2):  # every drafter layer: target layer 1's attention, MLP and norms
        layer, source = started["layers"][i], target_params["layers"][1]
        for path in (
            ("self_attn", "q_proj", "kernel"),
            ("self_attn", "k_norm", "weight"),
            ("mlp", "down_proj", "kernel"),
        ):
            a, b = layer, source
            for name in path:
                a, b = a[name], b[name]
            np.testing.assert_array_equal(a[...], b[...])
    np.testing.assert_array_equal(started["norm"]["weight"][...], target_params["norm"]["weight"][...])
    # What the target has no counterpart for keeps the random init.
    np.testing.assert_array_equal(started["fc"]["kernel"][...], fresh["fc"]["kernel"][...])
    assert not np.array_equal(
        started["layers"][0]["mlp"]["up_proj"]["kernel"][...], fresh["layers"][0]["mlp"]["up_proj"]["kernel"][...]
    )
