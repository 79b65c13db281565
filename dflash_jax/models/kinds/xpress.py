"""XPress (arXiv 2608.02438; served by vLLM PR #54448's `qwen3_xpress.py`, trained by speculators
PR #1061's `models/xpress/`; docs/design.md "Drafter kinds"): the DFlash backbone with a low-rank
refiner head whose bias on the backbone's logits reads the token before each slot. Its loss adds
free-running Jacobi rounds and the backbone's own loss (training/kinds/xpress.py); its drafts are
refined by Jacobi passes over the whole block (decoding/kinds/xpress.py).

Slot 0 of the block [anchor, MASK, ...] holds the anchor; slot k (1..B-1) drafts the token at
anchor + k, as DFlash's. With h [.., B, H] the backbone's states after its final norm (every slot,
the anchor's too) and prev [.., B] the token before each slot, the refiner's bias is

    g = mean_k h_k                                        (all B slots)
    x = in_proj([down_h h_k; down_g g; w1[prev_k]])        3r -> r, in this order
    u_k = x_k + Σ_{j<=k} L[:, k, j] ⊙ x_j                  per channel c: L[c] lower-triangular
    y = u + down(silu(gate u) · up u)                     SwiGLU r -> m -> r with a residual
    bias = w2 y                                           r -> V

and slot k's logits are the backbone's plus bias_k. The mixer is causal: bias_k reads prev_0..prev_k
alone. prev_k is the token at slot k-1 for k >= 1 (the anchor for slot 1). prev_0, the token
before the anchor, is the anchor itself here, in training and in decoding: vLLM's drafter feeds
the anchor id there (the token before it lives only in the target's KV cache), so training on the
real predecessor, as speculators does, would train what is never served. `mix.L` starts at zero
(the mixer is then the identity) and is exported raw: vLLM folds it into L ⊙ tril + I on load.
Parameter names are the export's (`xpress_head.{w1, down_h, down_g, in_proj, mix.L, mlp.*, w2}`).

The backbone is DFlash2's layers by default (`xpress_backbone='dflash2'`: a grouped dynamic
convolution around every sublayer, models/kinds/dflash2.py, without its candidate selector),
exported as `Qwen3XPressDFlash2Model`, the name the PR author's fork loads; or DFlash's
(`xpress_backbone='dflash'`), exported as `Qwen3XPressModel`, the PR's own.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from dflash_jax.field_checks import at_least, one_of
from dflash_jax.models.kind import FieldReader, Kind, Vllm
from dflash_jax.models.kinds.dflash2 import CONV_PARTITION_RULES, conv_layer, conv_macs, conv_problems
from dflash_jax.models.layers.basic import DecoderBlock, SwiGLU, linear
from dflash_jax.models.sharding import EMBED, VOCAB


@dataclasses.dataclass(frozen=True, kw_only=True)
class XPressFields:
    # drafter.kind='xpress': the refiner head's rank r and SwiGLU width (the authors' 256 and
    # 2·r; set both to resize it), and the Jacobi passes a drafting step refines its block with
    # (config.json's xpress_num_passes, which vLLM runs).
    xpress_rank: int = 256
    xpress_mlp_hidden: int = 512
    xpress_num_passes: int = 6
    # Training only (no export carries them): the free-running Jacobi rounds the loss scores, and
    # the weight of the backbone's own loss beside the refined ones (the authors' 0.6: 2 % lower
    # held-out τ on the default job, two seeds).
    xpress_consistency_passes: int = 3
    xpress_backbone_weight: float = 1.0
    # The backbone's layers: 'dflash2', DFlash2's convolutions around every sublayer (sized by
    # conv_kernel_size and conv_group_size; no candidate selector): +10.5 % held-out τ over
    # 'dflash' on the default job, two seeds; or 'dflash', the layout the PR's vLLM loads.
    xpress_backbone: str = "dflash2"


# -> the architecture its export writes; the default's first (`Kind.architecture`).
BACKBONES = {"dflash2": "Qwen3XPressDFlash2Model", "dflash": "Qwen3XPressModel"}


class Mixer(nnx.Module):
    """u = x + (L ⊙ tril) x along the block, one B x B lower triangle (diagonal included) per channel."""

    def __init__(self, rank: int, block_size: int, *, param_dtype):
        self.L = nnx.Param(jnp.zeros((rank, block_size, block_size), param_dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [..., B, r] -> [..., B, r]."""
        size = self.L.shape[-1]
        lower = (self.L[...] * jnp.tril(jnp.ones((size, size), self.L.dtype))).astype(x.dtype)
        return x + jnp.einsum("ckj,...jc->...kc", lower, x)


