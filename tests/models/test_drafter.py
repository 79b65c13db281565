"""The DFlash drafter follows docs/design.md §2-§5: mask semantics, chunked attention, decoding, export."""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.numpy import load_file

from dflash_jax.models.drafter import DFlashDrafter
from dflash_jax.models.drafter_config import DrafterConfig, default_target_layer_ids
from dflash_jax.models.formats.hf import export_drafter, load_drafter, load_target
from dflash_jax.models.layers.block_attention import block_attention, block_context_mask
from support.reference_attention import block_attention_dense

BLOCK = 4
MASK_ID = 127
LAYER_IDS = (0, 2)
# Row: document 1 at 0..13, document 2 at 14..21, padding at 22..23.
SEG = np.array([1] * 14 + [2] * 8 + [0] * 2)
POS = np.concatenate([np.arange(14), np.arange(8), [0, 0]])
ANCHORS = np.array([5, 10, 16])


@pytest.fixture(scope="module")
def target(qwen3_checkpoint):
    return load_target(qwen3_checkpoint, param_dtype=jnp.float32, compute_dtype=jnp.float32)


def make_drafter(target, seed=0, num_layers=2):
    cfg = DrafterConfig.for_target(
        target.cfg,
        num_layers=num_layers,
        mask_token_id=MASK_ID,
        block_size=BLOCK,
        target_layer_ids=LAYER_IDS,
    )
    drafter = DFlashDrafter(cfg, rngs=nnx.Rngs(seed))
    # Norm weights start at 1; perturb them so a mis-wired norm cannot go unnoticed.
    for path, var in nnx.to_flat_state(nnx.state(drafter, nnx.Param)):
        if path[-1] == "weight":
            var[...] = var[...] + 0.1 * jax.random.normal(jax.random.key(len(path)), var.shape)
    return drafter


@pytest.fixture(scope="module")
def drafter(target):
    return make_drafter(target)


def block_inputs(target, tokens):
    anchors = jnp.asarray(ANCHORS)[None]
    blocks = jnp.concatenate(
        [jnp.asarray(tokens)[anchors][..., None], jnp.full((1, len(ANCHORS), BLOCK - 1), MASK_ID)], -1
    )
    positions = jnp.asarray(POS)[anchors][..., None] + jnp.arange(BLOCK)
    return target.embed(blocks), positions


def draft_hidden(target, drafter, tokens, features=None, blocks_per_chunk=2):
    """The drafter's hidden states for the row's blocks (features: the target's, unless given),
    compiled once per shape for every test here rather than run op by op."""
    graphdef, state = nnx.split((target, drafter))
    with jax.default_matmul_precision("highest"):
        return _compiled_draft_hidden(graphdef, state, jnp.asarray(tokens), features, blocks_per_chunk)


@functools.partial(jax.jit, static_argnums=(0, 4))
def _compiled_draft_hidden(graphdef, state, tokens, features, blocks_per_chunk):
    target, drafter = nnx.merge(graphdef, state)
    seg, pos = jnp.asarray(SEG)[None], jnp.asarray(POS)[None]
    if features is None:
        features = target.features(tokens[None], seg, pos, LAYER_IDS)
    embeds, block_pos = block_inputs(target, tokens)
    mask = block_context_mask(seg, jnp.asarray(ANCHORS)[None])
    return drafter(embeds, block_pos, drafter.context(features), pos, mask, blocks_per_chunk=blocks_per_chunk)


@pytest.fixture(scope="module")
def row(target):
    tokens = np.random.default_rng(0).integers(0, 120, len(SEG))
    features = target.features(jnp.asarray(tokens)[None], jnp.asarray(SEG)[None], jnp.asarray(POS)[None], LAYER_IDS)
    return tokens, features


def test_default_target_layer_ids_follow_design():
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)
    assert default_target_layer_ids(36, 1) == (18,)
    assert default_target_layer_ids(28, 3) == (1, 13, 25)


