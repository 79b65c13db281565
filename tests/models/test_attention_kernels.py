"""Training attention, every implementation against the reference (models/layers/attention.py).

The XLA paths (tiled packed causal, chunked block attention) are checked against dense masks;
the fused Pallas kernels run in interpret mode on CPU and are checked against the XLA path, the
block kernel's gradients included; and the kernels are lowered to Triton for a GPU (no GPU
needed to lower) to show they compile there at Qwen3-8B's head layout.
"""

from __future__ import annotations

import functools
import os
import re
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dflash_jax.data.synthetic import packed_batch
from dflash_jax.models import kernels
from dflash_jax.models.architecture import RopeConfig, TransformerConfig
from dflash_jax.models.kernels import block, cost
from dflash_jax.models.layers import attention, block_attention
from dflash_jax.models.transformer import Transformer
from support import block_cases
from support.reference_attention import packed_causal_mask
from support.simulated_devices import run_script


def _packed(rows, seq_len, doc_len, seed=0):
    batch = packed_batch(np.random.default_rng(seed), rows, seq_len, 100, doc_len=doc_len)
    return {k: jnp.asarray(v) for k, v in batch.items()}


def _qkv(rows, seq_len, heads, kv_heads, head_dim, dtype=jnp.float32):
    return (
        block_cases.normal(1, (rows, seq_len, heads, head_dim), dtype),
        block_cases.normal(2, (rows, seq_len, kv_heads, head_dim), dtype),
        block_cases.normal(3, (rows, seq_len, kv_heads, head_dim), dtype),
    )


def _packed_causal(impl, q, k, v, segment_ids):
    with jax.default_matmul_precision("highest"):
        return attention.packed_causal_attention(q, k, v, segment_ids, implementation=impl)


def _real(segment_ids):
    return np.asarray(segment_ids != 0)[..., None, None]


def test_auto_means_xla_on_cpu_and_fused_on_gpu():
    assert jax.default_backend() == "cpu"
    assert attention.resolve_implementation("auto") == "xla"
    assert attention.resolve_implementation("auto", "gpu") == "fused"
    assert attention.resolve_implementation("fused") == "fused"
    assert attention.resolve_implementation("xla", "gpu") == "xla"
    with pytest.raises(ValueError, match="not one of"):
        attention.resolve_implementation("flash")


