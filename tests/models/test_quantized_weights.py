"""Block-quantized checkpoint weights to dense: FP8 128 x 128 blocks against transformers' own
dequantization, INT4 groups against compressed-tensors' packing (tests/support/int4_packing.py).
Shapes that are not whole blocks, negative words and every int4 value included."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

from dflash_jax.models.quantized.fp8 import dequantize_fp8_blocks
from dflash_jax.models.quantized.int4 import dequantize_int4_groups
from support.int4_packing import pack_int4


@pytest.mark.parametrize("shape", [(256, 384), (300, 200), (2, 130, 257)])
def test_fp8_blocks_equal_transformers(shape):
    rng = np.random.default_rng(0)
    weight = (rng.standard_normal(shape) * 100).astype(ml_dtypes.float8_e4m3fn)
    blocks = (*shape[:-2], -(-shape[-2] // 128), -(-shape[-1] // 128))
    scale_inv = rng.uniform(1e-4, 1e-2, blocks).astype(np.float32)
    expected = _dequantize_fp8_weight(
        torch.from_numpy(weight.view(np.uint8)).view(torch.float8_e4m3fn),
        torch.from_numpy(scale_inv),
        [128, 128],
        torch.float32,
    ).numpy()
    np.testing.assert_array_equal(dequantize_fp8_blocks(weight, scale_inv), expected)
    with pytest.raises(ValueError, match="needs scales"):
        dequantize_fp8_blocks(weight, scale_inv[..., :1, :])


@pytest.mark.parametrize("cols", [64, 36])  # whole words, and a row ending mid-word
def test_int4_groups_equal_compressed_tensors_packing(cols):
    rng = np.random.default_rng(1)
    rows, group = 6, 4 if cols == 36 else 32
    values = rng.integers(-8, 8, (rows, cols))
    values[0, :16] = np.arange(-8, 8)  # every code, the high nibble (negative words) included
    scale = rng.uniform(0.01, 0.1, (rows, cols // group)).astype(ml_dtypes.bfloat16)
    packed = pack_int4(values)
    assert (packed < 0).any()
    expected = values.reshape(rows, -1, group) * scale.astype(np.float32)[..., None]
    got = dequantize_int4_groups(packed, scale, np.array([rows, cols], np.int32))
    np.testing.assert_array_equal(got, expected.reshape(rows, cols))
