"""Target LM behaviour beyond parity: packed rows, early stop, KV-cached decoding, load errors."""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from dflash_jax.models.architecture import RopeConfig
from dflash_jax.models.formats.hf import load_target
from dflash_jax.models.layers.basic import rotary


@pytest.fixture(scope="module")
def target(qwen3_checkpoint):
    return load_target(qwen3_checkpoint, param_dtype=jnp.float32, compute_dtype=jnp.float32)


def _run(model, tokens, segment_ids, positions, **kw):
    with jax.default_matmul_precision("highest"):
        return model(jnp.asarray(tokens)[None], jnp.asarray(segment_ids)[None], jnp.asarray(positions)[None], **kw)


@pytest.mark.slow
def test_packed_document_equals_document_alone(target):
    rng = np.random.default_rng(0)
    doc_a, doc_b = rng.integers(0, 128, 10), rng.integers(0, 128, 7)
    row = np.concatenate([doc_a, doc_b, [0, 0, 0]])
    seg = np.array([1] * 10 + [2] * 7 + [0] * 3)
    pos = np.concatenate([np.arange(10), np.arange(7), [0, 0, 0]])
    packed, _ = _run(target, row, seg, pos)
    alone, _ = _run(target, doc_a, np.ones(10, int), np.arange(10))
    np.testing.assert_allclose(packed[0, :10], alone[0], atol=1e-5)
    # B as the second document behaves like B alone (positions restart per document).
    b_alone, _ = _run(target, doc_b, np.ones(7, int), np.arange(7))
    np.testing.assert_allclose(packed[0, 10:17], b_alone[0], atol=1e-5)
    # Perturbing B changes nothing in A; padding rows stay finite.
    row2 = row.copy()
    row2[10:17] = rng.integers(0, 128, 7)
    packed2, _ = _run(target, row2, seg, pos)
    np.testing.assert_array_equal(np.asarray(packed2[0, :10]), np.asarray(packed[0, :10]))
    assert np.isfinite(np.asarray(packed)).all()


@pytest.mark.parametrize("rope", [RopeConfig(1_000_000.0), RopeConfig(500_000.0, kind="llama3", factor=8.0)])
def test_rope_table_rows_equal_the_tables_of_the_positions(rope):
    positions = jnp.array([[0, 5, 3, 9], [1, 2, 0, 0]])
    direct = jax.jit(lambda p: rotary(p, rope, 64))(positions)
    gathered = jax.jit(lambda p: rotary(p, rope, 64, num_positions=10))(positions)
    for d, g in zip(direct, gathered):
        assert g.shape == d.shape == (2, 4, 1, 64)
        np.testing.assert_allclose(g, d, rtol=0, atol=1e-6)
    # A position past the bound is an error made loud, not a wrapped or clipped angle.
    past = rotary(jnp.array([[3, 10]]), rope, 64, num_positions=10)
    assert np.isfinite(past.cos[0, 0]).all() and np.isnan(past.cos[0, 1]).all() and np.isnan(past.sin[0, 1]).all()


def test_features_stop_after_last_requested_layer(target):
    tokens = np.arange(12) % 128
    # Compiled, not op by op: the same values, in a fraction of the time.
    _, hidden = jax.jit(lambda t: _run(target, t, np.ones(12, int), np.arange(12), hidden_layers=(0, 2)))(tokens)
    features = jax.jit(lambda t: target.features(t[None], jnp.ones((1, 12), jnp.int32), jnp.arange(12)[None], (0, 2)))(
        jnp.asarray(tokens)
    )
    np.testing.assert_allclose(features, jnp.concatenate(hidden, -1), atol=1e-6)
    # Stopping early means layer 3 never runs: 3 layers' matmuls of the 4 and the LM head's.
    jaxpr = jax.make_jaxpr(lambda t: target.features(t, jnp.ones((1, 12), jnp.int32), jnp.arange(12)[None], (0, 2)))(
        jnp.asarray(tokens)[None]
    )
    full = jax.make_jaxpr(lambda t: target(t, jnp.ones((1, 12), jnp.int32), jnp.arange(12)[None])[0])(
        jnp.asarray(tokens)[None]
    )
    assert _matmuls_run(jaxpr.jaxpr) < 0.8 * _matmuls_run(full.jaxpr)


