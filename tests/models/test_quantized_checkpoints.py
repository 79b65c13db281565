"""Targets published quantized load as their dequantized weights: DeepSeek-V3 and MiniMax-M2 with
every Linear in FP8 128 x 128 blocks (`weight_scale_inv`; routers, norms, embeddings and LM head
unquantized), Kimi-K2.5 with its routed experts in INT4 groups of 32 (compressed-tensors
`pack-quantized`). Each quantized checkpoint is made from a tiny one transformers wrote; the
expected weights are transformers' own FP8 dequantization of it (and, for INT4, value x scale as
compressed-tensors defines it), written unquantized beside it. The forward of these families on
unquantized weights is tests/models/test_families.py's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.numpy import load_file, save_file
from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

from dflash_jax.models.formats.hf import load_target
from support.hf_reference import write_hf_checkpoint
from support.int4_packing import pack_int4

UNQUANTIZED = ("norm", "embed_tokens", "lm_head", ".gate.", "e_score_correction_bias")


def _fp8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """w [out, in] -> (float8 weight, scale_inv [1, 1] (tiny weights are one block), dequantized)."""
    scale = np.float32(np.abs(w).max() / 448.0)
    q = (w / scale).astype(ml_dtypes.float8_e4m3fn)
    scale_inv = np.full((-(-w.shape[0] // 128), -(-w.shape[1] // 128)), scale, np.float32)
    fp8 = torch.from_numpy(q.view(np.uint8)).view(torch.float8_e4m3fn)
    dense = _dequantize_fp8_weight(fp8, torch.from_numpy(scale_inv), [128, 128], torch.float32).numpy()
    return q, scale_inv, dense


def _int4(w: np.ndarray, group: int = 32) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """w [out, in] -> (packed int32, bf16 scales [out, in / group], dequantized)."""
    rows, cols = w.shape
    groups = w.reshape(rows, cols // group, group)
    scale = (np.abs(groups).max(-1) / 7.0).astype(ml_dtypes.bfloat16)
    values = np.clip(np.round(groups / scale.astype(np.float32)[..., None]), -8, 7).astype(np.int64)
    dense = (values * scale.astype(np.float32)[..., None]).reshape(rows, cols)
    return pack_int4(values.reshape(rows, cols)), scale, dense


def _quantized_pair(tmp_path: Path, arch: str, scheme: str) -> tuple[str, str]:
    """(the quantized checkpoint, the same dequantized) of a tiny `arch` transformers wrote."""
    source = Path(write_hf_checkpoint(tmp_path / "source", arch=arch, num_hidden_layers=2))
    tensors = load_file(source / "model.safetensors")
    quantized, dense = {}, {}
    for name, w in tensors.items():
        routed_expert = ".experts." in name and "shared" not in name
        eligible = name.endswith(".weight") and w.ndim == 2 and not any(u in name for u in UNQUANTIZED)
        if scheme == "fp8" and eligible:
            quantized[name], quantized[name + "_scale_inv"], dense[name] = _fp8(w)
        elif scheme == "int4" and eligible and routed_expert:
            stem = name.removesuffix(".weight")
            quantized[f"{stem}.weight_packed"], quantized[f"{stem}.weight_scale"], dense[name] = _int4(w)
            quantized[f"{stem}.weight_shape"] = np.array(w.shape, np.int32)
        else:
            quantized[name] = dense[name] = w
    assert len(quantized) > len(dense)  # something was quantized
    paths = []
    for kind, contents in (("quantized", quantized), ("dense", dense)):
        out = tmp_path / kind
        shutil.copytree(source, out)
        save_file(contents, out / "model.safetensors", metadata={"format": "pt"})
        paths.append(str(out))
    config = json.loads((source / "config.json").read_text())
    (Path(paths[0]) / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": scheme}}))
    return paths[0], paths[1]


@pytest.mark.parametrize("arch,scheme", [("deepseek_v3", "fp8"), ("minimax_m2", "fp8"), ("kimi_k25", "int4")])
def test_quantized_checkpoint_loads_as_its_dequantized_weights(tmp_path, arch, scheme):
    quantized, dense = _quantized_pair(tmp_path, arch, scheme)
    got, expected = (
        nnx.to_pure_dict(nnx.state(load_target(p, param_dtype=jnp.float32, compute_dtype=jnp.float32)))
        for p in (quantized, dense)
    )
    leaves = jax.tree_util.tree_leaves_with_path(expected)
    assert len(leaves) == len(jax.tree_util.tree_leaves(got))
    for (path, want), have in zip(leaves, jax.tree_util.tree_leaves(got)):
        np.testing.assert_array_equal(np.asarray(have), np.asarray(want), err_msg=jax.tree_util.keystr(path))
