"""MXFP4 weights (gpt-oss checkpoints) to dense arrays, on the host, in bounded memory.

An MXFP4 tensor is stored as `*_blocks` uint8 [..., G, 16] and `*_scales` uint8 [..., G]: each
byte of a block holds two FP4 (E2M1) codes, the low nibble first, so a block is 32 values; the
whole block shares the scale 2**(scale - 127) (E8M0). The values are formed exactly in fp32 and
rounded once to the requested dtype.

gpt-oss stores the experts' weights row = output feature: `gate_up_proj_blocks` [E, 2I, D/32, 16]
and `down_proj_blocks` [E, D, I/32, 16]. `mxfp4_expert_weight` turns them into the [E, in, out]
tensors that transformers' own dequantization produces (`gate_up_proj` [E, D, 2I], `down_proj`
[E, I, D]).
"""

from __future__ import annotations

import numpy as np

# The 16 FP4 (E2M1) code points, indexed by the 4-bit code.
FP4_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32
)
# Both values of every byte: [256, 2] = (low nibble, high nibble); one gather decodes a byte.
_BYTE_VALUES = np.stack([FP4_VALUES[np.arange(256) & 0x0F], FP4_VALUES[np.arange(256) >> 4]], axis=-1)

# Blocks decoded at a time: 65536 blocks are 8 MiB of fp32 values (plus the same again in gathers).
BLOCKS_PER_CHUNK = 1 << 16


def dequantize_mxfp4(
    blocks: np.ndarray, scales: np.ndarray, dtype=np.float32, *, blocks_per_chunk: int = BLOCKS_PER_CHUNK
) -> np.ndarray:
    """blocks uint8 [..., G, 16], scales uint8 [..., G] -> values [..., G*32] in `dtype`.

    Decodes `blocks_per_chunk` blocks at a time, so the temporaries stay bounded whatever the size
    of the tensor (a 120b expert tensor included); only the result is full-sized.
    """
    blocks = np.asarray(blocks)
    scales = np.asarray(scales)
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.ndim < 2 or blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks {blocks.shape} and scales {scales.shape} do not match: expected [..., G, 16] and [..., G]"
        )
    *lead, groups, _ = blocks.shape
    flat_blocks = blocks.reshape(-1, 16)
    flat_scales = scales.reshape(-1)
    out = np.empty((flat_blocks.shape[0], 32), dtype)
    for start in range(0, flat_blocks.shape[0], blocks_per_chunk):
        stop = start + blocks_per_chunk
        values = _BYTE_VALUES[flat_blocks[start:stop]].reshape(-1, 32)
        exponents = flat_scales[start:stop, None].astype(np.int32) - 127
        # Exact ldexp, as transformers does: the top scales overflow to inf there too.
        with np.errstate(over="ignore"):
            out[start:stop] = np.ldexp(values, exponents).astype(dtype)
    return out.reshape(*lead, groups * 32)


def mxfp4_expert_weight(blocks: np.ndarray, scales: np.ndarray, dtype=np.float32) -> np.ndarray:
    """Expert weights stored row = output feature, blocks [E, O, G, 16] and scales [E, O, G] ->
    [E, G*32, O] (input features first), one expert at a time."""
    blocks = np.asarray(blocks)
    if blocks.ndim != 4:
        raise ValueError(f"MXFP4 expert blocks must be [experts, out, groups, 16], got shape {blocks.shape}")
    experts, rows, groups, _ = blocks.shape
    out = np.empty((experts, groups * 32, rows), dtype)
    for e in range(experts):
        out[e] = dequantize_mxfp4(blocks[e], scales[e], dtype).T
    return out
