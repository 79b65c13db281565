"""Weight maps: where each parameter of a target comes from in a checkpoint as the hub publishes it.

A family module (models/families/) declares a table of `Tensor` rows, hub tensor-name pattern ->
our parameter-path pattern + transform. A pattern names the end of a dotted path; what comes
before it (`layers.3.mlp.`) is the same on both sides, and hub names are read under the layout's
prefix (`model.`, or `model.language_model.` for a multimodal checkpoint; `lm_head` has its own,
'' but for Kimi-K2.5's `language_model.`, as every hub layout keeps it outside the decoder). In a pattern

    {name}          one segment, carried from the parameter path to the hub name
    {name:a|b}      one of the segments listed
    {expert}        (hub side only) the tensors of experts 0, 1, ... stacked on a new first axis

For each parameter the rows whose `param` pattern matches are tried in order, the family's then
`GENERIC`, and the first whose hub tensors the checkpoint holds is read: a family lists every
layout it is published in (one tensor per expert, fused, quantized) and the checkpoint picks.
`GENERIC` is what every family shares: Linear kernels ([in, out] here) are torch's `weight`
transposed and embeddings are `weight`; a parameter no row matches has its hub name.

A transform is a function (the tensors read, the target's config, the numpy dtype wanted) -> our
tensor: `as_is`, `transpose`, `split`, `chain`, and family-specific ones beside their tables.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import re
from collections.abc import Callable, Collection, Sequence
from typing import Any, Protocol

import numpy as np

Transform = Callable[[list[np.ndarray], Any, Any], np.ndarray]


class TensorSource(Protocol):
    """What a weight map reads from (models.hf.SafetensorsReader is one)."""

    def names(self) -> Collection[str]: ...

    def get(self, name: str) -> np.ndarray: ...


def as_is(tensors: list[np.ndarray], cfg, dtype) -> np.ndarray:
    return tensors[0]


def transpose(tensors: list[np.ndarray], cfg, dtype) -> np.ndarray:
    """torch's Linear layout [..., out, in] <-> ours [..., in, out] (stacked experts included)."""
    return np.swapaxes(tensors[0], -1, -2)


def split(part: int, parts: int, *, axis: int, interleaved: bool = False) -> Transform:
    """Part `part` of `parts` equal parts of `axis`: consecutive slices, or (interleaved) every
    `parts`-th entry from the `part`-th."""

    def take(tensors, cfg, dtype):
        x = tensors[0]
        size = x.shape[axis] // parts
        index = slice(part, None, parts) if interleaved else slice(part * size, (part + 1) * size)
        return x[(slice(None),) * (axis % x.ndim) + (index,)]

    return take


def chain(*transforms: Transform) -> Transform:
    """The transforms one after the other (each after the first takes its predecessor's result)."""

    def apply(tensors, cfg, dtype):
        for transform in transforms:
            tensors = [transform(tensors, cfg, dtype)]
        return tensors[0]

    return apply


_PLACEHOLDER = re.compile(r"\{(\w+)(?::([\w|]+))?\}")
EXPERT = "{expert}"  # a hub pattern's stacking placeholder


@functools.cache
def _param_regex(pattern: str) -> re.Pattern:
    """`pattern` at the end of a dotted path; group `lead` is what comes before it."""
    pieces, last = [], 0
    for m in _PLACEHOLDER.finditer(pattern):
        pieces += [re.escape(pattern[last : m.start()]), f"(?P<{m.group(1)}>{m.group(2) or '[^.]+'})"]
        last = m.end()
    return re.compile(r"(?P<lead>(?:.+\.)?)" + "".join(pieces) + re.escape(pattern[last:]))


@dataclasses.dataclass(frozen=True)
class Tensor:
    """Our parameters whose paths end like `param` come from the hub tensor(s) whose names end
    like `hub` (several: the transform receives them in that order), through `transform`."""

    hub: str | tuple[str, ...]
    param: str
    transform: Transform = as_is

    def hub_names(self, path: str) -> list[str] | None:
        """The hub names (unprefixed; `{expert}` left in) of the parameter at `path`, or None
        when `param` does not match it."""
        m = _param_regex(self.param).fullmatch(path)
        if m is None:
            return None
        fields = m.groupdict()
        hubs = (self.hub,) if isinstance(self.hub, str) else self.hub
        fill = functools.partial(_PLACEHOLDER.sub, lambda p: fields.get(p.group(1), p.group(0)))
        return [fields["lead"] + fill(hub) for hub in hubs]


GENERIC = (
    Tensor("weight", "kernel", transpose),
    Tensor("weight", "embedding"),
)


@dataclasses.dataclass(frozen=True)
class WeightMap:
    """A family's rows (tried before `GENERIC`) and where its decoder's tensors and LM head live."""

    tensors: tuple[Tensor, ...] = ()
    prefix: str = "model."
    head_prefix: str = ""  # before `lm_head` (Kimi-K2.5: 'language_model.')

    def read(self, source: TensorSource, path: Sequence, cfg, dtype=np.float32) -> tuple[np.ndarray, str]:
        """Our parameter at `path`, in our layout -> (tensor, the hub name to cite in errors).
        Raises KeyError(the hub names tried) when the checkpoint holds none of its layouts."""
        name = ".".join(str(p) for p in path)
        candidates = [(row, names) for row in self.tensors if (names := row.hub_names(name)) is not None]
        generic = [(row, names) for row in GENERIC if (names := row.hub_names(name)) is not None]
        candidates += generic[:1] or [(Tensor(name, name), [name])]
        held = source.names()
        for row, names in candidates:
            names = [self._prefixed(n) for n in names]
            if all(n.replace(EXPERT, "0") in held for n in names):
                tensors = [_stacked(source, n, held) if EXPERT in n else source.get(n) for n in names]
                return row.transform(tensors, cfg, dtype), names[0]
        raise KeyError(tuple(self._prefixed(names[0]).replace(EXPERT, "0") for _, names in candidates))

    def _prefixed(self, name: str) -> str:
        return (self.head_prefix if name.startswith("lm_head") else self.prefix) + name


def _stacked(source: TensorSource, pattern: str, held: Collection[str]) -> np.ndarray:
    """The tensors of experts 0, 1, ... (as many as the checkpoint holds), stacked."""
    names = itertools.takewhile(lambda n: n in held, (pattern.replace(EXPERT, str(e)) for e in itertools.count()))
    return np.stack([source.get(n) for n in names])


def checkpoint_name(path: Sequence, prefix: str = "") -> tuple[str, bool]:
    """A parameter's name in a checkpoint of the generic layout (drafters, ours and released
    ones) -> (its name, whether it is stored transposed)."""
    name = ".".join(str(p) for p in path)
    for row in GENERIC:
        names = row.hub_names(name)
        if names is not None:
            return WeightMap(prefix=prefix)._prefixed(names[0]), row.transform is transpose
    return WeightMap(prefix=prefix)._prefixed(name), False
