"""Hugging Face checkpoints: import a target LM, import/export DFlash drafters.

NNX parameter paths mirror checkpoint names (`layers.3.self_attn.q_proj.kernel` <->
`layers.3.self_attn.q_proj.weight`), so the mapping is mechanical for drafters (the generic weight
map of `weight_maps.py`) and mostly so for targets: a target's family (models/families/) says
where the rest of its tensors live (prefix, stacked experts, fused projections, quantized ones).

Loading builds the model abstractly, then reads one tensor at a time, converts it to the
parameter dtype and places it (optionally on a mesh, where `models/parameters.py` puts that
parameter by name), so host memory never holds more than one tensor of an 8B model.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import shutil
from collections.abc import Callable, Collection, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from dflash_jax.errors import ModelError, some_of
from dflash_jax.models import families, kinds
from dflash_jax.models.drafter import DFlashDrafter
from dflash_jax.models.drafter_config import DrafterConfig
from dflash_jax.models.formats.gguf import GgufTensors, gguf_source, model_dir, weights_file
from dflash_jax.models.parameters import param_sharding
from dflash_jax.models.sharding import is_stacked
from dflash_jax.models.transformer import Transformer
from dflash_jax.models.weight_maps import WeightMap, checkpoint_name

log = logging.getLogger(__name__)

_NUMPY_DTYPES = {
    jnp.dtype(jnp.float32): np.float32,
    jnp.dtype(jnp.bfloat16): ml_dtypes.bfloat16,
    jnp.dtype(jnp.float16): np.float16,
}


def read_config(path: str | os.PathLike) -> dict:
    """A model directory's config.json; one that is not a JSON object is a one-line ModelError naming it."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file} not found: expected a Hugging Face model directory")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except ValueError as e:  # not UTF-8, not JSON
        raise ModelError(f"{config_file}: not JSON ({e})") from None
    if not isinstance(config, dict):
        raise ModelError(f"{config_file}: not a JSON object but a {type(config).__name__}")
    return config


def read_drafter_config(path: str | os.PathLike) -> DrafterConfig:
    """The drafter a directory's config.json describes; one that does not describe a drafter (a
    field missing or of the wrong type) is a one-line ModelError naming the file."""
    config_file = Path(path) / "config.json"
    hf = read_config(path)
    try:
        return DrafterConfig.from_hf(hf)
    except KeyError as e:
        raise ModelError(f"{config_file}: the field {e.args[0]!r} is missing") from None
    except (ValueError, TypeError, AttributeError) as e:  # a ModelError too: its checks of the fields
        raise ModelError(f"{config_file}: {e}") from None


# safetensors' own limit on a header (its reader refuses larger ones).
MAX_SAFETENSORS_HEADER = 100_000_000
# Bits per element of each safetensors dtype.
SAFETENSORS_BITS = {
    "BOOL": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "C64": 64,
    "F64": 64,
    "I64": 64,
    "U64": 64,
}
_MAX_DIMS = 64  # numpy's


def safetensors_header(file: str | os.PathLike) -> dict[str, dict]:
    """The tensors of a safetensors file, name -> {dtype, shape, data_offsets}. The file is an 8-byte
    little-endian header size, the JSON header, then the data (offsets count from its start). Every
    size and offset is checked against the file's size before more than 8 bytes are read, so a
    truncated, damaged or hostile file is a one-line ModelError naming it, never a large allocation."""
    file = Path(file)
    size = file.stat().st_size
    if size < 8:
        raise ModelError(f"{file}: {size} bytes: not a safetensors file (empty or truncated)")
    with open(file, "rb") as f:
        header_size = int.from_bytes(f.read(8), "little")
        if header_size > min(size - 8, MAX_SAFETENSORS_HEADER):
            raise ModelError(
                f"{file}: not a safetensors file, or truncated: its header claims {header_size:,} bytes, "
                f"the file holds {size:,}"
            )
        text = f.read(header_size)
    try:
        header = json.loads(text)
    except ValueError:  # not UTF-8, not JSON
        raise ModelError(f"{file}: damaged, or not a safetensors file: its header is not JSON") from None
    if not isinstance(header, dict):
        raise ModelError(f"{file}: damaged, or not a safetensors file: its header is not a JSON object")
    data_size = size - 8 - header_size
    tensors = {name: entry for name, entry in header.items() if name != "__metadata__"}
    for name, entry in tensors.items():
        if problem := _tensor_problem(entry, data_size):
            raise ModelError(f"{file}: tensor {name!r} {problem}")
    return tensors


