"""Tiny targets and drafters for the decoding tests, built directly in JAX (no torch, seconds).

* `random_target`: a random Qwen3-style target; its greedy output depends on the whole context.
* `successor_target`: the next token is mostly `successor[current token]`; `noise` scales the
  layers' contributions, so the context decides some of the tokens (0 means never).
* `OracleDrafter`: a drafter double that drafts successor[anchor], successor[successor[anchor]],
  ... through the same interface as `DFlashDrafter`. Against the noise-free successor target it
  copies the target exactly (full blocks are accepted); against a noisy one it is right until
  the context disagrees, which exercises every acceptance length and the cache roll-back.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dflash_jax.models.architecture import RopeConfig, TransformerConfig
from dflash_jax.models.drafter import ContextCache, DFlashDrafter
from dflash_jax.models.drafter_config import DrafterConfig
from dflash_jax.models.transformer import Transformer

VOCAB = 64
BLOCK = 4
MASK_ID = VOCAB - 1
CHAT_VOCAB = 512  # `chat_target`: the test tokenizer uses ~400 ids, the rows above stay unused


def target_config(vocab: int = VOCAB) -> TransformerConfig:
    return TransformerConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        rope=RopeConfig(theta=10000.0),
        max_position_embeddings=512,
    )


def make_target(seed: int = 0, vocab: int = VOCAB, logit_scale: float = 1.0) -> Transformer:
    target = Transformer(target_config(vocab), rngs=nnx.Rngs(seed))
    target.lm_head.kernel[...] = target.lm_head.kernel[...] * logit_scale
    return target


def make_drafter(
    target: Transformer, seed: int = 0, block_size: int = BLOCK, mask_id: int = MASK_ID, kind: str = "dflash", **heads
):
    cfg = DrafterConfig.for_target(
        target.cfg,
        num_layers=1,
        mask_token_id=mask_id,
        block_size=block_size,
        target_layer_ids=(0, 1),
        kind=kind,
        **heads,
    )
    return DFlashDrafter(cfg, rngs=nnx.Rngs(seed))


def perturbed(drafter: nnx.Module, seed: int = 0, scale: float = 0.05) -> nnx.Module:
    """The drafter with every parameter moved off its initial value (DFlash2's identity
    convolutions included), so that no part can hide behind a zero or an identity."""
    _, state = nnx.split(drafter)
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    nnx.update(
        drafter, jax.tree.unflatten(treedef, [x + scale * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])
    )
    return drafter


def successor_drafter(target: Transformer, successor: np.ndarray, kind: str, scale: float = 5.0) -> DFlashDrafter:
    """A real DFlash2, DSpark or XPress drafter whose heads draft successor[previous token], slot
    after slot from the anchor: the oracle of `OracleDrafter`, through the kinds' own walks.

    Its layers add nothing (zero output projections), so every mask slot's hidden state is the
    same h. DFlash2: every token is a candidate, P(h) = scale·1, A = scale·I and B[b] = scale·e_a
    for b = successor[a], so the pair score is scale³ for the successor, 0 elsewhere. DSpark:
    W1 = scale·I and W2[a, successor[a]] = scale², a Markov bias of scale³ for the successor.
    XPress: the same W1 and W2 (as w1 and w2), in_proj passing w1's part alone and the SwiGLU
    adding nothing, so that its Jacobi passes reach the successors (B - 1 passes or more).
    Each outweighs the unary logits."""
    fields = {
        "dflash2": dict(selector_rank=VOCAB, selector_top_k=VOCAB),
        "dspark": dict(markov_rank=VOCAB),
        "xpress": dict(xpress_rank=VOCAB, xpress_mlp_hidden=8),
    }[kind]
    drafter = make_drafter(target, kind=kind, **fields)
    for layer in drafter.layers:
        layer.self_attn.o_proj.kernel[...] = jnp.zeros_like(layer.self_attn.o_proj.kernel[...])
        layer.mlp.down_proj.kernel[...] = jnp.zeros_like(layer.mlp.down_proj.kernel[...])
    identity, inverse = scale * jnp.eye(VOCAB), np.argsort(successor)
    if kind == "dflash2":
        h = drafter.norm(target.embed(jnp.asarray([MASK_ID])))[0]
        selector = drafter.candidate_selector
        selector.hidden_projection.kernel[...] = jnp.outer(h / jnp.sum(h * h), jnp.full((VOCAB,), scale))
        selector.predecessor_codebook[...] = identity
        selector.successor_codebook[...] = identity[inverse]
    elif kind == "dspark":
        drafter.markov_head.markov_w1.embedding[...] = identity
        drafter.markov_head.markov_w2.kernel[...] = scale * identity[successor]  # row a: scale² at successor[a]
    else:
        head = drafter.xpress_head
        head.w1.embedding[...] = identity
        head.in_proj.kernel[...] = jnp.zeros_like(head.in_proj.kernel[...]).at[2 * VOCAB :].set(jnp.eye(VOCAB))
        head.mlp.down_proj.kernel[...] = jnp.zeros_like(head.mlp.down_proj.kernel[...])
        head.w2.kernel[...] = scale * identity[successor]
    return drafter


def make_successor_target(seed: int = 0, noise: float = 0.0) -> tuple[Transformer, np.ndarray]:
    """A target whose next token is successor[token] up to context noise; returns (target, successor).

    Embedding rows get equal norms and lm_head row j is the embedding of successor⁻¹(j), so a
    hidden state equal to E[x] scores successor[x] highest by a wide margin; scaling each layer's
    output projections by `noise` lets attention over the context move that choice.
    """
    target = make_target(seed)
    rng = np.random.default_rng(seed)
    successor = rng.permutation(VOCAB).astype(np.int32)
    embed = rng.standard_normal((VOCAB, target.cfg.hidden_size)).astype(np.float32)
    embed *= np.sqrt(target.cfg.hidden_size) / np.linalg.norm(embed, axis=1, keepdims=True)
    target.embed_tokens.embedding[...] = jnp.asarray(embed)
    inverse = np.argsort(successor)
    target.lm_head.kernel[...] = jnp.asarray(embed[inverse].T)
    target.norm.weight[...] = jnp.ones_like(target.norm.weight[...])
    for layer in target.layers:
        layer.self_attn.o_proj.kernel[...] = layer.self_attn.o_proj.kernel[...] * noise
        layer.mlp.down_proj.kernel[...] = layer.mlp.down_proj.kernel[...] * noise
    return target, successor


class OracleDrafter(nnx.Module):
    """Drafts by following the successor table from the anchor; keeps only context bookkeeping."""

    def __init__(self, target: Transformer, successor: np.ndarray, block_size: int = BLOCK):
        self.cfg = DrafterConfig.for_target(
            target.cfg, num_layers=1, mask_token_id=MASK_ID, block_size=block_size, target_layer_ids=(0,)
        )
        self.compute_dtype = jnp.float32
        self.embedding = nnx.Variable(target.embed_tokens.embedding[...])
        self.successor = nnx.Variable(jnp.asarray(successor))

    def new_cache(self, batch: int, max_len: int) -> ContextCache:
        return ContextCache.create((), batch, max_len)

    def extend_context(self, cache: ContextCache, features, positions, num_valid) -> ContextCache:
        return cache.replace(lengths=cache.lengths + num_valid)

    def decode(self, block_embeds, block_positions, cache: ContextCache, *, num_slots=None):
        """Slot k returns E[successor^(k-1)(anchor)], which the target's head maps to successor^k."""
        table = self.embedding[...]
        token = jnp.argmax(block_embeds[:, 0] @ table.T, axis=-1)
        hidden = [table[token]]
        for _ in range(1, self.cfg.block_size):
            hidden.append(table[token])
            token = self.successor[...][token]
        return jnp.stack(hidden, axis=1)


