"""Where each target parameter lives in a checkpoint as the hub publishes it, per family.

Our parameter paths mirror the Hugging Face names (`layers.3.self_attn.q_proj.kernel` <->
`model.layers.3.self_attn.q_proj.weight`), so most tensors map mechanically (`checkpoint_name`):
`kernel` and `embedding` become `weight`, Linear kernels are transposed ([in, out] here,
[out, in] in torch), and decoder names carry the family's prefix (`model.`, or
`model.language_model.` for Qwen3.5's multimodal checkpoints, whose `visual.*` and `mtp.*`
tensors are never read). What is not mechanical is here:

* stacked experts (`...mlp.experts.gate_proj` [E, D, I]) come from one tensor per expert, a fused
  gate/up tensor or MXFP4 blocks (`moe.expert_weight`);
* Qwen3-Next's fused linear-attention projections `in_proj_qkvz` / `in_proj_ba` are split into
  Qwen3.5's four (`linear_attention.next_in_proj_to_qwen3_5`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dflash_jax.models.config import TransformerConfig
from dflash_jax.models.linear_attention import next_in_proj_to_qwen3_5
from dflash_jax.models.moe import TensorSource, expert_weight


def checkpoint_name(path: Sequence, prefix: str) -> tuple[str, bool]:
    """Param path -> (checkpoint tensor name, whether the tensor is transposed)."""
    parts = [str(p) for p in path]
    transposed = parts[-1] == "kernel"
    if parts[-1] in ("kernel", "embedding"):
        parts[-1] = "weight"
    name = ".".join(parts)
    if prefix and not name.startswith("lm_head"):
        name = prefix + name
    return name, transposed


def target_tensor(source: TensorSource, path: Sequence, cfg: TransformerConfig, dtype) -> tuple[np.ndarray, str]:
    """Our target parameter at `path`, in our layout, from a checkpoint -> (tensor, the name to cite
    in errors)."""
    parts = [str(p) for p in path]
    prefix = cfg.family.weight_prefix
    if "experts" in parts:
        i = parts.index("experts")
        layer = checkpoint_name(parts[:i] + ["x"], prefix)[0].removesuffix("x")  # '...layers.3.mlp.'
        return expert_weight(source, layer, parts[i + 1], cfg.moe, dtype), f"{layer}experts ({parts[i + 1]})"
    name, transposed = checkpoint_name(parts, prefix)
    if name not in source.names() and parts[-3] == "linear_attn" and parts[-2].startswith("in_proj_"):
        tensor = _next_in_proj(source, name.rsplit(".", 2)[0] + ".", cfg)[parts[-2]]
    else:
        tensor = source.get(name)
    return (tensor.T if transposed else tensor), name


def _next_in_proj(source: TensorSource, mixer: str, cfg: TransformerConfig) -> dict[str, np.ndarray]:
    """Qwen3-Next's fused projections of the linear-attention layer under `mixer`, as Qwen3.5's."""
    lin = cfg.linear_attention
    fused = mixer + "in_proj_qkvz.weight"
    if fused not in source.names():
        raise KeyError(mixer + "in_proj_qkv.weight")
    return next_in_proj_to_qwen3_5(
        source.get(fused),
        source.get(mixer + "in_proj_ba.weight"),
        num_k_heads=lin.num_k_heads,
        num_v_heads=lin.num_v_heads,
        head_k_dim=lin.head_k_dim,
        head_v_dim=lin.head_v_dim,
    )
