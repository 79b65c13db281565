"""Per-slot loss terms on the frozen LM head, a chunk of blocks at a time, each chunk's gradient
taken in the forward pass (the drafter kinds' heads; DFlash's own cross-entropy is
`objective.lm_head_cross_entropy`, hand-differentiated the same way).

The [blocks × vocab] logits never exist at once and are never recomputed: each chunk computes
its logits, its terms and, by `jax.vjp` while those logits exist, the gradient of its terms with
respect to its inputs (the hidden states and other per-slot arrays) and to the head parameters
it reads (a codebook, a projection onto the vocabulary), which a scan adds up over the chunks.
The result carries that gradient through a linear term whose value is zero.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from dflash_jax.models.layers.basic import top_k
from dflash_jax.models.layers.chunking import scan_block_chunks
from dflash_jax.models.sharding import BATCH, VOCAB, activation_spec, active_mesh, constrain_spec, per_device

# The frozen LM head: hidden [..., D] -> logits [..., V].
Unembed = Callable[[jax.Array], jax.Array]
# What a drafter kind's loss terms return (`Kind.loss_terms`): (Σ w·loss, slot weights, hits).
Terms = tuple[jax.Array, jax.Array, jax.Array]


def vocab_parallel_logits(unembed: Callable[[jax.Array], jax.Array], shape) -> Callable[[jax.Array], jax.Array]:
    """hidden [..., D] of `shape` -> logits [..., V] in fp32 at least, split over vocab where the layout
    splits the LM head (docs/design.md §8): the hidden states are gathered over the vocab's mesh
    axes instead of the LM head, and the logits stay split."""
    logits_spec = activation_spec(
        jax.eval_shape(unembed, jax.ShapeDtypeStruct(shape, jnp.float32)).shape, (BATCH, ..., VOCAB)
    )

    def logits_of(h):
        if logits_spec is not None:  # rows over what vocab leaves, the model dim whole
            h = constrain_spec(h, PartitionSpec(*logits_spec[:-1], None))
        logits = unembed(h)
        return constrain_spec(logits.astype(jnp.promote_types(logits.dtype, jnp.float32)), logits_spec)

    return logits_of


def vocab_parallel_top_k(logits: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """`lax.top_k` of logits [..., V] -> (values, ids) [..., k], without gathering the logits where
    the layout splits the vocabulary: each device takes its shard's top-k, then all devices the
    top-k of the gathered n·k (XLA's partitioner would gather the logits for a sharded top-k)."""
    spec = activation_spec(logits.shape, (BATCH, ..., VOCAB))
    if spec is None or spec[-1] is None:
        return top_k(logits, k)
    axes = spec[-1]

    def per_shard(shard):  # this device's [..., V / n]
        values, ids = top_k(shard, k)
        ids = ids + shard.shape[-1] * jax.lax.axis_index(axes)
        values = jax.lax.all_gather(values, axes, axis=values.ndim - 1, tiled=True)
        ids = jax.lax.all_gather(ids, axes, axis=ids.ndim - 1, tiled=True)
        values, best = top_k(values, k)
        return values, jnp.take_along_axis(ids, best, axis=-1)

    mesh, out = active_mesh(), PartitionSpec(*spec[:-1], None)
    with per_device():
        return jax.shard_map(per_shard, mesh=mesh, in_specs=spec, out_specs=(out, out), check_vma=False)(logits)


def chunked_terms(fn: Callable, inputs, constants, params, *, chunk_blocks: int):
    """Σ over chunks of `fn(inputs, constants, params) -> (scalar, per-block outputs)`, with its
    gradient with respect to `inputs` and `params`.

    inputs and constants are pytrees of [R, N, ...] arrays (blocks on axis 1), fed to `fn`
    `chunk_blocks` blocks at a time; params are whole arrays every chunk reads. `fn` must return
    0 for an all-zero block (the last chunk is zero-padded) and keep blocks independent.
    Returns (the sum, outputs [R, N, ...] without gradient).
    """
    frozen_inputs, frozen_params = jax.lax.stop_gradient((inputs, params))

    def chunk(carry, xs):
        chunk_inputs, chunk_constants = xs
        with jax.named_scope("lm_head"):  # names its collectives in `python -m dflash_jax.plan`
            value, pullback, out = jax.vjp(
                lambda i, p: fn(i, chunk_constants, p), chunk_inputs, frozen_params, has_aux=True
            )
            grad_inputs, grad_params = pullback(jnp.ones_like(value))
        total, param_grads = carry
        return (total + value, jax.tree.map(jnp.add, param_grads, grad_params)), (out, grad_inputs)

    # The sum in fp32 at least (float64 where the inputs are: the reference comparisons).
    zero = (jnp.zeros((), _at_least_fp32(jax.tree.leaves(inputs)[0])), jax.tree.map(jnp.zeros_like, frozen_params))
    (total, grad_params), (out, grad_inputs) = scan_block_chunks(chunk, zero, (frozen_inputs, constants), chunk_blocks)
    # The value is the sum; the gradient flows into the callers' (differentiable) arrays.
    return total + _linear(inputs, grad_inputs) + _linear(params, grad_params), out


def _linear(xs, grads) -> jax.Array:
    """Σ x·g less its own value: zero, with gradient g with respect to x."""
    terms = [
        jnp.sum(x.astype(_at_least_fp32(x)) * jax.lax.stop_gradient(g).astype(_at_least_fp32(x)))
        for x, g in zip(jax.tree.leaves(xs), jax.tree.leaves(grads))
    ]
    linear = sum(terms, jnp.zeros((), jnp.float32))
    return linear - jax.lax.stop_gradient(linear)


def _at_least_fp32(x: jax.Array):
    return jnp.promote_types(x.dtype, jnp.float32)
