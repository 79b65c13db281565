"""Where every parameter of the target and the drafter lives (docs/design.md §8).

A parameter's logical axes come from the first partition rule whose pattern ends its path
(`layers.3.mlp.up_proj.kernel`); the rules are declared by the modules that define the weights:
the layers (models/layers/: attention projections, SwiGLU and norms, mixture of experts, latent
attention, Gated DeltaNet), the models themselves (embedding, LM head, the drafter's fc), then each
target family's and drafter kind's `partition_rules` for what only it has. The mesh's rules table
(models/sharding.py) then places those axes: a model's weights by its layout, the trained state
ZeRO-style over every device.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dflash_jax.models import families, kinds
from dflash_jax.models.layers import basic, latent_attention, linear_attention, mixers, moe
from dflash_jax.models.sharding import (
    EMBED,
    FEATURES,
    LAYERS,
    VOCAB,
    ZERO_RULES,
    PartitionRules,
    dotted,
    is_stacked,
    layout_spec,
    logical_to_spec,
)

# The models' own parameters, outside their layers.
MODEL_RULES: PartitionRules = (
    (r"embed_tokens\.embedding", (VOCAB, EMBED)),
    (r"lm_head\.kernel", (EMBED, VOCAB)),
    (r"fc\.kernel", (FEATURES, EMBED)),  # the drafter's: k target layers' features -> D
)

PARTITION_RULES: PartitionRules = (
    *moe.PARTITION_RULES,
    *latent_attention.PARTITION_RULES,
    *linear_attention.PARTITION_RULES,
    *mixers.PARTITION_RULES,
    *basic.PARTITION_RULES,
    *MODEL_RULES,
    *(rule for owner in (*families.FAMILIES.values(), *kinds.KINDS.values()) for rule in owner.partition_rules),
)


def param_axes(path: str | Sequence) -> tuple[str, ...]:
    """The logical axes of the parameter at `path` ('layers.0.self_attn.q_proj.kernel' or keys);
    a stacked one's ('layers.2.stacked.0.self_attn.q_proj.kernel') start with LAYERS."""
    name = path if isinstance(path, str) else dotted(path)
    for pattern, axes in PARTITION_RULES:
        if re.search(rf"(^|\.){pattern}$", name):
            return (LAYERS, *axes) if is_stacked(name) else axes
    raise KeyError(
        f"parameter {name!r} has no logical axes: add a partition rule for it to the module that defines it "
        "(its layer's PARTITION_RULES, or the partition_rules of its family or drafter kind)"
    )


def param_spec(mesh: Mesh | Mapping[str, int], path, shape: Sequence[int]) -> PartitionSpec:
    """Where a model's (frozen or inference) parameter lives under the mesh's layout."""
    return layout_spec(mesh, param_axes(path), shape)


def param_sharding(mesh: Mesh, path, shape: Sequence[int]) -> NamedSharding:
    return NamedSharding(mesh, param_spec(mesh, path, shape))


def param_shardings(mesh: Mesh, params):
    """NamedShardings for a (abstract) parameter pytree of a model (e.g. the frozen target)."""
    return jax.tree_util.tree_map_with_path(lambda path, x: param_sharding(mesh, path, x.shape), params)


def zero_spec(mesh: Mesh | Mapping[str, int], path, shape: Sequence[int]) -> PartitionSpec:
    """Where a leaf of the trained state lives: split over every device (ZeRO); scalars, RNG keys,
    Muon's Newton-Schulz coefficients and norm scales replicated."""
    if len(shape) == 0:
        return PartitionSpec()
    name = path if isinstance(path, str) else dotted(path)
    if re.search(r"(^|\.)(rng|ns_coeffs)$", name):
        return PartitionSpec()
    return logical_to_spec(param_axes(name), shape, mesh, ZERO_RULES)


def train_state_shardings(mesh: Mesh, state):
    """NamedShardings for a trained state pytree (params, optimizer moments, counters)."""
    return jax.tree_util.tree_map_with_path(lambda path, x: NamedSharding(mesh, zero_spec(mesh, path, x.shape)), state)
