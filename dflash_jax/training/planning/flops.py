"""Model FLOPs of one train step, counted analytically (shared by `bench/` and the plan).

The count is the model's matmul FLOPs as the implementation computes them: the frozen target's
forward through its last feature layer (causal attention by the query x key tiles on or below
the diagonal, `models.attention.packed_causal_pairs`), the drafter's
forward, twice that again for its backward (dX and dW), and dX through the frozen LM head; for
the drafter kinds, their heads' matmuls too (docs/design.md "Drafter kinds").
Recomputation in the backward pass is not counted here; `remat_flops_per_step` counts it.
"""

from __future__ import annotations

from dflash_jax.models.architecture import TransformerConfig, has_dense_mlp, layer_attention, layer_window
from dflash_jax.models.layers.attention import packed_causal_pairs
from dflash_jax.training.config.run_config import TrainSetup


def model_flops_per_step(setup: TrainSetup, rows: int, seq_len: int) -> float:
    """Matmul FLOPs of one train step as the XLA implementation computes them."""
    return sum(_parts(setup, rows, seq_len)[:2])


def remat_flops_per_step(setup: TrainSetup, rows: int, seq_len: int) -> float:
    """Matmul FLOPs recomputed in the backward pass: the drafter layers' forward with
    `train.remat` and the 'full' policy, else the attention chunks only (the LM head's are never
    recomputed; the 'dots' policies keep the layers' matmuls)."""
    _, _, layers, attention = _parts(setup, rows, seq_len)
    return layers if setup.objective.remat and setup.objective.remat_policy == "full" else attention


def target_layer_flops(cfg: TransformerConfig, index: int, rows: int, seq_len: int) -> float:
    """Forward matmul FLOPs of target layer `index` over [rows, seq_len] packed rows: its mixer
    (attention by the tiles below the diagonal, inside the window of a sliding layer; Gated
    DeltaNet's projections and chunked delta rule) and its MLP (the chosen experts only, plus
    router and shared expert)."""
    h, tokens = cfg.hidden_size, rows * seq_len
    if cfg.layer_types[index] == "linear_attention":
        lin = cfg.linear_attention
        key, value = lin.num_k_heads * lin.head_k_dim, lin.num_v_heads * lin.head_v_dim
        projections = h * (2 * key + 2 * value + 2 * lin.num_v_heads) + value * h
        # Per value head and chunk of L tokens: scores and decay-masked k·k (2·L·L·H), the solve
        # and the intra-chunk outputs (2·L·L·U), the state read, correction and update (3·L·H·U).
        chunk = 64
        per_token = lin.num_v_heads * (
            2 * chunk * (lin.head_k_dim + lin.head_v_dim) + 3 * lin.head_k_dim * lin.head_v_dim
        )
        mixer = tokens * (projections + per_token)
    elif cfg.latent_attention is not None:
        mixer = _latent_attention_macs(cfg, rows, seq_len)
    else:  # the layer kind's own head size and kv heads (Gemma 4's full layers); values from keys: no v_proj
        own = layer_attention(cfg, cfg.layer_types[index])
        q_width = cfg.num_heads * own.head_dim * (2 if cfg.attention_output_gate else 1)
        kv_width = own.num_kv_heads * own.head_dim * (1 if own.values_from_keys else 2)
        weights = h * (q_width + kv_width) + cfg.num_heads * own.head_dim * h
        window = layer_window(cfg, cfg.layer_types[index])
        mixer = tokens * weights + 2 * rows * packed_causal_pairs(seq_len, window) * cfg.num_heads * own.head_dim
    mlp = 3 * h * cfg.intermediate_size if has_dense_mlp(cfg, index) else 0
    if index in cfg.moe_layers:
        moe = cfg.moe
        mlp += h * moe.num_experts + 3 * h * moe.expert_intermediate_size * moe.num_experts_per_token
        shared = moe.shared_expert_intermediate_size
        mlp += 3 * h * shared + (h if shared and moe.shared_expert_gate else 0)
    return 2.0 * (mixer + tokens * mlp)


def _latent_attention_macs(cfg: TransformerConfig, rows: int, seq_len: int) -> float:
    """Multiply-adds of a latent attention layer over packed rows, as its packed forward computes
    them: the low-rank projections, the latent expanded to every head's keys and values, and
    attention of N + R wide keys and U wide values over the tiles below the diagonal."""
    latent, h, heads = cfg.latent_attention, cfg.hidden_size, cfg.num_heads
    qk = latent.qk_nope_head_dim + latent.qk_rope_head_dim
    rank = latent.q_lora_rank
    query = h * rank + rank * heads * qk if rank else h * heads * qk
    weights = (
        query
        + h * (latent.kv_lora_rank + latent.qk_rope_head_dim)
        + latent.kv_lora_rank * heads * (latent.qk_nope_head_dim + latent.v_head_dim)
        + heads * latent.v_head_dim * h
    )
    pairs = rows * packed_causal_pairs(seq_len)
    return rows * seq_len * weights + pairs * heads * (qk + latent.v_head_dim)


def _parts(setup: TrainSetup, rows: int, seq_len: int) -> tuple[float, float, float, float]:
    """(target forward, drafter forward + backward, drafter layers' forward, drafter attention
    forward)."""
    t, d, obj = setup.target, setup.drafter, setup.objective
    kind = d.kind_spec
    h, hd = t.hidden_size, d.head_dim

    def layer_weights(hidden, inter, heads, kv_heads):  # multiply-adds per token
        weights = hidden * hd * (heads + 2 * kv_heads) + heads * hd * hidden + 3 * hidden * inter
        return weights + kind.layer_macs(d)  # the kind's own per layer (DFlash2's convolutions)

    # Target: forward through the last feature layer (the last layer, and the LM head on the
    # slots, to distill).
    last = t.num_layers - 1 if obj.distill else max(obj.target_layer_ids)
    target = sum(target_layer_flops(t, i, rows, seq_len) for i in range(last + 1))
    # Drafter: fc on context features; per layer, context k/v and the block tokens' layer, each
    # block query attending to S context keys and its Bk block keys.
    tokens = rows * obj.num_anchors * obj.block_size
    fc = 2 * rows * seq_len * len(obj.target_layer_ids) * h * h
    ctx_kv = 2 * rows * seq_len * h * 2 * d.num_kv_heads * hd
    blocks = 2 * tokens * layer_weights(h, d.intermediate_size, d.num_heads, d.num_kv_heads)
    attention = 2 * 2 * tokens * (seq_len + obj.block_size) * d.num_heads * hd
    drafter_forward = fc + d.num_layers * (ctx_kv + blocks + attention)
    slots = rows * obj.num_anchors * d.num_scored
    lm_head = 2 * slots * h * t.vocab_size
    target += lm_head if obj.needs_target_distribution else 0
    # The kind's heads on every scored slot, forward (`Kind.head_flops`).
    heads = slots * kind.head_flops(d, t.vocab_size)
    # Backward: dX and dW for trained matmuls (fc needs no dX: its input is frozen), dX only
    # through the frozen LM head (computed in its forward pass, objective.lm_head_cross_entropy).
    drafter_total = 3 * drafter_forward - fc + 2 * lm_head + 3 * heads
    layers = d.num_layers * (ctx_kv + blocks + attention)
    return float(target), float(drafter_total), float(layers), float(d.num_layers * attention)