def _tensor_problem(entry, data_size: int) -> str | None:
    """What is wrong with a tensor's header entry in a file of `data_size` data bytes, or None."""
    if not isinstance(entry, dict):
        return "is not described by a JSON object"
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in SAFETENSORS_BITS:
        return f"has an unknown dtype {dtype!r}"
    if not (_counts(shape) and len(shape) <= _MAX_DIMS and _counts(offsets) and len(offsets) == 2):
        return f"has a bad shape {shape!r} or data_offsets {offsets!r}"
    begin, end = offsets
    if end > data_size:
        return f"ends at byte {end:,} of the data, which holds {data_size:,}: the file is truncated or damaged"
    needed = -(-math.prod(shape) * SAFETENSORS_BITS[dtype] // 8)  # in Python's integers: no overflow
    if needed != end - begin:
        return f"of shape {shape} {dtype} needs {needed:,} bytes, its data_offsets {offsets} span {end - begin:,}"
    return None


def _counts(value) -> bool:
    """A JSON list of non-negative integers."""
    return isinstance(value, list) and all(type(n) is int and n >= 0 for n in value)


class SafetensorsReader:
    """Random access to the tensors of a single-file or sharded (`*.index.json`) checkpoint, each
    file's header checked (`safetensors_header`) when the reader opens."""

    def __init__(self, path: str | os.PathLike):
        path = Path(path)
        index = path / "model.safetensors.index.json"
        if index.is_file():
            try:
                files = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
                self.files = {name: path / f for name, f in files.items()}
            except (ValueError, KeyError, TypeError, AttributeError):
                raise ModelError(f"{index}: damaged: not JSON with a weight_map of tensor names to files") from None
            for f in set(self.files.values()):
                if not f.is_file():
                    raise ModelError(f"{index}: names {f.name}, which {path} does not hold")
                safetensors_header(f)
        else:
            files = sorted(path.glob("*.safetensors"))
            if not files:
                raise ModelError(f"{path}: no weights: neither *.safetensors files nor model.safetensors.index.json")
            self.files = {name: f for f in files for name in safetensors_header(f)}

    def names(self) -> Collection[str]:
        return self.files.keys()

    def get(self, name: str) -> np.ndarray:
        if name not in self.files:
            raise KeyError(name)
        file = self.files[name]
        try:
            with safe_open(file, framework="numpy") as handle:
                dtype = handle.get_slice(name).get_dtype()
                if dtype not in _FP8_DTYPES:
                    return handle.get_tensor(name)
        except SafetensorError as e:  # what the header check leaves to the reader (bytes after the data)
            raise ModelError(f"{file}: damaged, or not a safetensors file ({e})") from None
        return _raw_tensor(file, name, _FP8_DTYPES[dtype])


# Checkpoint dtypes numpy has no name for (safetensors' numpy reader fails on them): read raw.
_FP8_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}


def _raw_tensor(file: Path, name: str, dtype) -> np.ndarray:
    """One tensor of a safetensors file read from its bytes (`safetensors_header` checked them)."""
    entry = safetensors_header(file)[name]
    begin, end = entry["data_offsets"]
    with open(file, "rb") as f:
        f.seek(8 + int.from_bytes(f.read(8), "little") + begin)
        data = f.read(end - begin)
    return np.frombuffer(data, dtype).reshape(entry["shape"])


def _param_paths(state) -> list[tuple[tuple[str, ...], jax.ShapeDtypeStruct]]:
    pure = nnx.to_pure_dict(state)
    return [
        (tuple(getattr(k, "key", getattr(k, "idx", k)) for k in keys), leaf)
        for keys, leaf in jax.tree_util.tree_leaves_with_path(pure)
    ]


