"""The DFlash drafter (docs/design.md §2), in Flax NNX.

The drafter owns `fc`, `hidden_norm`, its decoder layers and the final `norm`; it has no
embedding and no LM head: callers embed block tokens and unembed its output with the frozen
target (`Transformer.embed` / `Transformer.unembed`).

Every layer attends from the block's tokens to [context keys ‖ own block keys], where context
keys/values are the layer's own k/v projections of `ctx = hidden_norm(fc(target features))`;
sliding layers see only a window of the context and their block causally
(`DrafterConfig.attention_pattern`, `block_attention`).
Training runs many blocks per packed row (`__call__`); decoding runs one block against a cache
of context keys/values (`extend_context` + `decode`). The drafter kinds (docs/design.md "Drafter
kinds") share this backbone; a kind's module (models/kinds/) may replace its layers (with
convolutions around every sublayer, say) and add heads (a candidate selector, a Markov and
confidence heads); what the heads do with the backbone's hidden states is the objective's and
the decoder's. Shapes: B rows, N blocks, L block length,
S context positions, D model dim, F = k·D target features.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from dflash_jax.models.drafter_config import DrafterConfig
from dflash_jax.models.layers import block_attention, layer_stack
from dflash_jax.models.layers.basic import DecoderBlock, RMSNorm, Rotary, SwiGLU, linear, rotary
from dflash_jax.models.layers.cache import KVCache, LayerCache, leading_slots
from dflash_jax.models.layers.chunking import BLOCKS_PER_CHUNK
from dflash_jax.models.layers.mixers import AttentionProjections

INIT_STD = 0.02  # docs/design.md §3.5: drafter init normal(0.02)

# The drafter caches the k/v projections of the context: the same layout as the target's cache.
ContextCache = KVCache


@flax.struct.dataclass
class DraftBlocks:
    """What the drafter's mixers read in training: many blocks per packed row."""

    rotary: Rotary  # tables of the block positions [B, N, L]
    ctx: jax.Array  # [B, S, D]: hidden_norm(fc(target features)), shared by every layer
    ctx_rotary: Rotary  # tables of the context positions [B, S]
    ctx_mask: jax.Array  # [B, N, S]: the context each block sees (`block_attention.block_context_mask`)
    positions: jax.Array  # [B, N, L]: in-document positions of the block tokens (sliding windows)
    ctx_positions: jax.Array  # [B, S]: in-document positions of the context
    blocks_per_chunk: int = flax.struct.field(pytree_node=False)


@flax.struct.dataclass
class DraftStep:
    """What the drafter's mixers read when one block per row is drafted against their caches."""

    rotary: Rotary  # tables of the block positions [B, L]
    lengths: jax.Array  # [B]: context slots of each row's cache
    # Static: attention reads only the first num_slots context slots, which must cover every
    # row's length; None: all (as the target's `mixers.DecodeStep`).
    num_slots: int | None = flax.struct.field(pytree_node=False, default=None)


class DFlashAttention(AttentionProjections):
    """The drafter's attention: queries from the block only; keys/values from the context (the
    layer's own k/v projections of ctx) and from the block itself. `window` (0 = none) and
    `causal` narrow what a query sees (`block_attention`)."""

    def __init__(self, *, window: int = 0, causal: bool = False, **projections):
        super().__init__(**projections)
        self.window = window
        self.causal = causal

    def __call__(self, h: jax.Array, blocks: DraftBlocks) -> jax.Array:
        """h [B, N, L, D] -> [B, N, L, D]."""
        q, _ = self.queries(h, blocks.rotary)
        k_blk, v_blk = self.keys_values(h, blocks.rotary)
        k_ctx, v_ctx = self.keys_values(blocks.ctx, blocks.ctx_rotary)
        attn = block_attention.block_attention(
            q,
            k_ctx,
            v_ctx,
            k_blk,
            v_blk,
            blocks.ctx_mask,
            blocks_per_chunk=blocks.blocks_per_chunk,
            implementation=self.implementation,
            window=self.window,
            causal=self.causal,
            positions=blocks.positions,
            ctx_positions=blocks.ctx_positions,
        )
        return self.output(attn)

    def decode(self, h: jax.Array, step: DraftStep, cache: LayerCache) -> tuple[jax.Array, LayerCache]:
        """One block h [B, L, D] against the cached context -> ([B, L, D], the cache unchanged)."""
        q, _ = self.queries(h, step.rotary)
        k, v = self.keys_values(h, step.rotary)
        k_ctx, v_ctx = leading_slots(cache.k, step.num_slots), leading_slots(cache.v, step.num_slots)
        attn = block_attention.block_attention_cached(
            q, k_ctx, v_ctx, step.lengths, k, v, window=self.window, causal=self.causal
        )
        return self.output(attn), cache

    def write_context(self, ctx: jax.Array, tables: Rotary, cache: LayerCache, start: jax.Array) -> LayerCache:
        """The k/v of context ctx [B, T, D] (tables of its positions) written at slots start [B]."""
        k, v = self.keys_values(ctx, tables)
        return cache.write(k, v, start)


def drafter_layer(cfg: DrafterConfig, index: int, *, attention: str, dtypes: dict, rngs) -> DecoderBlock:
    window, causal = cfg.attention_pattern(index)
    mixer = DFlashAttention(
        window=window,
        causal=causal,
        hidden_size=cfg.hidden_size,
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        qk_norm=True,
        eps=cfg.rms_norm_eps,
        rngs=rngs,
        init_std=INIT_STD,
        implementation=attention,
        **dtypes,
    )
    mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, rngs=rngs, init_std=INIT_STD, **dtypes)
    block_kw = dict(hidden_size=cfg.hidden_size, norm_kw=dict(eps=cfg.rms_norm_eps, **dtypes))
    if cfg.kind_spec.layer is not None:
        return cfg.kind_spec.layer(cfg, mixer, mlp, rngs=rngs, **block_kw)
    return DecoderBlock("self_attn", mixer, mlp, **block_kw)