def _matmuls_run(jaxpr) -> int:
    """The dot_generals a jaxpr runs: those inside a scan (the target's scanned layers) times its length."""
    count = 0
    for eqn in jaxpr.eqns:
        count += eqn.primitive.name == "dot_general"
        times = eqn.params["length"] if eqn.primitive.name == "scan" else 1
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)  # a ClosedJaxpr's jaxpr, or a Jaxpr
            if hasattr(inner, "eqns"):
                count += times * _matmuls_run(inner)
    return count


@pytest.mark.slow
def test_prefill_and_cached_steps_match_full_forward(target):
    tokens = np.random.default_rng(3).integers(0, 128, 20)
    full, hidden = _run(target, tokens, np.ones(20, int), np.arange(20), hidden_layers=(1, 3))
    cache = target.new_cache(1, 32)
    with jax.default_matmul_precision("highest"):
        logits_a, feats_a, cache = target.decode(jnp.asarray(tokens[:11])[None], cache, feature_layers=(1, 3))
        # A rejected draft: write 4 garbage tokens, then roll back to the accepted length.
        _, _, junk = target.decode(jnp.asarray([[5, 6, 7, 8]]), cache)
        cache = junk.replace(lengths=cache.lengths)
        logits_b, feats_b, cache = target.decode(jnp.asarray(tokens[11:16])[None], cache, feature_layers=(1, 3))
        logits_c, _, cache = target.decode(jnp.asarray(tokens[16:])[None], cache)
    np.testing.assert_allclose(jnp.concatenate([logits_a, logits_b, logits_c], 1), full, atol=1e-4)
    np.testing.assert_allclose(jnp.concatenate([feats_a, feats_b], 1), jnp.concatenate(hidden, -1)[:, :16], atol=1e-4)
    assert int(cache.lengths[0]) == 20


def test_load_errors_name_the_problem(qwen3_checkpoint, tmp_path):
    bad_arch = tmp_path / "arch"
    shutil.copytree(qwen3_checkpoint, bad_arch)
    cfg = json.loads((bad_arch / "config.json").read_text())
    cfg["architectures"] = ["MistralForCausalLM"]
    (bad_arch / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported target architecture"):
        load_target(bad_arch)

    missing = tmp_path / "missing"
    shutil.copytree(qwen3_checkpoint, missing)
    tensors = load_file(missing / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, missing / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        load_target(missing)

    shape = tmp_path / "shape"
    shutil.copytree(qwen3_checkpoint, shape)
    tensors = load_file(shape / "model.safetensors")
    tensors["model.norm.weight"] = np.ones(3, np.float32)
    save_file(tensors, shape / "model.safetensors")
    with pytest.raises(ValueError, match=r"'model\.norm\.weight' has shape \(3,\), expected \(64,\)"):
        load_target(shape)

    with pytest.raises(FileNotFoundError, match="config.json"):
        load_target(tmp_path / "nowhere")


@pytest.mark.slow
def test_sharded_index_checkpoint_loads(qwen3_checkpoint, tmp_path):
    """Sharded checkpoints (`model.safetensors.index.json`) load like single-file ones."""
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    shutil.copy(f"{qwen3_checkpoint}/config.json", sharded)
    tensors = load_file(f"{qwen3_checkpoint}/model.safetensors")
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, part in halves.items():
        save_file({n: tensors[n] for n in part}, sharded / file)
        weight_map.update({n: file for n in part})
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    a = load_target(qwen3_checkpoint, param_dtype=jnp.float32)
    b = load_target(sharded, param_dtype=jnp.float32)
    tokens = jnp.arange(8)[None]
    ones = jnp.ones((1, 8), jnp.int32)
    np.testing.assert_array_equal(a(tokens, ones, tokens)[0], b(tokens, ones, tokens)[0])
