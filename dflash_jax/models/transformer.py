"""The frozen target LM, built layer by layer from its config's per-layer spec, in Flax NNX.

Every layer is a `layers.DecoderBlock`: a token mixer chosen by `cfg.layer_types[i]` and an MLP
(or, where `cfg.block` names a family, that family's own layer: `family.DecoderLayer`).
With `scan_layers`, each run of a repeating layer pattern runs under one scan over its layers'
stacked weights (models/layers/layer_stack.py; docs/design.md §8). Two entry points:
  * `__call__` runs packed rows (tokens, segment_ids, positions); no mixer ever crosses a
    document, it returns the requested layers' hidden states and can stop after the last of
    them (DFlash training only needs the context features, not the logits).
  * `decode` appends tokens to a `KVCache` (prefill and multi-token verification alike); the
    caller rolls back rejected tokens by lowering `cache.lengths`.
Module names mirror the Hugging Face checkpoint names; a family's weight map (models/families/)
says where the rest live.
Shape letters: docs/design.md §9 (B rows, S tokens, T new tokens, D model dim, V vocab).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from dflash_jax.models import families
from dflash_jax.models.architecture import TransformerConfig, layer_attention, layer_window
from dflash_jax.models.layers import layer_stack
from dflash_jax.models.layers.basic import DecoderBlock, RMSNorm, Rotary, SwiGLU, rotary, soft_capped, swiglu_macs
from dflash_jax.models.layers.cache import KVCache
from dflash_jax.models.layers.latent_attention import LatentAttention, latent_attention_macs
from dflash_jax.models.layers.linear_attention import GatedDeltaNet, gated_deltanet_macs
from dflash_jax.models.layers.mixers import DecodeStep, PackedRows, SelfAttention, attention_macs
from dflash_jax.models.layers.moe import MoE, moe_macs
from dflash_jax.models.parameters import param_sharding


def _attention_kw(cfg: TransformerConfig, *, attention: str, dtypes: dict, rngs) -> dict:
    """What every attention module of a target is built with, whatever its kind."""
    return dict(hidden_size=cfg.hidden_size, num_heads=cfg.num_heads, implementation=attention, rngs=rngs, **dtypes)


def _mixer(cfg: TransformerConfig, layer_type: str, *, attention: str, dtypes: dict, rngs) -> tuple[str, nnx.Module]:
    """The token mixer of a layer of `layer_type` -> (its checkpoint name, the module)."""
    if layer_type == "linear_attention":
        mixer = GatedDeltaNet(
            cfg.linear_attention, hidden_size=cfg.hidden_size, eps=cfg.rms_norm_eps, rngs=rngs, **dtypes
        )
        return "linear_attn", mixer
    attention_kw = _attention_kw(cfg, attention=attention, dtypes=dtypes, rngs=rngs)
    if cfg.latent_attention is not None:
        return "self_attn", LatentAttention(cfg.latent_attention, **attention_kw)
    return "self_attn", SelfAttention(
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        qk_norm=cfg.qk_norm,
        eps=cfg.rms_norm_eps,
        output_gate=cfg.attention_output_gate,
        zero_centered_norm=cfg.zero_centered_norm,
        use_bias=cfg.attention_bias,
        sliding_window=layer_window(cfg, layer_type),
        sinks=cfg.attention_sinks,
        qk_norm_across_heads=cfg.qk_norm_across_heads,
        **attention_kw,
    )


def _mlp(cfg: TransformerConfig, experts: bool, *, dtypes: dict, rngs) -> nnx.Module:
    """A layer's MLP: the mixture of experts where the config says so, else SwiGLU."""
    if experts:
        return MoE(cfg.hidden_size, cfg.moe, rngs=rngs, **dtypes)
    return SwiGLU(cfg.hidden_size, cfg.intermediate_size, activation=cfg.mlp_activation, rngs=rngs, **dtypes)


def layer_kind(cfg: TransformerConfig, index: int) -> tuple[str, bool]:
    """All that sets layer `index`'s module apart from another layer's: its mixer's layer type and
    whether its MLP has experts (layers of one kind scan together, models/layers/layer_stack.py)."""
    return cfg.layer_types[index], index in cfg.moe_layers