def _fill(abstract_model, read: Callable, mesh: Mesh | None, source: str):
    """Replace every abstract parameter by its tensor: `read(path, numpy dtype)` -> (tensor in our
    layout, its checkpoint name), `path` as a model without scanned layers names it (a stacked
    parameter is read layer by layer into its slots). Returns (model, the names read)."""
    graphdef, state = nnx.split(abstract_model)
    checkpoint_paths = getattr(abstract_model, "checkpoint_paths", lambda path: [path])
    loaded, names = {}, set()

    def tensor_at(layer_path: tuple, shape: tuple, dtype) -> np.ndarray:
        tensor, name = _read(read, layer_path, _NUMPY_DTYPES[jnp.dtype(dtype)], shape, source)
        names.add(name)
        return tensor

    for path, leaf in _param_paths(state):
        sharding = param_sharding(mesh, path, leaf.shape) if mesh is not None else None
        if is_stacked(path):
            loaded[path] = _stacked_layers(checkpoint_paths(path), leaf, sharding, tensor_at)
        else:
            (layer_path,) = checkpoint_paths(path)
            loaded[path] = jax.device_put(tensor_at(layer_path, leaf.shape, leaf.dtype), sharding)
    pure = nnx.to_pure_dict(state)
    pure = _set_leaves(pure, loaded)
    nnx.replace_by_pure_dict(state, pure)
    return nnx.merge(graphdef, state), names


def _read(read: Callable, path: tuple, dtype, shape: tuple, source: str) -> tuple[np.ndarray, str]:
    """The tensor of the parameter at `path` (of `shape`) in `dtype`, contiguous, and its name."""
    try:
        tensor, name = read(path, dtype)
    except KeyError as e:  # the hub names of each layout the checkpoint could hold it in
        first, *others = e.args[0] if isinstance(e.args[0], tuple) else e.args
        alternatives = f" (nor {', '.join(map(repr, others))})" if others else ""
        raise ModelError(f"{source}: missing tensor {first!r}{alternatives}") from None
    if tuple(tensor.shape) != tuple(shape):
        raise ModelError(
            f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(shape)} (Linear kernels compared as [in, out])"
        )
    return np.ascontiguousarray(tensor.astype(dtype)), name


def _stacked_layers(layer_paths: list[tuple], leaf, sharding, tensor_at: Callable) -> jax.Array:
    """A stacked parameter [layers, ...] filled slot by slot on its devices: the host holds one
    layer's tensor at a time, the devices the stack and one layer's slice."""
    stack = jax.jit(lambda: jnp.zeros(leaf.shape, leaf.dtype), out_shardings=sharding)()
    slot_sharding = None if sharding is None else NamedSharding(sharding.mesh, PartitionSpec(*sharding.spec[1:]))
    for slot, layer_path in enumerate(layer_paths):
        layer = jax.device_put(tensor_at(layer_path, leaf.shape[1:], leaf.dtype), slot_sharding)
        stack = _write_slot(stack, layer, slot)
    return stack


@functools.partial(jax.jit, donate_argnums=0)
def _write_slot(stack: jax.Array, value: jax.Array, slot) -> jax.Array:
    return stack.at[slot].set(value)


def _load(model_class, cfg, model_kw: dict, weights: WeightMap, reader, mesh: Mesh | None, source: str):
    """`model_class(cfg, **model_kw)`, built on shapes, every parameter then read from `reader`
    through `weights` -> (model, the tensor names read)."""
    abstract = nnx.eval_shape(lambda: model_class(cfg, rngs=nnx.Rngs(0), **model_kw))
    return _fill(abstract, lambda p, dtype: weights.read(reader, p, cfg, dtype), mesh, source)


def _set_leaves(tree: dict, values: dict[tuple, jax.Array], prefix: tuple = ()) -> dict:
    return {
        k: _set_leaves(v, values, prefix + (k,)) if isinstance(v, dict) else values[prefix + (k,)]
        for k, v in tree.items()
    }