def random_prompts(seed: int, lengths, vocab: int = VOCAB - 1) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).astype(np.int32) for n in lengths]


class ScriptedDrafter(nnx.Module):
    """Drafts a known continuation, deliberately wrong at every position p with p % `miss_every`
    == 0: acceptance lengths then vary from step to step, so verification rolls every cache back
    by different amounts. `sequences` [B, P]: each row's prompt followed by the target's own
    greedy output (row b of every batch the decoder runs)."""

    def __init__(self, target: Transformer, sequences: np.ndarray, block_size: int = BLOCK, miss_every: int = 5):
        self.cfg = DrafterConfig.for_target(
            target.cfg, num_layers=1, mask_token_id=0, block_size=block_size, target_layer_ids=(0,)
        )
        self.compute_dtype = jnp.float32
        # The hidden state that makes the target's LM head pick token t: a large multiple of its row.
        head = target.lm_head.kernel[...].T if target.lm_head is not None else target.embed_tokens.embedding[...]
        self.head_rows = nnx.Variable(100.0 * head / jnp.linalg.norm(head, axis=-1, keepdims=True))
        self.sequences = nnx.Variable(jnp.asarray(sequences, jnp.int32))
        self.miss_every = miss_every

    def new_cache(self, batch: int, max_len: int) -> ContextCache:
        return ContextCache.create((), batch, max_len)

    def extend_context(self, cache: ContextCache, features, positions, num_valid) -> ContextCache:
        return cache.replace(lengths=cache.lengths + num_valid)

    def decode(self, block_embeds, block_positions, cache: ContextCache, *, num_slots=None):
        """Slot k of a block anchored at position p drafts the token at p + k (slot 0 unused)."""
        seq = self.sequences[...]
        width = seq.shape[1]
        index = jnp.clip(block_positions, 0, width - 1)
        tokens = jnp.take_along_axis(seq[: index.shape[0]], index, axis=1)
        wrong = (tokens + 1) % self.head_rows.shape[0]
        tokens = jnp.where(block_positions % self.miss_every == 0, wrong, tokens)
        return self.head_rows[...][tokens]
