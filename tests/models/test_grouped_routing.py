"""Grouped sigmoid routing against transformers' routers: DeepSeek-V3 (8 groups, 3 kept, routed
scaling 2.5) and MiniMax-M2 (one group, renormalized), with a load-balancing bias large enough to
change which experts are picked."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds
from transformers.models.minimax_m2 import modeling_minimax_m2 as mm

from dflash_jax.models.layers.moe import grouped_sigmoid_routing

HIDDEN, EXPERTS = 32, 32


def _routed(weights, experts):
    """(per token, expert -> weight) maps: the order of the picks does not matter."""
    return [dict(zip(e.tolist(), w.tolist())) for w, e in zip(np.asarray(weights), np.asarray(experts))]


def _assert_same_routing(ours, theirs):
    for got, want in zip(_routed(*ours), _routed(*theirs)):
        assert got.keys() == want.keys()
        np.testing.assert_allclose([got[k] for k in want], list(want.values()), rtol=1e-6)


def test_deepseek_v3_grouped_routing_equals_transformers():
    config = transformers.DeepseekV3Config(
        hidden_size=HIDDEN, n_routed_experts=EXPERTS, num_experts_per_tok=4, n_group=8, topk_group=3
    )
    router = ds.DeepseekV3TopkRouter(config)
    torch.manual_seed(0)
    with torch.no_grad():
        router.weight.normal_(0, 0.3)
        router.e_score_correction_bias.normal_(0, 0.3)
    x = torch.randn(64, HIDDEN)
    with torch.no_grad():
        logits, weights, experts = router(x)
    bias = router.e_score_correction_bias.numpy()
    route = jax.jit(
        lambda logits, bias: grouped_sigmoid_routing(
            logits, bias, top_k=4, num_groups=8, groups_kept=3, scale=config.routed_scaling_factor
        )
    )
    ours = route(jnp.asarray(logits.numpy()), jnp.asarray(bias))
    _assert_same_routing(ours, (weights.numpy(), experts.numpy()))
    # The bias and the groups matter: without them other experts win for some tokens.
    plain = jax.lax.top_k(jax.nn.sigmoid(jnp.asarray(logits.numpy())), 4)[1]
    assert (np.sort(np.asarray(plain), -1) != np.sort(experts.numpy(), -1)).any(-1).mean() > 0.3


def test_minimax_m2_routing_equals_transformers():
    config = transformers.MiniMaxM2Config(hidden_size=HIDDEN, num_local_experts=EXPERTS, num_experts_per_tok=3)
    router = mm.MiniMaxM2TopKRouter(config)
    torch.manual_seed(1)
    with torch.no_grad():
        router.weight.normal_(0, 0.3)
    bias = torch.randn(EXPERTS) * 0.3
    x = torch.randn(64, HIDDEN)
    with torch.no_grad():
        logits, weights, experts = router(x, bias)
    ours = jax.jit(lambda logits, bias: grouped_sigmoid_routing(logits, bias, top_k=3))(
        jnp.asarray(logits.numpy()), jnp.asarray(bias.numpy())
    )
    _assert_same_routing(ours, (weights.numpy(), experts.numpy()))