@pytest.mark.parametrize(
    "position, block, changes",
    [
        (4, 0, True),  # strictly before the anchor, same document: visible
        (5, 0, False),  # the anchor's own position: never context (the classic leak)
        (7, 0, False),  # after the anchor
        (9, 1, True),
        (10, 1, False),
        (3, 2, False),  # another document
        (15, 2, True),
        (16, 2, False),
    ],
)
def test_context_mask_by_feature_perturbation(target, drafter, row, position, block, changes):
    tokens, features = row
    base = draft_hidden(target, drafter, tokens, features)
    bumped = features.at[0, position].add(1.0)
    out = draft_hidden(target, drafter, tokens, bumped)
    delta = float(jnp.abs(out[0, block] - base[0, block]).max())
    if changes:
        assert delta > 1e-4
    else:
        assert delta == 0.0


@pytest.mark.slow
def test_token_perturbations(target, drafter, row):
    tokens, _ = row
    base = draft_hidden(target, drafter, tokens)
    later = tokens.copy()
    later[7] = (later[7] + 1) % 120  # after anchor 0: block 0 must not see it
    np.testing.assert_array_equal(draft_hidden(target, drafter, later)[0, 0], base[0, 0])
    other_doc = tokens.copy()
    other_doc[18] = (other_doc[18] + 1) % 120  # document 2 only: blocks 0 and 1 unchanged
    np.testing.assert_array_equal(draft_hidden(target, drafter, other_doc)[0, :2], base[0, :2])
    other_block = tokens.copy()
    other_block[10] = (other_block[10] + 1) % 120  # anchor token of block 1 only
    out = draft_hidden(target, drafter, other_block)
    np.testing.assert_array_equal(out[0, 0], base[0, 0])
    np.testing.assert_array_equal(out[0, 2], base[0, 2])
    assert float(jnp.abs(out[0, 1] - base[0, 1]).max()) > 1e-4
    earlier = tokens.copy()
    earlier[2] = (earlier[2] + 1) % 120  # before anchor 0, same document: visible
    assert float(jnp.abs(draft_hidden(target, drafter, earlier)[0, 0] - base[0, 0]).max()) > 1e-4


@pytest.mark.slow
def test_chunked_attention_equals_dense_reference_with_gradients():
    rng = np.random.default_rng(0)
    b, n, bk, kvh, g, d, s = 2, 5, BLOCK, 2, 2, 8, 24
    q, k_blk, v_blk = (jnp.asarray(rng.normal(size=(b, n, bk, h, d)), jnp.float32) for h in (kvh * g, kvh, kvh))
    k_ctx, v_ctx = (jnp.asarray(rng.normal(size=(b, s, kvh, d)), jnp.float32) for _ in range(2))
    anchors = jnp.asarray(rng.integers(0, s, (b, n)))
    mask = block_context_mask(jnp.asarray(np.repeat([[1] * 12 + [2] * 12], b, 0)), anchors)
    mask = mask.at[0, 0].set(False)  # a block with no context at all must not produce NaN
    args = (q, k_ctx, v_ctx, k_blk, v_blk)

    def loss(args, chunk):
        out = (
            block_attention_dense(*args, mask)
            if chunk is None
            else block_attention(*args, mask, blocks_per_chunk=chunk, implementation="xla")
        )
        return jnp.sum(jnp.sin(out)), out

    with jax.default_matmul_precision("highest"):
        (_, dense), g_dense = jax.value_and_grad(loss, has_aux=True)(args, None)
        for chunk in (1, 2, 3, n):
            (_, chunked), g_chunk = jax.value_and_grad(loss, has_aux=True)(args, chunk)
            np.testing.assert_allclose(chunked, dense, atol=1e-5)
            for a, c in zip(jax.tree.leaves(g_dense), jax.tree.leaves(g_chunk)):
                np.testing.assert_allclose(c, a, atol=1e-4, rtol=1e-4)
    assert np.isfinite(np.asarray(dense)).all()


def test_drafter_output_does_not_depend_on_the_attention_chunk_size(target, drafter, row):
    tokens, features = row
    whole = draft_hidden(target, drafter, tokens, features, blocks_per_chunk=len(ANCHORS))
    for chunk in (1, 2):
        np.testing.assert_allclose(
            draft_hidden(target, drafter, tokens, features, blocks_per_chunk=chunk), whole, atol=1e-5
        )


