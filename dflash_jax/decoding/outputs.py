"""Fixed-shape output buffer shared by target-only and speculative decoding.

Each step appends a variable number of tokens per row; the buffer applies the stop rules (stop
tokens are kept in the output and end the row; `max_new_tokens` caps it) so both decoders stop
at exactly the same token, which is what makes the lossless comparison meaningful.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from dflash_jax.models.layers.cache import write_rows


@flax.struct.dataclass
class Outputs:
    """tokens [B, capacity] (valid up to `lengths` [B]); `done` [B] rows take no more tokens."""

    tokens: jax.Array
    lengths: jax.Array
    done: jax.Array

    @classmethod
    def create(cls, batch: int, capacity: int) -> Outputs:
        return cls(
            jnp.zeros((batch, capacity), jnp.int32),
            jnp.zeros((batch,), jnp.int32),
            jnp.zeros((batch,), bool),
        )


def append(
    out: Outputs,
    new: jax.Array,
    num_new: jax.Array,
    *,
    stop_ids: jax.Array,
    max_new_tokens: jax.Array,
) -> tuple[Outputs, jax.Array]:
    """Append new[:, :num_new] [B, T] to the rows that are not done, up to the stop rules.

    stop_ids [S] holds the stop tokens padded with -1 (an array, so that changing them never
    recompiles); max_new_tokens is a scalar array for the same reason.

    Returns (outputs, emitted [B]): how many tokens each row really took (0 for done rows).
    The buffer needs capacity >= max_new_tokens + T: all T slots are written at `lengths`
    (static shape) and `dynamic_update_slice` would silently shift a write that does not fit.
    """
    t = new.shape[1]
    slots = jnp.arange(t)[None, :]
    valid = slots < num_new[:, None]
    is_stop = (new[:, :, None] == stop_ids[None, None, :]).any(-1) & valid
    first_stop = jnp.where(is_stop.any(-1), jnp.argmax(is_stop, axis=-1), t)
    emitted = jnp.minimum(num_new, first_stop + 1)
    emitted = jnp.minimum(emitted, max_new_tokens - out.lengths)
    emitted = jnp.where(out.done, 0, emitted)
    lengths = out.lengths + emitted
    stopped = first_stop < emitted
    done = out.done | stopped | (lengths >= max_new_tokens)
    tokens = write_rows(out.tokens, new.astype(jnp.int32), out.lengths)
    return Outputs(tokens, lengths, done), emitted


def stop_ids(stop_tokens, size: int = 8) -> jax.Array:
    """Stop tokens as a -1-padded array; sizes are multiples of `size` to keep shapes few."""
    tokens = sorted({int(t) for t in stop_tokens})
    if any(t < 0 for t in tokens):
        raise ValueError(f"stop tokens must be token ids >= 0, got {tokens}")
    padded = -(-max(len(tokens), 1) // size) * size
    return jnp.asarray(tokens + [-1] * (padded - len(tokens)), jnp.int32)