class XPressHead(nnx.Module):
    def __init__(self, cfg, *, init_std, param_dtype, compute_dtype, rngs):
        rank, kw = cfg.xpress_rank, dict(param_dtype=param_dtype, compute_dtype=compute_dtype, rngs=rngs)
        self.compute_dtype = compute_dtype
        self.rank = rank
        self.w1 = nnx.Embed(
            cfg.vocab_size,
            rank,
            dtype=compute_dtype,
            param_dtype=param_dtype,
            embedding_init=nnx.initializers.normal(init_std),
            rngs=rngs,
        )
        self.down_h = linear(cfg.hidden_size, rank, init_std=init_std, **kw)
        self.down_g = linear(cfg.hidden_size, rank, init_std=init_std, **kw)
        self.in_proj = linear(3 * rank, rank, init_std=init_std, **kw)
        self.mix = Mixer(rank, cfg.block_size, param_dtype=param_dtype)
        self.mlp = SwiGLU(rank, cfg.xpress_mlp_hidden, init_std=init_std, **kw)
        self.w2 = linear(rank, cfg.vocab_size, init_std=init_std, **kw)

    def hidden_part(self, hidden: jax.Array) -> jax.Array:
        """in_proj of [down_h h_k; down_g g]: hidden [..., B, H] -> [..., B, r], computed once
        per block whatever the tokens before its slots."""
        rank = self.rank
        kernel = self.in_proj.kernel[...].astype(self.compute_dtype)
        hidden = hidden.astype(self.compute_dtype)
        mean = jnp.mean(hidden, axis=-2, keepdims=True)
        return self.down_h(hidden) @ kernel[:rank] + self.down_g(mean) @ kernel[rank : 2 * rank]

    def latent(self, hidden_part: jax.Array, previous: jax.Array) -> jax.Array:
        """y [..., B, r] of the slots after the tokens `previous` [..., B] (ids)."""
        kernel = self.in_proj.kernel[...].astype(self.compute_dtype)
        u = self.mix(hidden_part + self.w1(previous) @ kernel[2 * self.rank :])
        return u + self.mlp(u)

    def bias(self, latent: jax.Array) -> jax.Array:
        """w2 · y: [..., r] -> [..., V] fp32."""
        kernel = self.w2.kernel[...].astype(self.compute_dtype)
        return jnp.einsum("...r,rv->...v", latent, kernel, preferred_element_type=jnp.float32)


def _convolved(cfg) -> bool:
    return cfg.xpress_backbone == "dflash2"


def _export(cfg) -> tuple[dict, dict]:
    """What the authors' converter writes and vLLM reads, at the top level: dflash_config keeps
    the backbone's mask token and target layers alone (DFlash2's layers add their convolutions'
    sizes, which they read there). vLLM runs blocks of xpress_block_size (it ignores block_size),
    which must equal the block its speculative config verifies."""
    convs = dict(conv_kernel_size=cfg.conv_kernel_size, conv_group_size=cfg.conv_group_size)
    return convs if _convolved(cfg) else {}, {
        "architectures": [BACKBONES[cfg.xpress_backbone]],
        "xpress_block_size": cfg.block_size,
        "xpress_rank": cfg.xpress_rank,
        "xpress_mlp_hidden": cfg.xpress_mlp_hidden,
        "xpress_num_passes": cfg.xpress_num_passes,
        "sample_from_anchor": False,
    }


