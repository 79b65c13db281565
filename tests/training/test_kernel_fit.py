"""What attention 'auto' picks compiles: the GPU kernels' tiles fit the shared memory a block of
the target GPU may use, at every head width the families use, or the layer runs XLA's attention
and the plan says why (models/kernels/).

The slow tier (1) checks the kernels' estimates against XLA:GPU's own figures for an H100 (a
kernel compiled for an H100 that allows a block 1 byte is refused with the bytes its tiles ask
for), and (2) compiles a tiny train step with attention 'auto', the widest heads of Gemma 4,
DeepSeek-V3 and gpt-oss, for an H100 (XLA:GPU) and a TPU v5p (libtpu), without the hardware.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

from dflash_jax.models import families, kernels
from dflash_jax.models.kernels import Tiles, block, packed_causal
from dflash_jax.training.config.presets import hub_target_config
from dflash_jax.training.config.run_config import resolve
from dflash_jax.training.planning import compilers, hardware
from dflash_jax.training.planning import memory as planning

BF16 = jnp.bfloat16


def _h100_allowing(limit: int) -> list:
    """One H100 for XLA:GPU whose blocks may use `limit` bytes of shared memory."""
    from jax.experimental import topologies

    acc = hardware.ACCELERATORS["h100"]
    if not compilers.installed(acc):
        pytest.fail(compilers.missing(acc))  # .ci/run installs both compilers: missing is a failure
    text = re.sub(r"shared_memory_per_block_optin: \d+", f"shared_memory_per_block_optin: {limit}", acc.target_config)
    return list(topologies.get_topology_desc(platform="cuda", target_config=text, topology="1x1x1").devices)


def _asked(fn, shapes, device) -> int:
    """The shared memory XLA:GPU says the Triton kernel in `fn` asks for (a device allowing 1 byte)."""
    placed = jax.sharding.NamedSharding(jax.sharding.Mesh(device, ("x",)), jax.sharding.PartitionSpec())
    args = [jax.ShapeDtypeStruct(shape, dtype, sharding=placed) for shape, dtype in shapes]
    with kernels.compiled_for_gpu(), pytest.raises(jax.errors.JaxRuntimeError) as refusal:
        jax.jit(fn).lower(*args).compile()
    return int(re.search(r"Shared memory size limit exceeded: requested (\d+)", str(refusal.value)).group(1))


def _causal(tiles: Tiles, head_dim: int, device) -> int:
    q, kv, seg = ((1, 256, 2, head_dim), BF16), ((1, 256, 1, head_dim), BF16), ((1, 256), jnp.int32)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(packed_causal, "tiles_for", lambda head_dim, itemsize: tiles)
        return _asked(lambda *a: packed_causal.packed_causal_attention(*a), [q, kv, kv, seg], device)  # traced anew


def _block_kernel(kernel: str, tiles: Tiles, head_dim: int, rows: int, device) -> int:
    """The figure of the block attention's `kernel` (forward, dq, dkv) for blocks of `rows` query rows."""
    n, lp, seq_len = 4, 16, 256
    q, rows_f32 = ((1, 1, n, rows, head_dim), BF16), ((1, 1, n, rows), jnp.float32)
    kc, kb, spans = ((1, 1, seq_len, head_dim), BF16), ((1, 1, n, lp, head_dim), BF16), ((1, n), jnp.int32)
    calls = {
        "forward": (lambda *a: block._forward_call(*a, lp, tiles), [q, kc, kc, kb, kb, spans, spans]),
        "dq": (lambda *a: block._dq_call(*a, lp, tiles), [q, kc, kc, kb, kb, spans, spans, q, rows_f32, rows_f32]),
        "dkv": (lambda *a: block._dkv_context_call(*a, tiles), [q, q, rows_f32, rows_f32, spans, spans, kc, kc]),
    }
    return _asked(*calls[kernel], device)


@pytest.mark.slow
def test_the_shared_memory_estimates_are_xla_gpus_figures():
    """The figure of the reported failure (Gemma 4's heads of 512 in the causal kernel's 64 x 64
    tiles, 2 stages: 327,936 bytes > 232,448) is the estimate's; so are those of the tiles chosen
    for the families' head layouts (width, G·L query rows a block), which fit an H100."""
    device = _h100_allowing(1)
    failing = Tiles(64, 64, 2)
    assert _causal(failing, 512, device) == kernels.walk_shared_memory(failing, 512, 2, key_bytes=4) == 327_936
    limit = kernels.SHARED_MEMORY_PER_BLOCK["9.0"] - kernels.SHARED_MEMORY_RESERVE
    for head_dim in (512, 256, 64):
        tiles = packed_causal.tiles_for(head_dim, 2)
        assert _causal(tiles, head_dim, device) == kernels.walk_shared_memory(tiles, head_dim, 2, key_bytes=4) <= limit
    # Gemma 4's global (512, G = 8) and sliding (256, G = 2) heads, Qwen3.5's (256, G = 8), gpt-oss' (64, G = 8).
    estimates = {
        "forward": block._forward_shared_memory,
        "dq": block._dq_shared_memory,
        "dkv": block._dkv_shared_memory,
    }
    for head_dim, rows in ((512, 128), (256, 32), (256, 128), (64, 128)):
        for (kernel, estimate), tiles in zip(estimates.items(), block.kernel_tiles(rows, head_dim, 2)):
            asked = _block_kernel(kernel, tiles, head_dim, rows, device)
            assert asked == estimate(tiles, head_dim, 2) <= limit, (kernel, head_dim, rows, tiles)


