"""A Hugging Face Qwen3 or Llama target as the GGUF file llama.cpp serves, for targets llama.cpp's
own converter refuses: it hashes the tokenizer's pre-tokenizer against a list of published ones,
so a tokenizer trained here (the bundled tiny-qwen3's) is 'not recognized'.

    served_gguf(model_dir, out_file)    a GGUF target's own file, else write_target_gguf's
    write_target_gguf(model_dir, out_file)
    widened_gguf(gguf_file, out_file)   a quantized GGUF with every tensor dequantized to float32

writes what `convert_hf_to_gguf.py` (Qwen3Model, LlamaModel, build b11434) writes for a dense
model with a byte-level BPE tokenizer: the architecture its family names (`Family.gguf`: `qwen3`,
`llama`), its hyper-parameters, the tensors in float32 under llama.cpp's names (a Llama's q/k rows
interleaved per head for llama.cpp's RoPE, as the converter does; Qwen3 is a NeoX-RoPE model), and
the vocabulary as `tokenizer.ggml.*` (`gpt2` model; `pre` named from the tokenizer's split:
GPT-2's own regex, or Qwen2's / Llama 3's, models/formats/gguf_tokenizer.py), with the chat template and
special tokens.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from dflash_jax.errors import UserError
from dflash_jax.models import families
from dflash_jax.models.formats.gguf import (
    LAYER_TENSORS,
    check_gguf,
    copy_field,
    interleave_qk,
    layer_module,
    qk_heads,
    weights_file,
    write_file,
)
from dflash_jax.models.formats.gguf_tokenizer import CONTROL, PRE_TOKENIZER_SPLITS, USER_DEFINED
from dflash_jax.models.formats.hf import safetensors_header

NORMAL = 1  # gguf.constants.TokenType
# Hugging Face architecture -> (GGUF architecture, how llama.cpp reads it), from the families.
WRITTEN = {arch.hf_architecture: (name, arch) for name, arch in families.GGUF_ARCHITECTURES.items()}
# The metadata key a widened file keeps its source in (`widened_gguf`).
WIDENED_FROM = "dflash_jax.widened_from"


def served_gguf(model_dir: str | os.PathLike, out_file: str | os.PathLike) -> Path:
    """The GGUF file llama.cpp serves for a resolved target directory: a GGUF target's own file,
    else the Hugging Face one written to `out_file`."""
    return weights_file(model_dir) or write_target_gguf(model_dir, out_file)


def widened_gguf(gguf_file: str | os.PathLike, out_file: str | os.PathLike) -> Path:
    """`gguf_file` with every tensor dequantized to float32 and its metadata as it is: the weights
    our decoder runs from a quantized GGUF target (it dequantizes at load), served without the
    engine's quantized kernels (which also round the activations to 8 bits). An `out_file`
    already widened from the same file (its path, size and modification time, kept in its
    metadata) is reused: SmolLM2's is 540 MB."""
    import gguf

    source = Path(gguf_file).resolve()
    stat = source.stat()
    key, out_file = f"{source}:{stat.st_size}:{stat.st_mtime_ns}", Path(out_file)
    if out_file.is_file() and _field(out_file, WIDENED_FROM) == key:
        return out_file
    check_gguf(source)
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(str(out_file), reader.fields["general.architecture"].contents())
    writer.add_string(WIDENED_FROM, key)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", WIDENED_FROM):  # the writer's own
            continue
        if name == "general.file_type":
            writer.add_file_type(gguf.LlamaFileType.ALL_F32)
            continue
        copy_field(writer, name, field)
    for tensor in reader.tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dimensions innermost first
        writer.add_tensor(tensor.name, np.ascontiguousarray(values, dtype=np.float32).reshape(shape))
    return write_file(writer, out_file)


def _field(gguf_file: Path, name: str):
    """One metadata field of a GGUF file (None if absent or unreadable)."""
    import gguf

    try:
        field = gguf.GGUFReader(gguf_file).fields.get(name)
    except (ValueError, IndexError, OSError):
        return None
    return None if field is None else field.contents()


