"""MXFP4 dequantization against transformers' own (integrations/mxfp4.py).

A gpt-oss MoE layer read from MXFP4 tensors is checked in test_moe.py."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from dflash_jax.models.quantized.mxfp4 import dequantize_mxfp4, mxfp4_expert_weight


def random_mxfp4(shape, seed, scale_range=(0, 256)):
    """blocks uint8 [*shape, 16] and scales uint8 [*shape] (every byte value by default)."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (*shape, 16), dtype=np.uint8)
    scales = rng.integers(*scale_range, shape, dtype=np.uint8)
    return blocks, scales


def transformers_dequantized(blocks, scales, dtype) -> np.ndarray:
    return convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=dtype).float().numpy()


@pytest.mark.parametrize(
    "torch_dtype,dtype",
    [(torch.float32, np.float32), (torch.bfloat16, ml_dtypes.bfloat16), (torch.float16, np.float16)],
)
def test_expert_weight_equals_transformers_dequantization(torch_dtype, dtype):
    # Every code and every scale byte, the extremes included (inf where 2**(s-127) overflows).
    blocks, scales = random_mxfp4((3, 24, 4), seed=0)
    expected = transformers_dequantized(blocks, scales, torch_dtype)  # [E, G*32, O]
    got = mxfp4_expert_weight(blocks, scales, dtype)
    assert got.dtype == dtype and got.shape == expected.shape == (3, 128, 24)
    np.testing.assert_array_equal(got.astype(np.float32), expected)


def test_chunks_do_not_change_the_result():
    blocks, scales = random_mxfp4((5, 7), seed=1)
    whole = dequantize_mxfp4(blocks, scales)
    assert whole.shape == (5, 7 * 32)
    np.testing.assert_array_equal(dequantize_mxfp4(blocks, scales, blocks_per_chunk=3), whole)
    # Value check independent of transformers: block 0 of row 0 decoded by hand.
    codes = np.stack([blocks[0, 0] & 0x0F, blocks[0, 0] >> 4], axis=-1).reshape(-1)
    magnitude = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float64)[codes & 7]
    sign = np.where(codes & 8, -1.0, 1.0)
    np.testing.assert_array_equal(whole[0, :32], sign * magnitude * 2.0 ** (int(scales[0, 0]) - 127))


def test_bad_blocks_are_one_line_errors():
    blocks, scales = random_mxfp4((2, 3), seed=2)
    with pytest.raises(ValueError, match="must be uint8"):
        dequantize_mxfp4(blocks.astype(np.int32), scales)
    with pytest.raises(ValueError, match="do not match"):
        dequantize_mxfp4(blocks, scales[:, :2])
