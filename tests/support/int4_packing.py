"""compressed-tensors' `pack-quantized` int4 packing (its `pack_to_int32` along the input axis, as
the library documents and implements it), written here as the reference the loader's unpacking is
checked against: values + 8, eight to an int32 word from the lowest bits up, rows padded with zeros
to a whole word."""

from __future__ import annotations

import numpy as np


def pack_int4(values: np.ndarray) -> np.ndarray:
    """int values in [-8, 7], [out, in] -> int32 [out, ceil(in / 8)]."""
    rows, cols = values.shape
    unsigned = np.zeros((rows, -(-cols // 8) * 8), np.uint32)
    unsigned[:, :cols] = (values + 8).astype(np.uint32)
    words = np.zeros((rows, unsigned.shape[1] // 8), np.uint32)
    for i in range(8):
        words |= unsigned[:, i::8] << np.uint32(4 * i)
    return words.view(np.int32)