def write_target_gguf(model_dir: str | os.PathLike, out_file: str | os.PathLike) -> Path:
    import gguf
    from safetensors.numpy import load_file

    model_dir, out_file = Path(model_dir), Path(out_file)
    cfg = json.loads((model_dir / "config.json").read_text())
    hf_arch = (cfg.get("architectures") or [None])[0]
    if hf_arch not in WRITTEN:
        raise UserError(
            f"{model_dir}: {hf_arch} targets are not written to GGUF here (only {', '.join(WRITTEN)}): "
            "convert it with llama.cpp's convert_hf_to_gguf.py"
        )
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise UserError(
            f"{model_dir}: RoPE scaling ({rope.get('rope_type', rope.get('type'))}) is not written to GGUF here"
        )
    name, arch = WRITTEN[hf_arch]
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    writer = gguf.GGUFWriter(str(out_file), name)
    writer.add_name(model_dir.resolve().name)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(cfg.get("rope_theta") or rope["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    _add_vocabulary(writer, model_dir, cfg)

    weights = {}
    for part in sorted(model_dir.glob("*.safetensors")):
        safetensors_header(part)  # a damaged file: one line naming it
        weights.update(load_file(str(part)))
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if not cfg.get("tie_word_embeddings"):
        names["lm_head.weight"] = "output.weight"
    for i in range(cfg["num_hidden_layers"]):
        names |= {
            f"model.layers.{i}.{ours}.weight": f"blk.{i}.{theirs}.weight" for theirs, ours in LAYER_TENSORS.items()
        }
    interleaved = qk_heads(cfg) if arch.interleaved_qk else {}
    for hf_name, gguf_name in names.items():
        module = layer_module(hf_name)
        if module in ("self_attn.q_norm", "self_attn.k_norm") and hf_name not in weights:
            continue  # a family without q/k norms (Llama)
        weight = np.asarray(weights[hf_name], dtype=np.float32)
        if module in interleaved:
            weight = interleave_qk(weight, interleaved[module])
        writer.add_tensor(gguf_name, np.ascontiguousarray(weight))
    return write_file(writer, out_file)


def _add_vocabulary(writer, model_dir: Path, cfg: dict) -> None:
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    settings = json.loads((model_dir / "tokenizer_config.json").read_text())
    model = tokenizer["model"]
    if model["type"] != "BPE" or not _is_byte_level(tokenizer):
        raise UserError(f"{model_dir}: only byte-level BPE tokenizers are written to GGUF here")
    added = {t["id"]: t for t in tokenizer.get("added_tokens", [])}
    size = max(cfg["vocab_size"], *(i + 1 for i in model["vocab"].values()), *(i + 1 for i in added))
    tokens = [f"[PAD{i}]" for i in range(size)]  # rows no token uses, as the converter pads them
    types = [USER_DEFINED] * size
    for text, i in model["vocab"].items():
        tokens[i], types[i] = text, NORMAL
    for i, t in added.items():
        tokens[i], types[i] = t["content"], CONTROL if t.get("special") else USER_DEFINED
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(_pre(tokenizer))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in model["merges"]])
    ids = {t["content"]: i for i, t in added.items()}
    for key, add in (("bos_token", writer.add_bos_token_id), ("eos_token", writer.add_eos_token_id)):
        if settings.get(key) in ids:
            add(ids[settings[key]])
    if settings.get("pad_token") in ids:
        writer.add_pad_token_id(ids[settings["pad_token"]])
    writer.add_add_bos_token(False)  # the chat template writes every special token itself
    if template := settings.get("chat_template"):
        writer.add_chat_template(template)


def _is_byte_level(tokenizer: dict) -> bool:
    return "ByteLevel" in json.dumps(tokenizer.get("pre_tokenizer"))


def _pre(tokenizer: dict) -> str:
    """llama.cpp's name for the tokenizer's split (`tokenizer.ggml.pre`)."""
    pre = tokenizer["pre_tokenizer"]
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"
    text = json.dumps(pre)
    for name in ("qwen2", "llama-bpe"):
        if json.dumps(PRE_TOKENIZER_SPLITS[name])[1:-1] in text:
            return name
    raise UserError("the tokenizer's pre-tokenizer split is not one llama.cpp names (gpt-2, qwen2, llama-bpe)")
