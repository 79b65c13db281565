"""FP8 block-quantized weights (DeepSeek-V3 / V3.1, MiniMax-M2 checkpoints) to dense arrays, on the host.

Such a checkpoint stores a Linear's `weight` as float8_e4m3fn [out, in] beside `weight_scale_inv`
fp32 [ceil(out / 128), ceil(in / 128)] (`quantization_config.weight_block_size`): every 128 x 128
block of the weight shares one scale, and the dense weight is the FP8 value times its block's
scale (the name notwithstanding, the scale multiplies). Edge blocks are cut where the shape is not
a multiple of the block. Norms, embeddings, the LM head and the routers are stored unquantized.
`fp8_rows` and `FP8_LINEAR` are the weight-map rows (models/weight_maps.py) of such checkpoints.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from dflash_jax.models.weight_maps import Tensor, Transform, chain, transpose

BLOCK = (128, 128)


def dequantize_fp8_blocks(weight: np.ndarray, scale_inv: np.ndarray, block=BLOCK, dtype=np.float32) -> np.ndarray:
    """weight float8_e4m3fn [..., out, in], scale_inv [..., ceil(out / bo), ceil(in / bi)] ->
    [..., out, in] in `dtype` (the product formed in fp32)."""
    weight = np.asarray(weight)
    if weight.dtype != ml_dtypes.float8_e4m3fn:
        raise ValueError(f"an FP8 block-quantized weight must be float8_e4m3fn, got {weight.dtype}")
    (rows, cols), (bo, bi) = weight.shape[-2:], block
    blocks = (-(-rows // bo), -(-cols // bi))
    if scale_inv.shape[-2:] != blocks:
        raise ValueError(
            f"FP8 weight {weight.shape} needs scales [..., {blocks[0]}, {blocks[1]}], got {scale_inv.shape}"
        )
    # One matrix at a time (stacked experts: one expert), so the fp32 temporaries stay one matrix.
    out = np.empty(weight.shape, dtype)
    padded = np.zeros((blocks[0] * bo, blocks[1] * bi), np.float32)
    for index in np.ndindex(weight.shape[:-2]):
        padded[:rows, :cols] = weight[index].astype(np.float32)
        tiles = padded.reshape(blocks[0], bo, blocks[1], bi)
        tiles *= np.asarray(scale_inv[index], np.float32)[:, None, :, None]
        out[index] = padded[:rows, :cols]
    return out


def dequantized(tensors: list[np.ndarray], cfg, dtype) -> np.ndarray:
    """The weight-map transform: [`weight`, `weight_scale_inv`] -> the dense weight (torch layout)."""
    return dequantize_fp8_blocks(*tensors, dtype=dtype)


def fp8_rows(hub: str, param: str, *transforms: Transform) -> tuple[Tensor, Tensor]:
    """Weight-map rows of a Linear whose hub tensor `hub`.weight is stored in FP8 blocks (the hub)
    or unquantized (what transformers writes): dequantized where quantized, then `transforms`,
    then transposed to our [in, out]."""
    return (
        Tensor((f"{hub}.weight", f"{hub}.weight_scale_inv"), param, chain(dequantized, *transforms, transpose)),
        Tensor(f"{hub}.weight", param, chain(*transforms, transpose)),
    )


# Every Linear a family's other rows leave out, where the checkpoint stores it in FP8 blocks.
FP8_LINEAR = Tensor(("{name}.weight", "{name}.weight_scale_inv"), "{name}.kernel", chain(dequantized, transpose))
