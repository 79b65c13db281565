"""Token choice and block verification: greedy, or sampled with standard rejection sampling.

Verification follows speculative sampling (Leviathan et al. 2023; Chen et al. 2023): draft slot i
is accepted with probability min(1, p(d_i) / q(d_i)); at the first rejection the bonus token is
drawn from normalize(max(p - q, 0)), and after a fully accepted block from p. This makes the
output distribution exactly the target's (after the same temperature / top-k / top-p warping),
whatever the drafter proposes. DFlash drafts every slot independently from its own distribution
q_i, which is still a valid proposal: q_i is the probability with which d_i was drawn. Kinds
that walk the block draw d_i given d_1..d_{i-1} (decoding/kinds/); q_i is then that conditional
distribution, which is what the acceptance test of slot i needs, since it only runs after
d_1..d_{i-1} were accepted.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """temperature 0 means greedy; top_k 0 and top_p 1 switch those filters off.

    Hashable on purpose: it is a static argument of the jitted decoding steps.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = SamplingConfig()


def warp_probs(logits: jax.Array, cfg: SamplingConfig) -> jax.Array:
    """Logits [..., V] -> the sampling distribution after temperature, top-k and top-p."""
    x = logits.astype(jnp.float32) / cfg.temperature
    if cfg.top_k:
        kth = jax.lax.top_k(x, min(cfg.top_k, x.shape[-1]))[0][..., -1:]
        x = jnp.where(x < kth, -jnp.inf, x)
    if cfg.top_p < 1:
        sorted_x = -jnp.sort(-x, axis=-1)
        sorted_p = jax.nn.softmax(sorted_x, axis=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        keep = jnp.cumsum(sorted_p, axis=-1) - sorted_p < cfg.top_p
        cutoff = jnp.min(jnp.where(keep, sorted_x, jnp.inf), axis=-1, keepdims=True)
        x = jnp.where(x < cutoff, -jnp.inf, x)
    return jax.nn.softmax(x, axis=-1)


def argmax(logits: jax.Array) -> jax.Array:
    """Logits [..., V] -> int32 [...]: `jnp.argmax` (the lowest id among the largest logits) as a
    max and a min, which vectorize: XLA:CPU runs argmax as a variadic reduce, about 6x slower
    over a 49k vocabulary, and a DFlash step takes it over every slot twice (docs/design.md §11).
    A row holding NaN gives V - 1."""
    vocab = logits.shape[-1]
    top = jnp.max(logits, axis=-1, keepdims=True)
    ids = jnp.arange(vocab, dtype=jnp.int32)
    return jnp.min(jnp.where(logits == top, ids, vocab - 1), axis=-1)


def choose(logits: jax.Array, cfg: SamplingConfig, key: jax.Array) -> jax.Array:
    """Logits [..., V] -> tokens [...]: argmax when greedy, else a sample of `warp_probs`."""
    if cfg.greedy:
        return argmax(logits)
    return _sample(key, warp_probs(logits, cfg))


def _sample(key: jax.Array, probs: jax.Array) -> jax.Array:
    return jax.random.categorical(key, jnp.log(probs), axis=-1).astype(jnp.int32)


def _leading_true(x: jax.Array) -> jax.Array:
    """[B, N] bool -> [B] length of the all-True prefix."""
    return jnp.sum(jnp.cumprod(x.astype(jnp.int32), axis=-1), axis=-1)


def verify_block(
    drafts: jax.Array,
    draft_logits: jax.Array,
    target_logits: jax.Array,
    cfg: SamplingConfig,
    key: jax.Array,
    proposed: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Accept a prefix of the drafts and choose the bonus token.

    drafts [B, N] were proposed for the N slots after the anchor, from draft_logits [B, N, V]
    (the drafts need not be independent: q_i is the distribution slot i was drawn from given the
    drafts before it); target_logits [B, N+1, V] are the target's predictions after the anchor
    and after each draft. `proposed` [B] (default N): only the first `proposed` drafts are
    offered; the rest are neither accepted nor subtracted from the bonus distribution.
    Returns (accepted [B] in 0..N, tokens [B, N+1]) where tokens[:, :accepted+1] is the output of
    this step: the accepted drafts followed by the bonus token.
    """
    offered = jnp.arange(drafts.shape[1])[None, :] < (drafts.shape[1] if proposed is None else proposed[:, None])
    if cfg.greedy:
        target_choice = argmax(target_logits)
        accepted = _leading_true((drafts == target_choice[:, :-1]) & offered)
        # Where drafts were accepted they equal the target's choice, so the target's row is the output.
        return accepted, target_choice

    key_accept, key_bonus = jax.random.split(key)
    p = warp_probs(target_logits, cfg)  # [B, N+1, V]
    q = jnp.where(offered[..., None], warp_probs(draft_logits, cfg), 0.0)  # [B, N, V]
    p_draft = jnp.take_along_axis(p[:, :-1], drafts[..., None], axis=-1)[..., 0]
    q_draft = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    u = jax.random.uniform(key_accept, drafts.shape)
    accepted = _leading_true((u * q_draft < p_draft) & offered)

    # Bonus distribution at slot `accepted`: the residual max(p - q, 0) after a rejection, or p
    # itself after a full block (q is padded with zeros there).
    q_padded = jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1)
    rows = jnp.arange(drafts.shape[0])
    p_at, q_at = p[rows, accepted], q_padded[rows, accepted]
    residual = jnp.maximum(p_at - q_at, 0.0)
    mass = residual.sum(-1, keepdims=True)
    residual = jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), p_at)
    bonus = _sample(key_bonus, residual)

    slots = jnp.arange(drafts.shape[1] + 1)[None, :]
    padded_drafts = jnp.concatenate([drafts, jnp.zeros_like(drafts[:, :1])], axis=1)
    tokens = jnp.where(slots < accepted[:, None], padded_drafts, bonus[:, None])
    return accepted, tokens
