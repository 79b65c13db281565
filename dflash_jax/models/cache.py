"""Key/value caches for decoding: one `LayerCache` per layer, plus the valid length per row.

Shapes: B batch rows, M cache slots, K kv heads, H head dim. Each layer takes its own
`LayerCache` and returns the updated one, so the data flow is explicit; under a donated jit
argument every layer's buffers are updated in place.
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
    """Per-layer caches; `lengths` [B] counts the valid slots, the same for every layer.

    Lowering `lengths` rolls back (rejected drafts): slots past it are never attended to and are
    overwritten by the next write.
    """

    layers: tuple[LayerCache, ...]
    lengths: jax.Array  # [B] int32

    @classmethod
    def create(cls, num_layers: int, batch: int, max_len: int, num_kv_heads: int, head_dim: int, dtype) -> KVCache:
        layers = tuple(LayerCache.create(batch, max_len, num_kv_heads, head_dim, dtype) for _ in range(num_layers))
        return cls(layers, jnp.zeros((batch,), jnp.int32))

    @property
    def max_len(self) -> int:
        return self.layers[0].k.shape[1]