@pytest.mark.parametrize("seq_len", [40, 100, *(pytest.param(s, marks=pytest.mark.slow) for s in (330, 700))])
def test_tiled_packed_causal_equals_dense_mask(seq_len):
    batch = _packed(2, seq_len, (seq_len // 6, seq_len // 2))
    q, k, v = _qkv(2, seq_len, 4, 2, 16)
    with jax.default_matmul_precision("highest"):
        dense = attention.attend(q, k, v, packed_causal_mask(batch["segment_ids"]))
    tiled = _packed_causal("xla", q, k, v, batch["segment_ids"])
    np.testing.assert_allclose(
        np.where(_real(batch["segment_ids"]), tiled, 0), np.where(_real(batch["segment_ids"]), dense, 0), atol=1e-5
    )
    tiles = attention.packed_causal_tiles(seq_len)
    assert tiles[0][0] == 0 and tiles[-1][1] == seq_len
    assert all(lo < hi for lo, hi in tiles) and all(a[1] == b[0] for a, b in zip(tiles, tiles[1:]))
    assert len(tiles) > 1 or seq_len < 256  # longer rows do exercise the tiling
    assert attention.packed_causal_pairs(seq_len) == sum((hi - lo) * hi for lo, hi in tiles) <= seq_len**2


@pytest.mark.parametrize(
    ("seq_len", "heads", "kv_heads", "dtype", "atol"),
    [
        (200, 4, 2, jnp.float32, 2e-5),
        (128, 8, 2, jnp.float32, 2e-5),
        pytest.param(192, 4, 4, jnp.bfloat16, 3e-2, marks=pytest.mark.slow),
    ],
)
def test_fused_packed_causal_equals_xla(seq_len, heads, kv_heads, dtype, atol):
    batch = _packed(2, seq_len, (10, 90))
    seg = batch["segment_ids"].at[1, :70].set(1)  # a document spanning more than one key tile
    q, k, v = _qkv(2, seq_len, heads, kv_heads, 32, dtype)
    reference = _packed_causal("xla", q, k, v, seg).astype(jnp.float32)
    fused = _packed_causal("fused", q, k, v, seg).astype(jnp.float32)
    real = _real(seg)
    np.testing.assert_allclose(np.where(real, fused, 0), np.where(real, reference, 0), atol=atol)
    assert np.isfinite(np.asarray(fused)).all()


@pytest.mark.parametrize(
    ("seq_len", "block_len", "heads", "kv_heads", "dtype", "atol"),
    [
        (100, 8, 4, 2, jnp.float32, 2e-5),  # S not a multiple of the key tile, G = 2
        pytest.param(
            128, 10, 8, 2, jnp.float32, 2e-5, marks=pytest.mark.slow
        ),  # block length not a power of two, G = 4
        pytest.param(96, 16, 2, 2, jnp.bfloat16, 5e-2, marks=pytest.mark.slow),
    ],
)
def test_fused_block_attention_equals_xla_with_gradients(seq_len, block_len, heads, kv_heads, dtype, atol):
    rows, num_blocks = 2, 9
    mask = block_cases.context_mask(rows, seq_len, num_blocks)
    args = block_cases.inputs(rows, seq_len, num_blocks, block_len, heads, kv_heads, 32, dtype)
    cotangent = block_cases.normal(30, args[0].shape)
    out_xla, grads_xla = block_cases.loss_and_grads("xla", args, mask, cotangent)
    out_fused, grads_fused = block_cases.loss_and_grads("fused", args, mask, cotangent)
    np.testing.assert_allclose(out_fused, out_xla, atol=atol)
    scale = 1 if dtype == jnp.float32 else 4  # bf16 gradients sum many rounded terms
    for name, fused, xla in zip(("q", "k_ctx", "v_ctx", "k_blk", "v_blk"), grads_fused, grads_xla):
        np.testing.assert_allclose(fused, xla, atol=scale * atol, err_msg=name)
    assert all(np.isfinite(np.asarray(g)).all() for g in grads_fused)


def test_context_spans_are_the_mask():
    mask = block_cases.context_mask(3, 200, 16, seed=1)
    start, end = block_attention.context_spans(mask)
    positions = np.arange(mask.shape[-1])
    spans = (positions >= np.asarray(start)[..., None]) & (positions < np.asarray(end)[..., None])
    np.testing.assert_array_equal(spans, mask)
    assert int((end == 0).sum()) >= 2  # the invalid block and the one anchored at a document start


def _tiny_target(impl, head_dim=32):
    cfg = TransformerConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=head_dim,
        rope=RopeConfig(10_000.0),
    )
    return Transformer(cfg, attention=impl, rngs=nnx.Rngs(0))


@pytest.mark.slow
def test_target_forward_fused_equals_xla():
    batch = _packed(2, 96, (10, 50))
    args = (batch["tokens"], batch["segment_ids"], batch["positions"])
    outs = {}
    for impl in ("xla", "fused"):
        with jax.default_matmul_precision("highest"):
            outs[impl] = _tiny_target(impl).features(*args, (0, 1))
    real = np.asarray(batch["segment_ids"] != 0)[..., None]
    np.testing.assert_allclose(np.where(real, outs["fused"], 0), np.where(real, outs["xla"], 0), atol=1e-4)


def test_unsupported_head_dim_falls_back_to_xla_and_says_so():
    q, k, v = _qkv(1, 64, 2, 1, 24)  # not a power of two
    seg = jnp.ones((1, 64), jnp.int32)
    with kernels.noting_fallbacks() as reasons:
        fused = _packed_causal("fused", q, k, v, seg)
    np.testing.assert_allclose(fused, _packed_causal("xla", q, k, v, seg), atol=1e-6)
    assert reasons == [
        "the target's attention runs XLA's code, not a kernel: heads of 24 (the kernels take powers of two from 16)"
    ]


@pytest.mark.parametrize("tiles", [kernels.Tiles(16, 16, 1), kernels.Tiles(32, 32, 2)])
def test_smaller_tiles_compute_the_same_attention(monkeypatch, tiles):
    """Where the 64-row, 64-key tiles would not fit the GPU the kernels take smaller ones: the
    block kernels then split a block's G·L query rows over programs (forward, dq: the own
    block's dk, dv summed over them) and over the context dk, dv walk's steps."""
    monkeypatch.setattr(kernels, "candidates", lambda rows, keys: [tiles])
    args = block_cases.inputs(2, 100, 5, 8, 8, 2, 32, jnp.float32)  # M = 4 heads x 16 slots = 64 rows
    mask = block_cases.context_mask(2, 100, 5)
    assert block.tiles_for(args[0], 2) == (tiles,) * 3
    cotangent = block_cases.normal(30, args[0].shape)
    out_xla, grads_xla = block_cases.loss_and_grads("xla", args, mask, cotangent)
    out_fused, grads_fused = block_cases.loss_and_grads("fused", args, mask, cotangent)
    np.testing.assert_allclose(out_fused, out_xla, atol=2e-5)
    for name, fused, xla in zip(("q", "k_ctx", "v_ctx", "k_blk", "v_blk"), grads_fused, grads_xla):
        np.testing.assert_allclose(fused, xla, atol=2e-5, err_msg=name)
    batch = _packed(1, 100, (10, 60))
    q, k, v = _qkv(1, 100, 4, 2, 32)
    real = _real(batch["segment_ids"])
    target = [_packed_causal(impl, q, k, v, batch["segment_ids"]) for impl in ("fused", "xla")]
    np.testing.assert_allclose(*(np.where(real, out, 0) for out in target), atol=2e-5)


def test_where_no_tile_fits_the_gpu_the_layers_run_xla_and_say_why(monkeypatch):
    monkeypatch.setattr(kernels, "shared_memory_per_block", lambda: 4096)
    args = block_cases.inputs(1, 40, 2, 8, 4, 2, 32, jnp.float32)
    mask = block_cases.context_mask(1, 40, 2)
    q, k, v = _qkv(1, 64, 2, 1, 32)
    seg = jnp.ones((1, 64), jnp.int32)
    with kernels.noting_fallbacks() as reasons:
        blocks = {
            impl: block_attention.block_attention(*args, mask, blocks_per_chunk=2, implementation=impl)
            for impl in ("fused", "xla")
        }
        target = {impl: _packed_causal(impl, q, k, v, seg) for impl in ("fused", "xla")}
    np.testing.assert_array_equal(blocks["fused"], blocks["xla"])
    np.testing.assert_array_equal(target["fused"], target["xla"])
    why = "heads of 32 (no tile of its kernels fits the GPU's 4,096 bytes of shared memory a block)"
    assert reasons == [
        f"the drafter's attention runs XLA's code, not a kernel: {why}",
        f"the target's attention runs XLA's code, not a kernel: {why}",
    ]


def test_shared_memory_per_block_is_the_target_configs_and_the_traced_gpus(monkeypatch):
    """The planner's GPUs (H100, H200: compute capability 9.0; B200: 10.0) say what the table
    says; the kernels read the active mesh's devices, and on a CPU plan for an H100."""
    from dflash_jax.models import sharding

    targets = Path(kernels.__file__).parents[2] / "training" / "planning" / "gpu_targets"
    assert len(list(targets.glob("*.txtpb"))) >= 3
    for target in targets.glob("*.txtpb"):
        text = target.read_text()
        optin = int(re.search(r"shared_memory_per_block_optin: (\d+)", text).group(1))
        capability = ".".join(re.search(r"cuda_compute_capability \{ major: (\d+) minor: (\d+) \}", text).groups())
        assert kernels.SHARED_MEMORY_PER_BLOCK[capability] == optin, target.name
    assert kernels.shared_memory_per_block() == kernels.SHARED_MEMORY_PER_BLOCK["9.0"]

    class Ampere:
        compute_capability = "8.6"

    class Mesh:
        devices = np.array([Ampere()])

    monkeypatch.setattr(sharding, "active_mesh", lambda: Mesh())
    assert kernels.shared_memory_per_block() == 101_376


def test_kernels_lower_to_triton_for_gpu():
    """Qwen3-8B's head layout (32 query heads of 128 over 8 kv heads, block 16) at small lengths:
    lowering for CUDA runs Pallas' Triton lowering, which rejects what Triton cannot compile.
    Each call states the FLOPs its walk computes on a one-document row (Triton keeps no cost of
    its own; the roofline reads the scope, training/planning/hlo.py)."""
    rows, seq_len, num_blocks, block_len = 1, 256, 8, 16
    sds = jax.ShapeDtypeStruct
    q, kv = sds((rows, seq_len, 32, 128), jnp.bfloat16), sds((rows, seq_len, 8, 128), jnp.bfloat16)
    segment_ids = sds((rows, seq_len), jnp.int32)
    q_blk, kv_blk = (
        sds((rows, num_blocks, block_len, 32, 128), jnp.bfloat16),
        sds((rows, num_blocks, block_len, 8, 128), jnp.bfloat16),
    )
    mask = sds((rows, num_blocks, seq_len), bool)

    def drafter_grads(q, k_ctx, v_ctx, k_blk, v_blk, mask):
        def loss(*args):
            out = block_attention.block_attention(*args, mask, blocks_per_chunk=4, implementation="fused")
            return out.astype(jnp.float32).sum()

        return jax.grad(loss, argnums=(0, 1, 2, 3, 4))(q, k_ctx, v_ctx, k_blk, v_blk)

    fused_target = functools.partial(attention.packed_causal_attention, implementation="fused")
    with kernels.compiled_for_gpu():
        target = jax.jit(fused_target).trace(q, kv, kv, segment_ids).lower(lowering_platforms=("cuda",))
        drafter = jax.jit(drafter_grads).trace(q_blk, kv, kv, kv_blk, kv_blk, mask).lower(lowering_platforms=("cuda",))
    assert target.as_text().count("__gpu$xla.gpu.triton") == 1
    assert drafter.as_text().count("__gpu$xla.gpu.triton") == 3  # forward, dq, context dk/dv

    def stated(lowered):
        return sorted(int(n) for n in set(re.findall(r"kernel_flops=(\d+)", lowered.as_text(debug_info=True))))

    # Target: 4 tiles of 64; query tile i visits key tiles 0..i: 10 pairs of [64, 64] x 128, twice, per head.
    assert stated(target) == [10 * 2 * (2 * 64 * 64 * 128) * 32]
    # Drafter: 8 blocks over 4 tiles reach 1, 1, 2, 2, 3, 3, 4, 4 of them (20 pairs) per kv head; a
    # block's 4 x 16 query rows against 64 context keys (scores, values; in the backward dq's
    # scores, dp, dq and dk/dv's scores, dp, dk, dv) and against its own 16 keys (2; dq's 5).
    row = 2 * 64 * 128
    context, own = 8 * 20 * 64, 8 * 8 * 16
    expected = [row * (2 * context + 2 * own), row * (3 * context + 5 * own), row * 4 * context]
    assert stated(drafter) == sorted(expected)


def test_a_causal_walk_visits_the_key_tiles_up_to_the_diagonal_within_its_window():
    """Query tile i of a one-document row visits key tiles 0..i; with a window of one tile, the
    tile holding its first query's window start and its own."""
    assert cost.causal_visits(4, 64, 64) == 1 + 2 + 3 + 4
    assert cost.causal_visits(4, 64, 64, sliding_window=64) == 1 + 2 + 2 + 2
    assert cost.causal_visits(4, 64, 64, sliding_window=10_000) == 10
    assert cost.expected_visits(chunks=4, tiles=4) == 1 + 2 + 3 + 4  # block c reaches (c + 1) / 4 of the row


SHARDED_CHECK = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from dflash_jax.models import sharding
    from dflash_jax.models.layers import block_attention
    from dflash_jax.training.mesh import make_mesh
    import support.block_cases as t

    mesh = make_mesh(2, 1, 1)
    mask = t.context_mask(2, 96, 6)
    args = t.inputs(2, 96, 6, 8, 4, 2, 32, jnp.float32)
    cot = t.normal(30, args[0].shape)
    out, grads = t.loss_and_grads("fused", args, mask, cot)

    def loss(args, mask):
        with sharding.activation_sharding(mesh):
            o = block_attention.block_attention(*args, mask, blocks_per_chunk=3, implementation="fused")
        return jnp.sum(o * cot), o

    rows = NamedSharding(mesh, P(sharding.BATCH_MESH_AXES))
    put = lambda x: jax.device_put(x, rows)
    with jax.default_matmul_precision("highest"):
        f = jax.jit(jax.value_and_grad(loss, has_aux=True))
        (_, sharded), sharded_grads = f(jax.tree.map(put, args), put(mask))
        assert "shard_map" in str(jax.make_jaxpr(loss)(args, mask))
    np.testing.assert_allclose(sharded, out, atol=1e-5)
    for a, b in zip(sharded_grads, grads):
        np.testing.assert_allclose(a, b, atol=1e-5)
    print("ok")
    """
)


@pytest.mark.slow
def test_fused_block_attention_runs_per_shard_on_a_mesh():
    result = run_script(SHARDED_CHECK, devices=2, import_dir=os.path.dirname(__file__))
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]