def decoder_layer(cfg: TransformerConfig, index: int, *, attention: str, dtypes: dict, rngs) -> nnx.Module:
    """Layer `index`: the family's own layer where `cfg.block` names one, else the pre-norm block
    of its mixer and MLP."""
    own = families.decoder_layer(cfg)
    if own is not None:
        attention_kw = _attention_kw(cfg, attention=attention, dtypes=dtypes, rngs=rngs)
        return own.build(cfg, index, attention_kw=attention_kw, dtypes=dtypes, rngs=rngs)
    layer_type, experts = layer_kind(cfg, index)
    name, mixer = _mixer(cfg, layer_type, attention=attention, dtypes=dtypes, rngs=rngs)
    mlp = _mlp(cfg, experts, dtypes=dtypes, rngs=rngs)
    return DecoderBlock(name, mixer, mlp, hidden_size=cfg.hidden_size, norm_kw=_norm_kw(cfg, dtypes))


def layer_macs(cfg: TransformerConfig, index: int, rows: int, seq_len: int) -> int:
    """Multiply-adds of layer `index`'s forward over [rows, seq_len] packed rows, as each of the
    mechanisms `decoder_layer` builds it of counts them (an MoE: the chosen experts only)."""
    own = families.decoder_layer(cfg)
    if own is not None:
        return own.macs(cfg, index, rows, seq_len)
    layer_type, experts = layer_kind(cfg, index)
    if layer_type == "linear_attention":
        mixer = rows * seq_len * gated_deltanet_macs(cfg.linear_attention, cfg.hidden_size)
    elif cfg.latent_attention is not None:
        mixer = latent_attention_macs(cfg, rows, seq_len)
    else:
        mixer = attention_macs(cfg, layer_type, rows, seq_len)
    mlp = moe_macs(cfg.hidden_size, cfg.moe) if experts else swiglu_macs(cfg.hidden_size, cfg.intermediate_size)
    return mixer + rows * seq_len * mlp


def _norm_kw(cfg: TransformerConfig, dtypes: dict) -> dict:
    return dict(eps=cfg.rms_norm_eps, zero_centered=cfg.zero_centered_norm, **dtypes)


