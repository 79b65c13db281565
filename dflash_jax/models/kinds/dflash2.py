"""DFlash2 (z-lab's `DFlash2DraftModel`, docs/design.md "Drafter kinds"): the DFlash backbone with
grouped dynamic convolutions around every sublayer and a candidate selector. Its loss adds the
selector's cross-entropy (training/kinds/dflash2.py); its drafts walk the block, each chosen
among the top-k after the one before (decoding/kinds/dflash2.py).

Convolution: around each sublayer of a drafter layer, `prepare` convolves the normalised input u
with kernel base[0] + δ₀ and keeps δ₁; `finish` convolves the sublayer's output with base[1] + δ₁.
δ = kernel_projection(u) [..., 2, W, D/g] is one number per tap and group of g channels:

    conv(x, δ, b)[t, c] = Σ_{o<W} (b[o, c] + δ[t, o, c // g]) · x[t - o, c],   x[t < 0] = 0,

t the position inside the block, so nothing crosses a block boundary. At initialisation
base[:, 0] = 1 and everything else is 0: the identity, so a fresh DFlash2 drafter is a DFlash one.

Selector: U_t are the unary logits of slot t (the frozen LM head, scaled and soft-capped as the
config asks), C_t its top-k candidates; a candidate b after predecessor a scores
S_t(a, b) = U_t(b) + ⟨A[a] ⊙ P(h_t), B[b]⟩ (A, B the predecessor / successor codebooks [V, r],
P a projection D -> r). Shapes: L block length, D hidden, W taps (conv width), g channels per
group, r the selector's rank, k candidates.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from dflash_jax.models.kind import RELEASED, Kind, LlamaCpp, Vllm
from dflash_jax.models.layers.basic import DecoderBlock, linear, soft_capped
from dflash_jax.models.sharding import EMBED, VOCAB


def grouped_dynamic_conv(x: jax.Array, delta: jax.Array, base: jax.Array) -> jax.Array:
    """x [..., L, D], delta [..., L, W, D/g], base [W, D] -> [..., L, D] (the module docstring)."""
    taps, hidden = base.shape
    groups = delta.shape[-1]
    out = jnp.zeros_like(x)
    for o in range(taps):
        # x[t - o]: shifted along the block, zeros before its start.
        shifted = x if o == 0 else jnp.pad(x[..., :-o, :], [(0, 0)] * (x.ndim - 2) + [(o, 0), (0, 0)])
        dynamic = jnp.repeat(delta[..., o, :], hidden // groups, axis=-1)
        out = out + (base[o].astype(x.dtype) + dynamic) * shifted
    return out


class GroupedDynamicConv(nnx.Module):
    """The pair of convolutions around one sublayer: `prepare` its input, `finish` its output."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int, *, param_dtype, compute_dtype, rngs):
        self.kernel_size = kernel_size
        self.groups = hidden_size // group_size
        self.base_kernel = nnx.Param(jnp.zeros((2, kernel_size, hidden_size), param_dtype).at[:, 0].set(1.0))
        # Zero: no dynamic part at initialisation (normal(0) draws zeros).
        self.kernel_projection = linear(
            hidden_size,
            2 * kernel_size * self.groups,
            param_dtype=param_dtype,
            compute_dtype=compute_dtype,
            rngs=rngs,
            init_std=0.0,
        )

    def prepare(self, u: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The normalised sublayer input u [..., L, D] -> (its convolution, δ₁ [..., L, W, D/g])."""
        delta = self.kernel_projection(u).reshape(*u.shape[:-1], 2, self.kernel_size, self.groups)
        return grouped_dynamic_conv(u, delta[..., 0, :, :], self.base_kernel[0]), delta[..., 1, :, :]

    def finish(self, y: jax.Array, delta: jax.Array) -> jax.Array:
        return grouped_dynamic_conv(y, delta, self.base_kernel[1])


class ConvolvedDecoderBlock(DecoderBlock):
    """A drafter layer with `attention_conv` around its attention and `mlp_conv` around its MLP;
    δ comes from each sublayer's normalised input."""

    def __init__(self, mixer_name, mixer, mlp, *, hidden_size, norm_kw, kernel_size, group_size, rngs):
        super().__init__(mixer_name, mixer, mlp, hidden_size=hidden_size, norm_kw=norm_kw)
        conv_kw = dict(kernel_size=kernel_size, group_size=group_size, rngs=rngs, **_dtypes(norm_kw))
        self.attention_conv = GroupedDynamicConv(hidden_size, **conv_kw)
        self.mlp_conv = GroupedDynamicConv(hidden_size, **conv_kw)

    def _mlp_residual(self, x: jax.Array) -> jax.Array:
        h, delta = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + self.mlp_conv.finish(self.mlp(h), delta)

    def __call__(self, x: jax.Array, inputs) -> jax.Array:
        h, delta = self.attention_conv.prepare(self.input_layernorm(x))
        return self._mlp_residual(x + self.attention_conv.finish(self.mixer(h, inputs), delta))

    def decode(self, x: jax.Array, inputs, cache):
        h, delta = self.attention_conv.prepare(self.input_layernorm(x))
        out, cache = self.mixer.decode(h, inputs, cache)
        return self._mlp_residual(x + self.attention_conv.finish(out, delta)), cache


def _dtypes(norm_kw: dict) -> dict:
    return {k: norm_kw[k] for k in ("param_dtype", "compute_dtype")}


class CandidateSelector(nnx.Module):
    def __init__(
        self, hidden_size: int, vocab_size: int, rank: int, top_k: int, *, init_std, param_dtype, compute_dtype, rngs
    ):
        self.top_k = top_k
        self.compute_dtype = compute_dtype
        normal = nnx.initializers.normal(init_std)
        self.predecessor_codebook = nnx.Param(normal(rngs.params(), (vocab_size, rank), param_dtype))
        self.successor_codebook = nnx.Param(normal(rngs.params(), (vocab_size, rank), param_dtype))
        self.hidden_projection = linear(
            hidden_size, rank, param_dtype=param_dtype, compute_dtype=compute_dtype, rngs=rngs, init_std=init_std
        )

    def context(self, hidden: jax.Array, predecessors: jax.Array) -> jax.Array:
        """A[a] ⊙ P(h): hidden [..., D], predecessor ids [...] -> [..., r]."""
        return self.predecessor_codebook[...].astype(self.compute_dtype)[predecessors] * self.hidden_projection(hidden)

    def pair_scores(self, context: jax.Array, candidates: jax.Array) -> jax.Array:
        """⟨context, B[b]⟩ for every candidate b: context [..., r], candidates [..., k] -> [..., k]
        fp32 (decoding: a few positions, so the candidates' rows are gathered)."""
        rows = self.successor_codebook[...].astype(self.compute_dtype)[candidates]
        return jnp.einsum("...r,...kr->...k", context, rows, preferred_element_type=jnp.float32)


def successor_scores(context: jax.Array, successors: jax.Array) -> jax.Array:
    """⟨context, B[b]⟩ for every token b: context [..., r], B [V, r] -> [..., V] fp32 (training,
    which then takes its candidates' scores: a rank-r matmul instead of gathering k rows of B per
    slot, whose scatter-add gradient made a DFlash2 step 3.5 times slower on a CPU)."""
    return jnp.einsum("...r,vr->...v", context, successors.astype(context.dtype), preferred_element_type=jnp.float32)


def unary_logits(logits: jax.Array, output_multiplier: float, softcap: float) -> jax.Array:
    """The LM head's logits as the selector reads them: scaled, then soft-capped (0 = no cap)."""
    logits = logits * output_multiplier if output_multiplier != 1.0 else logits
    return soft_capped(logits, softcap)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DFlash2Fields:
    # drafter.kind='dflash2': per layer two grouped dynamic convolutions of conv_kernel_size taps
    # over groups of conv_group_size channels, and a candidate selector of rank selector_rank
    # over the selector_top_k best unary logits.
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16
    # The unary logits scaled by output_multiplier and soft-capped at final_logit_softcapping
    # (0 = none), as z-lab's released drafters ask (training leaves both off).
    output_multiplier: float = dataclasses.field(default=1.0, metadata=RELEASED)
    final_logit_softcapping: float = dataclasses.field(default=0.0, metadata=RELEASED)


def conv_problems(cfg) -> list[str]:
    """What cannot work in the convolutions' sizes (a kind built on these layers checks them too)."""
    problems = []
    if cfg.hidden_size % cfg.conv_group_size:
        problems.append(f"conv_group_size={cfg.conv_group_size} must divide hidden_size={cfg.hidden_size}")
    if cfg.conv_kernel_size > cfg.block_size:
        problems.append(f"conv_kernel_size={cfg.conv_kernel_size} must be in [1, block_size={cfg.block_size}]")
    return problems


def _problems(cfg) -> list[str]:
    problems = conv_problems(cfg)
    if cfg.selector_top_k > cfg.vocab_size:
        problems.append(f"selector_top_k={cfg.selector_top_k} must be in [1, vocab_size={cfg.vocab_size}]")
    return problems


# The convolutions' parameters (their paths' ends, logical axes), and their multiply-adds per
# block token of a layer: the kernel projections (H -> 2·K·G each).
CONV_PARTITION_RULES = (
    (r"\w+_conv\.base_kernel", (None, None, EMBED)),
    (r"\w+_conv\.kernel_projection\.kernel", (EMBED, None)),
)


def conv_macs(cfg) -> int:
    return 2 * cfg.hidden_size * 2 * cfg.conv_kernel_size * (cfg.hidden_size // cfg.conv_group_size)


def _export(cfg) -> tuple[dict, dict]:
    """z-lab's layout: everything under dflash_config, the scale and cap only where they are set."""
    dflash_config = dict(
        block_size=cfg.block_size,
        conv_group_size=cfg.conv_group_size,
        conv_kernel_size=cfg.conv_kernel_size,
        selector_rank=cfg.selector_rank,
        selector_top_k=cfg.selector_top_k,
    )
    if cfg.output_multiplier != 1.0:
        dflash_config["output_multiplier"] = cfg.output_multiplier
    if cfg.final_logit_softcapping:
        dflash_config["final_logit_softcapping"] = cfg.final_logit_softcapping
    return dflash_config, {}


def conv_layer(cfg, mixer, mlp, *, rngs, **block_kw) -> ConvolvedDecoderBlock:
    return ConvolvedDecoderBlock(
        "self_attn", mixer, mlp, kernel_size=cfg.conv_kernel_size, group_size=cfg.conv_group_size, rngs=rngs, **block_kw
    )


def _heads(cfg, *, compute_dtype, **head_kw) -> dict:
    selector = CandidateSelector(
        cfg.hidden_size, cfg.vocab_size, cfg.selector_rank, cfg.selector_top_k, compute_dtype=compute_dtype, **head_kw
    )
    return {"candidate_selector": selector}


def _llama_cpp_metadata(hf: dict) -> dict:
    """The convolutions' and the selector's sizes, and the output transforms the selector reads
    the drafter's logits after, under llama.cpp's GGUF keys."""
    d = hf["dflash_config"]
    keys = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
    out: dict = {f"dflash.{k}": int(d[k]) for k in keys}
    if "output_multiplier" in d:
        out["dflash.logit_scale"] = float(d["output_multiplier"])
    if d.get("final_logit_softcapping"):
        out["dflash.final_logit_softcapping"] = float(d["final_logit_softcapping"])
    return out


def _llama_cpp_problems(hf: dict) -> list[str]:
    """llama.cpp packs the selector's (top-k + 1) x top-k lattice into a hidden-size row."""
    d, hidden = hf["dflash_config"], int(hf["hidden_size"])
    top_k, group = int(d["selector_top_k"]), int(d["conv_group_size"])
    found = []
    if hidden < top_k * (top_k + 1):
        found.append(f"selector_top_k {top_k} needs a hidden size >= {top_k * (top_k + 1)} (it is {hidden})")
    if hidden % group:
        found.append(f"hidden size {hidden} is not a multiple of conv_group_size {group}")
    return found


KIND = Kind(
    "dflash2",
    ("DFlash2DraftModel",),
    fields=DFlash2Fields,
    loss="dpace",  # the default run's, as its DFlash backbone's
    problems=_problems,
    export=_export,
    layer=conv_layer,
    heads=_heads,
    partition_rules=(
        *CONV_PARTITION_RULES,
        (r"(predecessor|successor)_codebook", (VOCAB, None)),
        (r"hidden_projection\.kernel", (EMBED, None)),
    ),
    layer_macs=conv_macs,
    # The selector: projection H -> r and every token's successor score, r -> V (training takes
    # the k candidates').
    head_flops=lambda cfg, vocab: 2 * cfg.selector_rank * (cfg.hidden_size + vocab),
    adam_params=("codebook",),
    # llama.cpp tells DFlash2 from DFlash by selector_top_k > 0.
    llama_cpp=LlamaCpp(
        "draft-dflash",
        metadata=_llama_cpp_metadata,
        problems=_llama_cpp_problems,
        tensors={
            "candidate_selector.predecessor_codebook": "selector_predecessor.weight",
            "candidate_selector.successor_codebook": "selector_successor.weight",
            "candidate_selector.hidden_projection.weight": "selector_hidden.weight",
        },
        layer_tensors={
            "attention_conv.base_kernel": "attn_conv_base",
            "attention_conv.kernel_projection.weight": "attn_conv_proj.weight",
            "mlp_conv.base_kernel": "ffn_conv_base",
            "mlp_conv.kernel_projection.weight": "ffn_conv_proj.weight",
        },
    ),
    vllm=Vllm(
        "dflash",
        cpu_refused="its candidate head is in vLLM's V2 model runner only, which needs Triton "
        "('Model Runner V1 does not support: DFlash candidate-head drafts')",
    ),
)
