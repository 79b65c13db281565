"""A drafter that starts from one of the target's layers (`train.init_from_target_layer`).

Every drafter layer begins as a copy of target layer i (attention, MLP, their norms) and the
drafter's final norm as the target's, where the parameter exists in both with the same shape:
the drafter then starts from a computation the frozen LM head already reads, rather than from
noise. What has no counterpart (fc, hidden_norm, the kinds' heads) keeps its random init.
"""

from __future__ import annotations

import re

import jax
from flax import nnx

from dflash_jax.errors import ConfigError
from dflash_jax.models.transformer import Transformer

_LAYER = re.compile(r"^\['layers'\]\[\d+\]")


def target_layer_params(target: Transformer, layer: int) -> dict | None:
    """What `from_target_layer` reads of `target` (None when layer < 0), named as a target without
    scanned layers names it: layer `layer`'s parameters (sliced out of their stack) and the final
    norm's."""
    if layer < 0:
        return None
    return {"layers": {layer: nnx.state(target.layer(layer))}, "norm": nnx.state(target.norm)}


def from_target_layer(params: nnx.State, target_params: nnx.State, layer: int) -> nnx.State:
    """The drafter's params with every layer's tensors (and the final norm) target layer `layer`'s."""
    target = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(target_params)}
    copied = []

    def pick(path, x):
        key = jax.tree_util.keystr(path)
        if not (_LAYER.match(key) or key.startswith("['norm']")):
            return x
        source = target.get(_LAYER.sub(f"['layers'][{layer}]", key))
        if source is None or source.shape != x.shape:
            return x
        copied.append(key)
        return source.astype(x.dtype)

    params = jax.tree_util.tree_map_with_path(pick, params)
    if not any(_LAYER.match(k) for k in copied):
        raise ConfigError(
            f"train.init_from_target_layer={layer}: no drafter layer tensor has the shape of target layer "
            f"{layer}'s (a drafter shaped unlike the target's layers starts from random weights: use -1)"
        )
    return params