def load_target(
    path: str | os.PathLike,
    *,
    param_dtype=jnp.bfloat16,
    compute_dtype=jnp.bfloat16,
    mesh: Mesh | None = None,
    attention: str = "auto",
    scan_layers: bool = False,
) -> Transformer:
    """Load a Hugging Face checkpoint directory, or a GGUF file (models/formats/gguf.py), into a
    `Transformer` (`attention`: its packed forward's attention code; `scan_layers`: its repeating
    layers run under a scan, their weights stacked as they load: training's layout; decoding
    runs layers one by one, in the layout they load in without it)."""
    if gguf_file := gguf_source(path):
        path = model_dir(gguf_file)
    hf = read_config(path)
    cfg, weights = families.target_config(hf), families.weight_map(hf)
    reader = GgufTensors(gguf_file) if (gguf_file := weights_file(path)) else SafetensorsReader(path)
    kw = dict(param_dtype=param_dtype, compute_dtype=compute_dtype, attention=attention, scan_layers=scan_layers)
    model, _ = _load(Transformer, cfg, kw, weights, reader, mesh, source=str(path))
    return model


def load_drafter(
    path: str | os.PathLike,
    *,
    param_dtype=jnp.float32,
    compute_dtype=jnp.float32,
    mesh: Mesh | None = None,
    attention: str = "auto",
) -> DFlashDrafter:
    """Load a drafter in the export format of docs/design.md §5 (ours, or a released one)."""
    cfg = read_drafter_config(path)
    reader = SafetensorsReader(path)
    kw = dict(param_dtype=param_dtype, compute_dtype=compute_dtype, attention=attention)
    model, used = _load(DFlashDrafter, cfg, kw, WeightMap(prefix=""), reader, mesh, source=str(path))
    extra = sorted(reader.names() - used)
    if extra:  # released drafters sometimes ship unused tensors; they are not ours to train
        log.warning("%s: ignoring %d tensors the drafter does not use: %s", path, len(extra), extra[:5])
    return model


def export_drafter(
    drafter: DFlashDrafter, out_dir: str | os.PathLike, *, dtype=jnp.bfloat16, extra_files: Sequence[str] = ()
) -> Path:
    """Write config.json + model.safetensors in the format of docs/design.md §5, atomically, with
    copies of `extra_files` (those that exist) beside them."""
    out_dir = Path(out_dir)
    if problem := replace_problem(out_dir):
        raise ModelError(f"{problem}: name a new or empty directory")
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    for path in extra_files:
        if os.path.isfile(path):
            shutil.copyfile(path, tmp / os.path.basename(path))
    _, state = nnx.split(drafter)
    tensors = {}
    for path, value in _param_paths(state):
        name, transposed = checkpoint_name(path)
        array = np.asarray(jax.device_get(value)).astype(_NUMPY_DTYPES[jnp.dtype(dtype)])
        tensors[name] = np.ascontiguousarray(array.T if transposed else array)
    save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(drafter.cfg.to_hf(), indent=2) + "\n")
    _replace_dir(tmp, out_dir)
    return out_dir


def replace_problem(out_dir: str | os.PathLike) -> str | None:
    """Why an export may not replace `out_dir` whole (None: it may): the directory holds files and
    is no drafter export (a model, someone's files), which the export would delete."""
    out_dir = Path(out_dir)
    held = sorted(p.name for p in out_dir.iterdir()) if out_dir.is_dir() else []
    if not held:
        return None
    try:
        architectures = read_config(out_dir).get("architectures")
    except (FileNotFoundError, ModelError):
        architectures = None
    if isinstance(architectures, list) and any(a in kinds.ARCHITECTURES for a in architectures if isinstance(a, str)):
        return None
    return f"{out_dir} holds {some_of(held)} and is no drafter export, which an export would replace whole"


def _replace_dir(src: Path, dst: Path) -> None:
    """Swap `src` into place at `dst` so readers never see a half-written export."""
    if dst.exists():
        old = dst.with_name(dst.name + ".old")
        if old.exists():
            shutil.rmtree(old)
        dst.rename(old)
        src.rename(dst)
        shutil.rmtree(old)
    else:
        src.rename(dst)
