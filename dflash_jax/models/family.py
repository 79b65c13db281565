"""What a target family module declares (`Family`), and the config.json readings families share.

A family is one module of models/families/: it reads its config.json into a `TransformerConfig`
(sizes, the mixer and MLP of every layer, its attention and norm style), lists where its
weights live on the hub (a weight-map table, models/weight_maps.py), and declares what only it
has: partition rules for its own parameters, the GGUF architectures that convert to it, and its
own decoder layer where the shared pre-norm block does not fit it (`DecoderLayer`).
models/families/__init__.py finds every such module; nothing else names a family.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from dflash_jax.errors import ModelError
from dflash_jax.models.architecture import TransformerConfig
from dflash_jax.models.hf_config import decoder_fields
from dflash_jax.models.weight_maps import Tensor, WeightMap


@dataclasses.dataclass(frozen=True)
class GgufArchitecture:
    """A GGUF `general.architecture` as the Hugging Face model it is converted from (models/formats/gguf.py)."""

    hf_architecture: str
    model_type: str
    interleaved_qk: bool  # llama.cpp permuted the rows of each q/k head (`gguf.uninterleave_qk`)


@dataclasses.dataclass(frozen=True)
class DecoderLayer:
    """A family's own decoder layer, which every layer of a config whose `block` names the family
    is (models/transformer.py builds and counts it through this record)."""

    # (cfg, index, attention_kw=, dtypes=, rngs=) -> layer `index`'s module, with the block
    # interface of `layers.DecoderBlock`; attention_kw: what every attention module of the target
    # is built with (hidden size, heads, attention code, dtypes, rngs).
    build: Callable[..., Any]
    # (cfg, index, rows, seq_len) -> multiply-adds of layer `index`'s forward over packed rows.
    macs: Callable[[TransformerConfig, int, int, int], int]


@dataclasses.dataclass(frozen=True)
class Family:
    """A target family as the hub publishes it."""

    name: str
    # Hub class (config.json `architectures`) -> where its decoder's tensors live ('model.'), or
    # (that, where its lm_head lives) when the head has a prefix too.
    architectures: Mapping[str, str | tuple[str, str]]
    # The config.json (a multimodal one's text_config merged in: `text_fields`) -> ours.
    config: Callable[[dict[str, Any]], TransformerConfig]
    # Weight-map rows, tried before the generic ones (models/weight_maps.py).
    tensors: tuple[Tensor, ...] = ()
    # (regex on a parameter path, logical axes) of the parameters only this family's layers have
    # (models/parameters.py, after the layers' own).
    partition_rules: tuple[tuple[str, tuple], ...] = ()
    # GGUF `general.architecture` -> how a file of it reads as this family (models/formats/gguf.py).
    gguf: Mapping[str, GgufArchitecture] = dataclasses.field(default_factory=dict)
    # Its own decoder layer (its configs' `block` is then the family's name); None: the shared one.
    layer: DecoderLayer | None = None

    def weight_map(self, architecture: str) -> WeightMap:
        prefix = self.architectures[architecture]
        decoder, head = (prefix, "") if isinstance(prefix, str) else prefix
        return WeightMap(self.tensors, decoder, head)


def text_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """A config.json's language-model fields: a multimodal checkpoint nests them in text_config
    (its top-level tie_word_embeddings still holds)."""
    text = {**hf, **(hf.get("text_config") or {})}
    if "tie_word_embeddings" in hf:
        text["tie_word_embeddings"] = hf["tie_word_embeddings"]
    return text


def decoder(hf: dict[str, Any]) -> dict[str, Any]:
    """The `TransformerConfig` fields every family reads alike: sizes, RoPE, tied embeddings and
    the `layer_types` of the config (with its window where a layer slides)."""
    layer_types = tuple(hf.get("layer_types") or ())
    return dict(
        **decoder_fields(hf),
        num_layers=int(hf["num_hidden_layers"]),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        layer_types=layer_types,
        sliding_window=int(hf.get("sliding_window") or 0) if "sliding_attention" in layer_types else 0,
    )


def reject(hf: dict[str, Any], family: str, *fields: str) -> None:
    """A one-line error when the config turns on any of `fields`, which `family` does not have."""
    on = [f for f in fields if hf.get(f)]
    if on:
        raise ModelError(f"{family}: {', '.join(on)} set in config.json, which this family does not support")