@pytest.mark.slow
def test_decode_matches_training_forward(target, drafter, row):
    tokens, features = row
    train_out = draft_hidden(target, drafter, tokens, features)
    embeds, block_pos = block_inputs(target, tokens)
    pos = jnp.asarray(POS)[None]
    with jax.default_matmul_precision("highest"):
        # Block 1 (anchor 10, document 1): context = features of positions 0..9, added in two
        # writes of 8 slots where only 6 and 4 are kept (the rest mimic rejected drafts).
        cache = drafter.new_cache(1, 32)
        cache = drafter.extend_context(cache, features[:, 0:8], pos[:, 0:8], jnp.array([6]))
        cache = drafter.extend_context(cache, features[:, 6:14], pos[:, 6:14], jnp.array([4]))
        out = drafter.decode(embeds[:, 1], block_pos[:, 1], cache)
        np.testing.assert_allclose(out, train_out[:, 1], atol=1e-5)
        # Block 2 (anchor 16, document 2): context = positions 14, 15 of the row.
        cache = drafter.new_cache(1, 32)
        cache = drafter.extend_context(cache, features[:, 14:16], pos[:, 14:16], jnp.array([2]))
        out = drafter.decode(embeds[:, 2], block_pos[:, 2], cache)
        np.testing.assert_allclose(out, train_out[:, 2], atol=1e-5)


EXPECTED_LAYER_TENSORS = {
    "self_attn.q_proj.weight": lambda c: (c.num_heads * c.head_dim, c.hidden_size),
    "self_attn.k_proj.weight": lambda c: (c.num_kv_heads * c.head_dim, c.hidden_size),
    "self_attn.v_proj.weight": lambda c: (c.num_kv_heads * c.head_dim, c.hidden_size),
    "self_attn.o_proj.weight": lambda c: (c.hidden_size, c.num_heads * c.head_dim),
    "self_attn.q_norm.weight": lambda c: (c.head_dim,),
    "self_attn.k_norm.weight": lambda c: (c.head_dim,),
    "mlp.gate_proj.weight": lambda c: (c.intermediate_size, c.hidden_size),
    "mlp.up_proj.weight": lambda c: (c.intermediate_size, c.hidden_size),
    "mlp.down_proj.weight": lambda c: (c.hidden_size, c.intermediate_size),
    "input_layernorm.weight": lambda c: (c.hidden_size,),
    "post_attention_layernorm.weight": lambda c: (c.hidden_size,),
}


def test_export_format_and_exact_round_trip(drafter, tmp_path):
    out = export_drafter(drafter, tmp_path / "export", dtype=jnp.float32)
    cfg = drafter.cfg
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["model_type"] == "qwen3"
    assert config["tie_word_embeddings"] is False
    assert config["block_size"] == BLOCK
    assert config["num_target_layers"] == 4
    assert config["dflash_config"] == {"mask_token_id": MASK_ID, "target_layer_ids": list(LAYER_IDS)}
    for key, value in dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        vocab_size=128,
        max_position_embeddings=256,
    ).items():
        assert config[key] == value, key

    tensors = load_file(out / "model.safetensors")
    expected = {
        "fc.weight": (cfg.hidden_size, 2 * cfg.hidden_size),
        "hidden_norm.weight": (cfg.hidden_size,),
        "norm.weight": (cfg.hidden_size,),
    }
    for i in range(cfg.num_layers):
        expected.update({f"layers.{i}.{k}": f(cfg) for k, f in EXPECTED_LAYER_TENSORS.items()})
    assert {k: tuple(v.shape) for k, v in tensors.items()} == expected

    loaded = load_drafter(out)
    assert loaded.cfg == cfg
    for a, b in zip(jax.tree.leaves(nnx.state(drafter)), jax.tree.leaves(nnx.state(loaded))):
        np.testing.assert_array_equal(a, b)