class Transformer(nnx.Module):
    def __init__(
        self,
        cfg: TransformerConfig,
        *,
        param_dtype=jnp.float32,
        compute_dtype=jnp.float32,
        attention: str = "auto",
        scan_layers: bool = False,
        rngs: nnx.Rngs,
    ):
        """`attention`: the packed forward's attention code (`attention.IMPLEMENTATIONS`).
        `scan_layers`: each run of a repeating layer pattern runs under one scan over its layers'
        stacked weights (models/layers/layer_stack.py); `layers[k]` is then segment k (`segments[k]`):
        one layer, or a `LayerStack`. Otherwise `layers[i]` is layer i."""
        self.cfg = cfg
        self.param_dtype, self.compute_dtype, self.attention = param_dtype, compute_dtype, attention
        self.embed_tokens = nnx.Embed(
            cfg.vocab_size, cfg.hidden_size, dtype=compute_dtype, param_dtype=param_dtype, rngs=rngs
        )
        dtypes = dict(param_dtype=param_dtype, compute_dtype=compute_dtype)
        kinds = [layer_kind(cfg, i) for i in range(cfg.num_layers)]
        self.segments = layer_stack.segments(kinds, scan=scan_layers)

        def make(index: int, rngs: nnx.Rngs) -> nnx.Module:
            return decoder_layer(cfg, index, attention=attention, dtypes=dtypes, rngs=rngs)

        self.layers = nnx.List(
            [
                layer_stack.LayerStack(segment, make, rngs=rngs) if segment.scanned else make(segment.start, rngs)
                for segment in self.segments
            ]
        )
        self.norm = RMSNorm(cfg.hidden_size, **_norm_kw(cfg, dtypes))
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else nnx.Linear(
                cfg.hidden_size,
                cfg.vocab_size,
                use_bias=False,
                dtype=compute_dtype,
                param_dtype=param_dtype,
                rngs=rngs,
            )
        )

    def embed(self, tokens: jax.Array) -> jax.Array:
        """tokens [...] -> [..., D] (times `cfg.embedding_scale`, rounded to the parameter dtype)."""
        x = self.embed_tokens(tokens)
        if self.cfg.embedding_scale != 1.0:
            x = x * jnp.asarray(self.cfg.embedding_scale, self.embed_tokens.embedding[...].dtype).astype(x.dtype)
        return x.astype(self.compute_dtype)

    def unembed(self, h: jax.Array) -> jax.Array:
        """Normalized hidden states [..., D] -> logits [..., V] with the LM head (tied or not),
        soft-capped where the config says so."""
        if self.lm_head is None:
            logits = self.embed_tokens.attend(h.astype(self.compute_dtype))
        else:
            logits = self.lm_head(h)
        return soft_capped(logits, self.cfg.final_logit_softcap)

    def new_cache(self, batch: int, max_len: int, *, max_step: int = 1) -> KVCache:
        """Room for `max_len` tokens a row; a `decode` call that a later call may roll back adds at
        most `max_step` tokens (the speculative block; a prefill may add more)."""
        layers = tuple(self._mixer_of(i).new_cache(batch, max_len, max_step) for i in range(self.cfg.num_layers))
        return KVCache.create(layers, batch, max_len)

    def _mixer_of(self, index: int) -> nnx.Module:
        """Layer `index`'s mixer module (stacked with its kind's, in a scanned segment: the cache
        it makes depends on its settings alone)."""
        for segment, layer in zip(self.segments, self.layers):
            if segment.start <= index < segment.stop:
                return layer.stacked[(index - segment.start) % segment.period].mixer if segment.scanned else layer.mixer
        raise IndexError(index)

    def layer(self, index: int) -> nnx.Module:
        """Layer `index`'s module (a scanned one's weights sliced out of its stack)."""
        for segment, layer in zip(self.segments, self.layers):
            if segment.start <= index < segment.stop:
                return layer.split().layer(*divmod(index - segment.start, segment.period)) if segment.scanned else layer
        raise IndexError(index)

    def _units(self) -> list[tuple[layer_stack.Segment, nnx.Module | layer_stack.Stacked]]:
        return [
            (segment, layer.split() if segment.scanned else layer) for segment, layer in zip(self.segments, self.layers)
        ]

    def checkpoint_paths(self, path: Sequence) -> list[tuple]:
        """The parameter paths, as the model without scanned layers names them (`layers.{i}.…`, the
        checkpoints' layout), of what the parameter at `path` holds: one, or a stacked parameter's
        layers in slot order."""
        path = tuple(path)
        if path[0] != "layers" or not any(s.scanned for s in self.segments):
            return [path]
        segment = self.segments[int(path[1])]
        if not segment.scanned:
            return [("layers", segment.start, *path[2:])]
        position = int(path[3])  # layers.{k}.stacked.{position}.…
        return [("layers", segment.layer(g, position), *path[4:]) for g in range(segment.repeats)]

    def relayout(self, *, scan_layers: bool) -> Transformer:
        """This model with its layers scanned or not (`scan_layers`), its weights moved to the other
        layout. It takes this model's weights: each buffer is given up once moved, so the devices
        hold at most one stack more than the model (decoding runs its layers one by one, and
        slicing every layer's weights out of a stack each step would copy them all)."""
        other = nnx.eval_shape(
            lambda: Transformer(
                self.cfg,
                param_dtype=self.param_dtype,
                compute_dtype=self.compute_dtype,
                attention=self.attention,
                scan_layers=scan_layers,
                rngs=nnx.Rngs(0),
            )
        )
        graphdef, abstract = nnx.split(other)
        moved = layer_stack.moved(
            _flat_params(nnx.state(self)),
            self.checkpoint_paths,
            _flat_params(abstract),
            other.checkpoint_paths,
            param_sharding,
        )
        pure = nnx.to_pure_dict(abstract)
        paths, treedef = jax.tree_util.tree_flatten_with_path(pure)
        nnx.replace_by_pure_dict(abstract, jax.tree.unflatten(treedef, [moved[_keys(p)] for p, _ in paths]))
        return nnx.merge(graphdef, abstract)

    def __call__(
        self,
        tokens: jax.Array,
        segment_ids: jax.Array,
        positions: jax.Array,
        *,
        hidden_layers: Sequence[int] = (),
        return_logits: bool = True,
    ) -> tuple[jax.Array | None, tuple[jax.Array, ...]]:
        """Packed forward of [B, S] rows -> (logits [B, S, V] or None, hidden states [B, S, D] of
        `hidden_layers` in that order, as `layer_outputs` defines them). With return_logits=False
        the forward stops after max(hidden_layers). Positions restart in every document, so all
        lie below S (a position at or past S yields NaN)."""
        with jax.named_scope("target"):  # names the collectives in `python -m dflash_jax.plan`
            last = self.cfg.num_layers - 1 if return_logits else max(hidden_layers)
            x = self.embed(tokens)
            tables = self._rotary(positions, num_positions=tokens.shape[-1])

            def inputs_of(layer: int) -> PackedRows:
                return PackedRows(segment_ids, tables[self.cfg.layer_types[layer]])

            x, kept = layer_stack.run_layers(x, self._units(), inputs_of, last=last, keep=hidden_layers)
            outputs = self.layer_outputs({**kept, last: x})
            logits = self.unembed(outputs[last]) if return_logits else None
            return logits, tuple(outputs[i] for i in hidden_layers)

    def layer_outputs(self, outputs: dict[int, jax.Array]) -> dict[int, jax.Array]:
        """Raw decoder-layer outputs by layer -> the hidden state of each layer as transformers'
        `hidden_states[i + 1]` holds it: the last layer's after the final norm (docs/design.md §2),
        which is what the reference DFlash code reads as that layer's context feature."""
        final = self.cfg.num_layers - 1
        return {i: self.norm(x) if i == final else x for i, x in outputs.items()}

    def features(self, tokens, segment_ids, positions, layer_ids: Sequence[int]) -> jax.Array:
        """DFlash context features (docs/design.md §2): the chosen layers' hidden states
        concatenated, [B, S, k·D]."""
        _, hidden = self(tokens, segment_ids, positions, hidden_layers=layer_ids, return_logits=False)
        return jnp.concatenate(hidden, axis=-1)

    def decode(
        self,
        tokens: jax.Array,
        cache: KVCache,
        *,
        feature_layers: Sequence[int] = (),
        num_valid: jax.Array | None = None,
        num_slots: int | None = None,
    ) -> tuple[jax.Array, jax.Array | None, KVCache]:
        """Append tokens [B, T] after `cache.lengths` -> (logits [B, T, V], features, new cache).

        Positions continue from each row's cache length. Features (concat of `feature_layers`
        hidden states as `layer_outputs` defines them, [B, T, k·D]) are what the drafter's context cache needs for these tokens.
        `num_valid` [B]: right-padded rows (a prefill), only the first num_valid tokens are real;
        the caller then sets `lengths` to start + num_valid.
        `num_slots` (static): attention reads only the caches' first slots, at least every row's
        length + T (None: all M); the decoding loop picks it from a few buckets.
        Layers run one by one, each with its own cache slice (scanned segments' weights sliced).
        """
        num_new = tokens.shape[1]
        positions = cache.lengths[:, None] + jnp.arange(num_new)[None, :]
        tables = self._rotary(positions)
        x = self.embed(tokens)
        outputs, layer_caches = {}, []
        layers = layer_stack.layer_modules([unit for _, unit in self._units()])
        for i, (layer, layer_type, layer_cache) in enumerate(zip(layers, self.cfg.layer_types, cache.layers)):
            x, layer_cache = layer.decode(
                x, DecodeStep(cache.lengths, tables[layer_type], num_valid, num_slots), layer_cache
            )
            outputs[i] = x
            layer_caches.append(layer_cache)
        outputs = self.layer_outputs(outputs)
        logits = self.unembed(outputs[self.cfg.num_layers - 1])
        features = jnp.concatenate([outputs[i] for i in feature_layers], axis=-1) if feature_layers else None
        return logits, features, cache.replace(layers=tuple(layer_caches), lengths=cache.lengths + num_new)

    def _rotary(self, positions: jax.Array, num_positions: int | None = None) -> dict[str, Rotary]:
        """Layer type -> the RoPE tables of `positions` its layers use, computed once per distinct
        RoPE and head size (Gemma 4's full layers have their own)."""
        tables, by_type = {}, {}
        for layer_type in set(self.cfg.layer_types):
            own = layer_attention(self.cfg, layer_type)
            key = (own.rope, own.head_dim)
            if key not in tables:
                tables[key] = rotary(positions, own.rope, own.head_dim, num_positions=num_positions)
            by_type[layer_type] = tables[key]
        return by_type


def _keys(path) -> tuple:
    """A pytree key path of a pure parameter dict -> ('layers', 0, 'mlp', 'up_proj', 'kernel')."""
    return tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path)


def _flat_params(state: nnx.State) -> dict[tuple, jax.Array]:
    return {_keys(p): x for p, x in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(state))}
