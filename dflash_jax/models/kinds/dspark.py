"""DSpark's additions to the DFlash backbone (DeepSeek's DeepSpec `Qwen3DSparkModel`, served by
vLLM's `qwen3_dspark.py`; docs/design.md "Drafter kinds").

Every slot k of the block [anchor, MASK, ...] drafts the token after it. The Markov head adds a
bias from the token before slot k's (x_{k-1}; the anchor for slot 0) to the unary logits:
logits_k = U_k + W2 · W1[x_{k-1}], W1 an embedding [V, r] and W2 a projection r -> V. The
confidence head estimates the probability that slot k's draft is accepted given the prefix:
c_k = sigmoid(proj([h_k; W1[x_{k-1}]])). Parameter names are the export's (`markov_head.markov_w1`,
`markov_head.markov_w2`, `confidence_head.proj`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dflash_jax.models.layers import linear


class MarkovHead(nnx.Module):
    def __init__(self, vocab_size: int, rank: int, *, init_std, param_dtype, compute_dtype, rngs):
        self.compute_dtype = compute_dtype
        self.markov_w1 = nnx.Embed(
            vocab_size,
            rank,
            dtype=compute_dtype,
            param_dtype=param_dtype,
            embedding_init=nnx.initializers.normal(init_std),
            rngs=rngs,
        )
        self.markov_w2 = linear(
            rank, vocab_size, param_dtype=param_dtype, compute_dtype=compute_dtype, rngs=rngs, init_std=init_std
        )

    def embed(self, previous: jax.Array) -> jax.Array:
        """W1[x_{k-1}]: token ids [...] -> [..., r]."""
        return self.markov_w1(previous)

    def bias(self, embedding: jax.Array, w2: jax.Array | None = None) -> jax.Array:
        """W2 · e: [..., r] -> [..., V] fp32. `w2`: the kernel [r, V] to use instead of the
        module's own (training passes it in to take its gradient)."""
        kernel = self.markov_w2.kernel[...] if w2 is None else w2
        return jnp.einsum(
            "...r,rv->...v", embedding, kernel.astype(self.compute_dtype), preferred_element_type=jnp.float32
        )


class ConfidenceHead(nnx.Module):
    """The logit of c_k from [h_k; W1[x_{k-1}]], computed in fp32 as vLLM computes it."""

    def __init__(self, hidden_size: int, rank: int, *, init_std, param_dtype, rngs):
        self.proj = linear(
            hidden_size + rank,
            1,
            param_dtype=param_dtype,
            compute_dtype=jnp.float32,
            rngs=rngs,
            init_std=init_std,
            use_bias=True,
        )

    def __call__(self, hidden: jax.Array, embedding: jax.Array) -> jax.Array:
        """hidden [..., D], embedding [..., r] -> confidence logits [...] fp32."""
        features = jnp.concatenate([hidden, embedding], axis=-1).astype(jnp.float32)
        return self.proj(features)[..., 0]