# Tiny targets (2 layers, 256 wide) with each family's real head widths: Gemma 4's sliding heads of
# 256 and global ones of 512 (8 query heads a kv head), DeepSeek-V3's latent attention (keys of
# 128 + 64, values of 128), gpt-oss' heads of 64 with sinks, a sliding and a full layer.
_SMALL = dict(hidden_size=256, intermediate_size=256, vocab_size=512, num_hidden_layers=2, rms_norm_eps=1e-6)
_ROPES = {
    "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1e6, "rope_type": "proportional"},
    "sliding_attention": {"rope_theta": 1e4, "rope_type": "default"},
}
TINY_TARGETS = {
    "gemma4": dict(
        architectures=["Gemma4ForCausalLM"],
        model_type="gemma4_text",
        **_SMALL,
        attention_k_eq_v=True,
        head_dim=256,
        global_head_dim=512,
        num_attention_heads=8,
        num_key_value_heads=4,
        num_global_key_value_heads=1,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=128,
        rope_parameters=_ROPES,
        hidden_size_per_layer_input=0,
        tie_word_embeddings=True,
    ),
    "deepseek_v3": dict(
        architectures=["DeepseekV3ForCausalLM"],
        model_type="deepseek_v3",
        **_SMALL,
        num_attention_heads=2,
        num_key_value_heads=2,
        q_lora_rank=64,
        kv_lora_rank=64,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        first_k_dense_replace=1,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        n_shared_experts=1,
        moe_intermediate_size=64,
    ),
    "gpt_oss": dict(
        architectures=["GptOssForCausalLM"],
        model_type="gpt_oss",
        **_SMALL,
        head_dim=64,
        num_attention_heads=8,
        num_key_value_heads=1,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=128,
        num_local_experts=4,
        num_experts_per_tok=2,
        attention_bias=True,
    ),
}
# The drafter's heads, kv heads and head width: Gemma 4's widest (its preset keeps the sliding
# layers' 256) and the layout of DeepSeek-V3's preset (8 query heads of 128 a kv head).
_DRAFTER_HEADS = {"gemma4": (8, 1, 512), "deepseek_v3": (16, 2, 128)}
_LATENT = "heads of 192 with values of 128 (the kernels take values as wide)"
FALLBACKS = {"deepseek_v3": (f"the target's attention runs XLA's code, not a kernel: {_LATENT}",)}


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(TINY_TARGETS))
@pytest.mark.parametrize(("name", "num_devices"), [("h100", 1), ("tpu-v5p", 4)])
def test_a_tiny_step_with_the_familys_widest_heads_compiles(family, name, num_devices):
    """attention 'auto' for the target and the drafter: the step compiles, the kernels run where
    they can (each stating its cost) and the plan names each layer that runs XLA's instead."""
    acc = hardware.ACCELERATORS[name]
    if not compilers.installed(acc):
        pytest.fail(compilers.missing(acc))
    config = hub_target_config("", block_size=16, mask_token_id=3)
    config.data.seq_len, config.data.global_batch_rows, config.train.num_anchors = 256, num_devices, 8
    config.drafter.num_layers = 1
    if family in _DRAFTER_HEADS:
        config.drafter.num_heads, config.drafter.num_kv_heads, config.drafter.head_dim = _DRAFTER_HEADS[family]
    target = families.target_config(TINY_TARGETS[family])
    setup = resolve(config, num_devices=num_devices, target=target, check_files=False)
    assert setup.run.attention == "auto"
    plan = planning.plan_train_step(setup, compilers.devices(acc, num_devices))
    assert plan.fits(acc.hbm_bytes)
    assert plan.kernel_fallbacks == FALLBACKS.get(family, ())
    printed = planning.format_plan(plan, acc.hbm_bytes, title=family, fsdp=1, tensor=1, remat=True).splitlines()
    assert all(f"  {reason}" in printed for reason in plan.kernel_fallbacks)
    counted = {k.region for k in plan.kernels if k.opcode == "custom-call" and k.flops > 0}
    assert "drafter attention" in counted
    assert ("target attention" in counted) == (family not in FALLBACKS)
