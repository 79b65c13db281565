"""DSpark (DeepSeek's DeepSpec `Qwen3DSparkModel`, served by vLLM's `qwen3_dspark.py`;
docs/design.md "Drafter kinds"): the DFlash backbone with a Markov head and a confidence head. Its
loss is DeepSpec's (training/kinds/dspark.py); its drafts walk the block, each after the one
before, and may stop at the first unconfident slot (decoding/drafting.py's `markov_walk`).

Every slot k of the block [anchor, MASK, ...] drafts the token after it. The Markov head adds a
bias from the token before slot k's (x_{k-1}; the anchor for slot 0) to the unary logits:
logits_k = U_k + W2 · W1[x_{k-1}], W1 an embedding [V, r] and W2 a projection r -> V. The
confidence head estimates the probability that slot k's draft is accepted given the prefix:
c_k = sigmoid(proj([h_k; W1[x_{k-1}]])). Parameter names are the export's (`markov_head.markov_w1`,
`markov_head.markov_w2`, `confidence_head.proj`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from dflash_jax.models.kind import PER_CONVERSATION_ANCHORS, FieldReader, Kind, LlamaCpp, Vllm
from dflash_jax.models.layers.basic import linear
from dflash_jax.models.sharding import EMBED, NORM, VOCAB


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


@dataclasses.dataclass(frozen=True, kw_only=True)
class DSparkFields:
    # drafter.kind='dspark': rank of the Markov head (and the previous token's part of the
    # confidence head's input).
    markov_rank: int = 256


# dflash_config's `projector_type`, which SpecForge's DSpark configs carry.
PROJECTOR_TYPE = "dspark"


def _export(cfg) -> tuple[dict, dict]:
    """vLLM reads the heads' layout at the top level (DeepSpec writes it there too), SpecForge
    under dflash_config with its `projector_type`: both places. The confidence head always reads
    the Markov embedding of the previous token."""
    heads = {
        "markov_rank": cfg.markov_rank,
        "markov_head_type": "vanilla",
        "enable_confidence_head": True,
        "confidence_head_with_markov": True,
    }
    top = {
        "mask_token_id": cfg.mask_token_id,
        "target_layer_ids": list(cfg.target_layer_ids),
        **heads,
        "draft_vocab_size": cfg.vocab_size,
    }
    return {"projector_type": PROJECTOR_TYPE, **heads}, top


def _unsupported(field: FieldReader) -> list[str]:
    """The layout vLLM's qwen3_dspark.py and ours share: the vanilla Markov head and a confidence
    head on [h; W1 x]; the other variants are not ours to load."""
    wanted = {"markov_head_type": "vanilla", "enable_confidence_head": True, "confidence_head_with_markov": True}
    return [
        f"DSpark drafter with {name}={field(name, None)!r}: only {name}={value!r} is supported"
        for name, value in wanted.items()
        if field(name, value) != value
    ]


def _heads(cfg, *, compute_dtype, **head_kw) -> dict:
    return {
        "markov_head": MarkovHead(cfg.vocab_size, cfg.markov_rank, compute_dtype=compute_dtype, **head_kw),
        "confidence_head": ConfidenceHead(cfg.hidden_size, cfg.markov_rank, **head_kw),
    }


KIND = Kind(
    "dspark",
    # DeepSpec's and SpecForge's training-time name `DSparkDraftModel` (model_type qwen3) is vLLM's
    # `Qwen3DSparkModel`.
    ("Qwen3DSparkModel", "DSparkDraftModel"),
    fields=DSparkFields,
    projector_type=PROJECTOR_TYPE,
    # Every slot of the block drafts the token after it.
    first_draft_slot=0,
    export=_export,
    unsupported=_unsupported,
    heads=_heads,
    partition_rules=(
        (r"markov_w1\.embedding", (VOCAB, None)),
        (r"markov_w2\.kernel", (None, VOCAB)),
        (r"confidence_head\.proj\.kernel", (EMBED, None)),
        (r"confidence_head\.proj\.bias", (NORM,)),
    ),
    # The Markov bias (r -> V) and the confidence head (H + r -> 1).
    head_flops=lambda cfg, vocab: 2 * (cfg.markov_rank * vocab + cfg.hidden_size + cfg.markov_rank),
    adam_params=("markov_w1", "markov_w2"),
    # DeepSpec's slot weights exp(-k/4) over the prefix of scored slots, against the target's
    # distribution always (D-PACE's: 2.4 % lower held-out τ on the default job, two seeds).
    loss="dflash",
    loss_decay_gamma=4.0,
    # +4.6 % held-out τ over 1 anchor per 8 row tokens, at twice the step (two seeds).
    **PER_CONVERSATION_ANCHORS,
    reads_target_distribution=True,
    scores_prefix=True,
    confidence_head=True,
    # Every slot drafts, from the anchor on (llama.cpp's `sample_from_anchor`); ours has a
    # confidence head.
    llama_cpp=LlamaCpp(
        "draft-dspark",
        metadata=lambda hf: {"dflash.has_confidence_head": True},
        tensors={
            "markov_head.markov_w1.weight": "markov_w1.weight",
            "markov_head.markov_w2.weight": "markov_w2.weight",
            "confidence_head.proj.weight": "conf_proj.weight",
            "confidence_head.proj.bias": "conf_proj.bias",
        },
        vocab_rows=("markov_head.markov_w2.weight",),
    ),
    vllm=Vllm(
        "dspark",
        cpu_refused="vLLM serves DSpark in its V2 model runner only, which needs Triton "
        "('Model Runner V1 does not support: dspark speculative decoding')",
    ),
)
