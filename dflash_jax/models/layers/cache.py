"""Decoding caches: one slice per layer (whatever its mixer keeps: `LayerCache` for attention),
plus the valid length per row.

Shapes: B batch rows, M cache slots, K kv heads, H head dim. Each layer takes its own slice and
returns the updated one, so the data flow is explicit; under a donated jit argument every
layer's buffers are updated in place.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


def write_rows(buffer: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    """buffer [B, M, ...] gets new [B, T, ...] at slots start[b] .. start[b] + T - 1.

    One scatter into the whole buffer, so a donated buffer is updated in place. Callers size
    their buffers so that every write fits (`Decoder` reserves a block beyond the last token).
    """
    rows = jnp.arange(new.shape[0])[:, None]
    slots = start[:, None] + jnp.arange(new.shape[1])[None, :]
    return buffer.at[rows, slots].set(new.astype(buffer.dtype), mode="drop")


def leading_slots(buffer: jax.Array, num_slots: int | None) -> jax.Array:
    """The first `num_slots` slots of buffer [B, M, ...] (None: all M), what a decoding step's
    attention reads: its cost then follows the used prefix of the cache, not the cache's size."""
    return buffer if num_slots is None else buffer[:, :num_slots]


@flax.struct.dataclass
class LayerCache:
    k: jax.Array  # [B, M, K, H]
    v: jax.Array  # [B, M, K, H]

    @classmethod
    def create(cls, batch: int, max_len: int, num_kv_heads: int, head_dim: int, dtype) -> LayerCache:
        shape = (batch, max_len, num_kv_heads, head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

    def write(self, k: jax.Array, v: jax.Array, start: jax.Array) -> LayerCache:
        """k, v [B, T, K, H] written at slots start[b] onwards."""
        return LayerCache(write_rows(self.k, k, start), write_rows(self.v, v, start))


@flax.struct.dataclass
class KVCache:
    """Per-layer cache slices; `lengths` [B] counts the valid tokens, the same for every layer.

    Lowering `lengths` rolls back (rejected drafts): attention slots past it are never attended to
    and are overwritten by the next write; a mixer with a recurrent state keeps what it needs to
    restart from any length its last write passed through.
    """

    layers: tuple  # one slice per layer, as its mixer's `new_cache` made it
    lengths: jax.Array  # [B] int32
    max_len: int = flax.struct.field(pytree_node=False)  # tokens a row may hold

    @classmethod
    def create(cls, layers: tuple, batch: int, max_len: int) -> KVCache:
        return cls(tuple(layers), jnp.zeros((batch,), jnp.int32), max_len)