class DFlashDrafter(nnx.Module):
    def __init__(
        self,
        cfg: DrafterConfig,
        *,
        param_dtype=jnp.float32,
        compute_dtype=jnp.float32,
        attention: str = "auto",
        scan_layers: bool = False,
        rngs: nnx.Rngs,
    ):
        """`attention`: the training forward's attention code (`attention.IMPLEMENTATIONS`).
        `scan_layers`: the training forward runs each run of layers of one attention pattern
        under a scan over their weights, stacked in the forward pass (models/layers/layer_stack.py); the
        parameters stay one module per layer either way."""
        self.cfg = cfg
        self.compute_dtype = compute_dtype
        dtypes = dict(param_dtype=param_dtype, compute_dtype=compute_dtype)
        self.fc = linear(
            cfg.num_context_features * cfg.hidden_size, cfg.hidden_size, rngs=rngs, init_std=INIT_STD, **dtypes
        )
        self.hidden_norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, **dtypes)
        self.layers = nnx.List(
            [drafter_layer(cfg, i, attention=attention, dtypes=dtypes, rngs=rngs) for i in range(cfg.num_layers)]
        )
        # A drafter layer's module differs from another's by its attention pattern alone.
        kinds = [cfg.attention_pattern(i) for i in range(cfg.num_layers)]
        self.segments = layer_stack.segments(kinds, scan=scan_layers)
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, **dtypes)
        # The kind's heads (docs/design.md "Drafter kinds"), named as the export names them.
        heads = cfg.kind_spec.heads(
            cfg, compute_dtype=compute_dtype, init_std=INIT_STD, param_dtype=param_dtype, rngs=rngs
        )
        for name, head in heads.items():
            setattr(self, name, head)

    def _rotary(self, positions: jax.Array, num_positions: int | None = None) -> Rotary:
        return rotary(positions, self.cfg.rope, self.cfg.head_dim, num_positions=num_positions)

    def context(self, features: jax.Array) -> jax.Array:
        """Target features [..., F] -> ctx [..., D], computed once and shared by all layers."""
        return self.hidden_norm(self.fc(features.astype(self.compute_dtype)))

    def __call__(
        self,
        block_embeds: jax.Array,
        block_positions: jax.Array,
        ctx: jax.Array,
        ctx_positions: jax.Array,
        ctx_mask: jax.Array,
        *,
        blocks_per_chunk: int = BLOCKS_PER_CHUNK,
        remat_policy: str | None = None,
    ) -> jax.Array:
        """Training forward over many blocks of a packed batch.

        block_embeds [B, N, L, D], block_positions [B, N, L], ctx [B, S, D], ctx_positions [B, S],
        ctx_mask [B, N, S] (see `block_attention.block_context_mask`) -> final-normed hidden
        [B, N, L, D]. `remat_policy` (`layer_stack.REMAT_POLICIES`; None: none) recomputes each
        layer (each scanned period) in the backward pass, keeping only what the policy saves.
        """

        # Context positions restart in every document (< S); a block's run up to L past its anchor.
        bound = ctx_positions.shape[-1] + block_positions.shape[-1]
        blocks = DraftBlocks(
            self._rotary(block_positions, bound),
            ctx,
            self._rotary(ctx_positions, bound),
            ctx_mask,
            block_positions,
            ctx_positions,
            blocks_per_chunk=blocks_per_chunk,
        )

        units = [
            (
                segment,
                layer_stack.stack_modules(self.layers, segment) if segment.scanned else self.layers[segment.start],
            )
            for segment in self.segments
        ]
        with jax.named_scope("drafter"):  # names the collectives in `python -m dflash_jax.plan`
            x = block_embeds.astype(self.compute_dtype)
            x, _ = layer_stack.run_layers(x, units, lambda _: blocks, remat_policy=remat_policy)
            return self.norm(x)

    def new_cache(self, batch: int, max_len: int) -> ContextCache:
        return ContextCache.create(
            tuple(layer.mixer.new_cache(batch, max_len) for layer in self.layers), batch, max_len
        )

    def extend_context(
        self, cache: ContextCache, features: jax.Array, positions: jax.Array, num_valid: jax.Array
    ) -> ContextCache:
        """Write the context k/v of features [B, T, F] at `cache.lengths`; keep `num_valid` [B].

        All T slots are written (static shapes); only the first num_valid count as context, the
        rest are overwritten later and never visible.
        """
        ctx = self.context(features)
        tables = self._rotary(positions)
        layer_caches = tuple(
            layer.mixer.write_context(ctx, tables, layer_cache, cache.lengths)
            for layer, layer_cache in zip(self.layers, cache.layers)
        )
        return cache.replace(layers=layer_caches, lengths=cache.lengths + num_valid)

    def decode(
        self, block_embeds: jax.Array, block_positions: jax.Array, cache: ContextCache, *, num_slots: int | None = None
    ) -> jax.Array:
        """One block [B, L, D] at positions [B, L] against the cached context -> final-normed
        hidden [B, L, D]. `num_slots` (static): attend only the cache's first slots, at least
        every row's context length (None: all)."""
        x = block_embeds.astype(self.compute_dtype)
        step = DraftStep(self._rotary(block_positions), cache.lengths, num_slots)
        for layer, layer_cache in zip(self.layers, cache.layers):
            x, _ = layer.decode(x, step, layer_cache)
        return self.norm(x)