def test_import_rejects_non_drafter_and_ignores_extra_tensors(drafter, qwen3_checkpoint, tmp_path):
    with pytest.raises(ValueError, match="not a DFlash drafter"):
        load_drafter(qwen3_checkpoint)
    out = export_drafter(drafter, tmp_path / "released", dtype=jnp.float32)
    tensors = load_file(out / "model.safetensors")
    tensors["embed_tokens.weight"] = np.zeros((128, 64), np.float32)  # shipped but unused
    from safetensors.numpy import save_file

    save_file(tensors, out / "model.safetensors")
    loaded = load_drafter(out)
    np.testing.assert_array_equal(loaded.fc.kernel[...], drafter.fc.kernel[...])


def _torch_reference_block(export_dir, ctx_features, ctx_positions, block_embeds, block_positions):
    """docs/design.md §2 written directly in torch against the exported tensors ([out, in] Linear)."""
    cfg = json.loads((export_dir / "config.json").read_text())
    w = {k: torch.tensor(v) for k, v in load_file(export_dir / "model.safetensors").items()}
    eps, hd = cfg["rms_norm_eps"], cfg["head_dim"]
    heads, kvh = cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def rms(x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def rope(x, pos):  # x [T, h, d]
        inv = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, hd, 2).float() / hd))
        ang = torch.cat([pos[:, None] * inv, pos[:, None] * inv], -1)[:, None]
        rot = torch.cat([-x[..., hd // 2 :], x[..., : hd // 2]], -1)
        return x * ang.cos() + rot * ang.sin()

    ctx = rms(ctx_features @ w["fc.weight"].T, w["hidden_norm.weight"])
    x = block_embeds
    t = x.shape[0]
    for i in range(cfg["num_hidden_layers"]):

        def p(name, i=i):
            return w[f"layers.{i}.{name}"]

        h = rms(x, p("input_layernorm.weight"))
        q = rms((h @ p("self_attn.q_proj.weight").T).view(t, heads, hd), p("self_attn.q_norm.weight"))
        q = rope(q, block_positions)
        kv_in = torch.cat([ctx, h])
        k = rms((kv_in @ p("self_attn.k_proj.weight").T).view(-1, kvh, hd), p("self_attn.k_norm.weight"))
        k = rope(k, torch.cat([ctx_positions, block_positions]))
        v = (kv_in @ p("self_attn.v_proj.weight").T).view(-1, kvh, hd)
        k, v = k.repeat_interleave(heads // kvh, 1), v.repeat_interleave(heads // kvh, 1)
        att = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) * hd**-0.5, -1)
        x = x + torch.einsum("hqk,khd->qhd", att, v).reshape(t, -1) @ p("self_attn.o_proj.weight").T
        h = rms(x, p("post_attention_layernorm.weight"))
        mlp = torch.nn.functional.silu(h @ p("mlp.gate_proj.weight").T) * (h @ p("mlp.up_proj.weight").T)
        x = x + mlp @ p("mlp.down_proj.weight").T
    return rms(x, w["norm.weight"])


@pytest.mark.slow
def test_export_reproduced_by_independent_torch_implementation(target, drafter, row, tmp_path):
    tokens, features = row
    out_dir = export_drafter(drafter, tmp_path / "export", dtype=jnp.float32)
    embeds, block_pos = block_inputs(target, tokens)
    pos = jnp.asarray(POS)[None]
    with jax.default_matmul_precision("highest"):
        cache = drafter.new_cache(1, 16)
        cache = drafter.extend_context(cache, features[:, :10], pos[:, :10], jnp.array([10]))
        ours = drafter.decode(embeds[:, 1], block_pos[:, 1], cache)
    ref = _torch_reference_block(
        out_dir,
        torch.tensor(np.asarray(features[0, :10])),
        torch.arange(10).float(),
        torch.tensor(np.asarray(embeds[0, 1])),
        torch.tensor(np.asarray(block_pos[0, 1])).float(),
    )
    np.testing.assert_allclose(np.asarray(ours[0]), ref.numpy(), atol=1e-4)
