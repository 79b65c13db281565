"""Model FLOPs of one train step, counted analytically (shared by `bench/` and the plan).

The count is the model's matmul FLOPs as the implementation computes them: the frozen target's
forward through its last feature layer (each layer's multiply-adds as its mechanisms count them:
`models.transformer.layer_macs`), the drafter's forward, twice that again for its backward (dX
and dW), and dX through the frozen LM head; for the drafter kinds, their heads' matmuls too
(docs/design.md "Drafter kinds").
Recomputation in the backward pass is not counted here; `remat_flops_per_step` counts it.
"""

from __future__ import annotations

from dflash_jax.models.layers.basic import swiglu_macs
from dflash_jax.models.layers.mixers import projection_macs
from dflash_jax.models.transformer import layer_macs
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


def _parts(setup: TrainSetup, rows: int, seq_len: int) -> tuple[float, float, float, float]:
    """(target forward, drafter forward + backward, drafter layers' forward, drafter attention
    forward)."""
    t, d, obj = setup.target, setup.drafter, setup.objective
    kind = d.kind_spec
    h, hd = t.hidden_size, d.head_dim

    def layer_weights(hidden, inter, heads, kv_heads):  # multiply-adds per token
        weights = projection_macs(hidden, heads, kv_heads, hd) + swiglu_macs(hidden, inter)
        return weights + kind.layer_macs(d)  # the kind's own per layer

    # Target: forward through the last feature layer (the last layer, and the LM head on the
    # slots, to distill).
    last = t.num_layers - 1 if obj.distill else max(d.target_layer_ids)
    target = sum(2.0 * layer_macs(t, i, rows, seq_len) for i in range(last + 1))
    # Drafter: fc on context features; per layer, context k/v and the block tokens' layer, each
    # block query attending to S context keys and its Bk block keys.
    tokens = rows * obj.num_anchors * d.block_size
    fc = 2 * rows * seq_len * len(d.target_layer_ids) * h * h
    ctx_kv = 2 * rows * seq_len * h * 2 * d.num_kv_heads * hd
    blocks = 2 * tokens * layer_weights(h, d.intermediate_size, d.num_heads, d.num_kv_heads)
    attention = 2 * 2 * tokens * (seq_len + d.block_size) * d.num_heads * hd
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
