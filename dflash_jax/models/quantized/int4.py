"""INT4 group-quantized weights (Kimi-K2 Thinking / K2.5 routed experts) to dense arrays, on the host.

Kimi publishes its routed experts in compressed-tensors' `pack-quantized` format: symmetric int4
values in groups of 32 along the input (`quantization_config.config_groups.*.weights`), stored as
`weight_packed` int32 [out, ceil(in / 8)] (eight values a word, the first in the lowest 4 bits,
each as value + 8), `weight_scale` [out, in / group] (bf16) and `weight_shape` [2] = (out, in). The
dense weight is value times its group's scale. Attention, the shared expert, the dense first layers,
norms, embeddings, the routers and the LM head are stored in bf16.
"""

from __future__ import annotations

import numpy as np

BITS = 4
PER_WORD = 32 // BITS


def dequantize_int4_groups(packed: np.ndarray, scale: np.ndarray, shape, dtype=np.float32) -> np.ndarray:
    """packed int32 [out, ceil(in / 8)], scale [out, in / group], shape (out, in) -> [out, in] in `dtype`."""
    packed = np.asarray(packed)
    rows, cols = (int(n) for n in shape)
    if packed.dtype != np.int32 or packed.shape != (rows, -(-cols // PER_WORD)):
        raise ValueError(
            f"packed int4 weight must be int32 [{rows}, {-(-cols // PER_WORD)}], got {packed.dtype} {packed.shape}"
        )
    if scale.ndim != 2 or scale.shape[0] != rows or cols % scale.shape[1]:
        raise ValueError(f"int4 scales {scale.shape} do not group a [{rows}, {cols}] weight")
    shifts = np.arange(PER_WORD, dtype=np.int32) * BITS
    values = ((packed[..., None] >> shifts) & 0xF).reshape(rows, -1)[:, :cols].astype(np.float32) - 8
    groups = values.reshape(rows, scale.shape[1], -1) * np.asarray(scale, np.float32)[..., None]
    return groups.reshape(rows, cols).astype(dtype)