def _problems(cfg) -> list[str]:
    problems = at_least("", cfg, xpress_backbone_weight=0) + one_of("", cfg, xpress_backbone=tuple(BACKBONES))
    return problems + (conv_problems(cfg) if _convolved(cfg) else [])


def _implied_fields(field: FieldReader) -> dict:
    """The backbone, which the fork's config.json says by its architecture alone."""
    archs = field("architectures", None) or []
    return {"xpress_backbone": next((b for b, arch in BACKBONES.items() if arch in archs), "dflash")}


def _layer(cfg, mixer, mlp, *, rngs, **block_kw):
    if _convolved(cfg):
        return conv_layer(cfg, mixer, mlp, rngs=rngs, **block_kw)
    return DecoderBlock("self_attn", mixer, mlp, **block_kw)


def _unsupported(field: FieldReader) -> list[str]:
    """vLLM's layout: fill-in blocks, the backbone's own seed; the variants that only its forks or
    speculators have are not ours to load."""
    problems = []
    if field("sample_from_anchor", False):
        problems.append("XPress drafters with sample_from_anchor=true are not supported (vLLM serves fill-in blocks)")
    if field("xpress_selector", False):
        problems.append("XPress drafters with a candidate selector seed (xpress_selector) are not supported")
    missing = [k for k in ("conv_kernel_size", "conv_group_size") if field(k, None) is None]
    if BACKBONES["dflash2"] in (field("architectures", None) or []) and missing:
        problems.append(f"XPress config.json on DFlash2's backbone lacks dflash_config's {' and '.join(missing)}")
    blocks, size = field("xpress_block_size", None), field("block_size", None)
    if blocks is not None and (size is None or int(size) != int(blocks)):
        problems.append(
            f"XPress config.json has xpress_block_size={blocks} and block_size={size}: they must be equal "
            "(the block vLLM drafts is xpress_block_size)"
        )
    return problems


def _heads(cfg, **head_kw) -> dict:
    return {"xpress_head": XPressHead(cfg, **head_kw)}


def _head_flops(cfg, vocab: int) -> int:
    """Per scored slot: the hidden part once (down_h and its third of in_proj per slot, down_g
    and its third per block), then per refinement the loss scores (the teacher-forced one and the
    free-running rounds) w1's third of in_proj, the mixer's B x B per channel, the SwiGLU and the
    readout r -> V. The backbone's logits are the LM head's, counted with it."""
    r, hidden, block = cfg.xpress_rank, cfg.hidden_size, cfg.block_size
    once = (hidden * r + r * r) * (block + 1) // block
    refine = r * r + block * r + 3 * r * cfg.xpress_mlp_hidden + r * vocab
    return 2 * (once + (1 + cfg.xpress_consistency_passes) * refine)


KIND = Kind(
    "xpress",
    tuple(BACKBONES.values()),
    fields=XPressFields,
    borrowed_fields=("conv_kernel_size", "conv_group_size"),
    loss="dpace",  # each term's, as its DFlash backbone's
    problems=_problems,
    export=_export,
    unsupported=_unsupported,
    implied_fields=_implied_fields,
    layer=_layer,
    heads=_heads,
    partition_rules=(
        *CONV_PARTITION_RULES,
        (r"xpress_head\.w1\.embedding", (VOCAB, None)),
        (r"xpress_head\.w2\.kernel", (None, VOCAB)),
        (r"xpress_head\.down_[hg]\.kernel", (EMBED, None)),
        (r"xpress_head\.in_proj\.kernel", (EMBED, None)),
        (r"xpress_head\.mix\.L", (EMBED, None, None)),
    ),
    layer_macs=lambda cfg: conv_macs(cfg) if _convolved(cfg) else 0,
    head_flops=_head_flops,
    # The previous token's table and the readout onto the vocabulary (the head's only "w1"/"w2").
    adam_params=("w1", "w2"),
    # The authors' slot weights exp(-(k-1)/4) from the first draft, whatever the block size.
    loss_decay_gamma=4.0,
    vllm=Vllm(refused="vLLM serves XPress only in its open PR #54448, in no release yet"),
)
