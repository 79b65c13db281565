"""A drafter export as the GGUF file llama.cpp serves (`llama-server --spec-type`, the kind's).

    write_drafter_gguf(export_dir, target_gguf, out_file)

reads our export directory (config.json + model.safetensors, docs/design.md §5) and writes what
llama.cpp's own converter (`convert_hf_to_gguf.py`, its drafter classes of
`conversion/qwen.py`, build b11434) writes for it, with the `gguf` package: architecture
`dflash`, the Qwen3 decoder hyper-parameters, the keys its loader and `common/speculative.cpp`
read (`dflash.block_size`, `dflash.target_layers`, `dflash.sample_from_anchor` for a kind whose
every slot drafts, the mask token, and the kind's own: `Kind.llama_cpp`) and the tensors under
its names. The drafter's vocabulary is copied from the target GGUF the engine
serves (llama.cpp checks that draft and target vocabularies agree); the drafter borrows the
target's embeddings and LM head at run time, so the file holds neither. With a draft vocabulary
(`draft_token_ids`, the tokens our `--draft_vocab` drafts among), the file holds its own LM head,
the target head's rows of those tokens, and `d2t`, their target ids: llama.cpp's reduced-vocabulary
drafting, which scatters the draft logits back to the target's vocabulary as our decoder does.

Which target features llama.cpp gives the drafter: its Llama and Qwen3 graphs record the residual
stream *entering* each layer (`res->t_layer_inp[il] = inpL`), and the drafter asks for the
entries `dflash.target_layers` = our id + 1. So our id i (layer i's raw output, what training
reads) is served for i < L - 1; the last layer's output is never recorded (llama.cpp aborts).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from dflash_jax.errors import ModelError, UserError
from dflash_jax.models import drafter_format, kinds
from dflash_jax.models.formats.gguf import copy_field, write_file
from dflash_jax.models.kind import Kind

ARCH = "dflash"


# The backbone's tensor names -> llama.cpp's (gguf-py tensor_mapping.py, after the converter's
# 'model.' prefix); a kind's own are its `Kind.llama_cpp`'s.
GLOBAL_TENSORS = {
    "fc.weight": "fc.weight",
    "hidden_norm.weight": "enc.output_norm.weight",
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",  # only with a draft vocabulary: the target's head rows of its tokens
}
HEAD = "lm_head.weight"
LAYER_TENSORS = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def served_kind(hf: dict[str, Any]) -> Kind:
    """The kind of an export's config.json, which llama.cpp serves (its `Kind.llama_cpp`)."""
    kind = drafter_format.kind_of(hf)
    if kind.llama_cpp is None:
        served = ", ".join(k.name for k in kinds.KINDS.values() if k.llama_cpp)
        raise UserError(f"llama.cpp b11434 serves {served} drafters, not drafter kind {kind.name!r}")
    return kind


def gguf_name(name: str, kind: Kind) -> str:
    """llama.cpp's name of one of our export's tensors."""
    own = {**GLOBAL_TENSORS, **kind.llama_cpp.tensors}
    if name in own:
        return own[name]
    layer = {**LAYER_TENSORS, **kind.llama_cpp.layer_tensors}
    parts = name.split(".", 2)
    if parts[0] == "layers" and len(parts) == 3 and parts[2] in layer:
        return f"blk.{parts[1]}.{layer[parts[2]]}"
    raise UserError(f"tensor {name!r} of the export has no llama.cpp counterpart")


def llama_cpp_problems(hf: dict[str, Any], num_target_layers: int) -> list[str]:
    """Why llama.cpp (b11434) cannot serve the drafter of config.json `hf` on a target of
    `num_target_layers` layers; empty when it can."""
    try:
        kind = served_kind(hf)
    except (UserError, ModelError) as e:
        return [str(e)]
    found = list(kind.llama_cpp.problems(hf))
    ids = [int(i) for i in hf["dflash_config"]["target_layer_ids"]]
    if last := [i for i in ids if not 0 <= i < num_target_layers - 1]:
        found.append(
            f"target_layer_ids {ids} read {last}: llama.cpp, SGLang and vLLM give a drafter the outputs of "
            f"layers 0..{num_target_layers - 2} only (the inputs of the layers after them)"
        )
    if (rope_type := (hf.get("rope_scaling") or {}).get("rope_type")) not in (None, "default", "llama3", "yarn"):
        found.append(f"RoPE scaling {rope_type!r} is not written to GGUF yet")
    return found


def write_drafter_gguf(
    export_dir: str | os.PathLike,
    target_gguf: str | os.PathLike,
    out_file: str | os.PathLike,
    draft_token_ids: np.ndarray | None = None,
) -> Path:
    """The GGUF of the drafter exported at `export_dir`, for the target `target_gguf`, drafting
    among `draft_token_ids` [V'] (target ids) if given, else the whole vocabulary."""
    import gguf  # imported where used: 0.4 s that other commands need not pay
    from safetensors.numpy import load_file

    export_dir, out_file = Path(export_dir), Path(out_file)
    hf = json.loads((export_dir / "config.json").read_text())
    kind = served_kind(hf)
    target = _target_metadata(target_gguf)
    if problems := llama_cpp_problems(hf, int(target[f"{target['general.architecture']}.block_count"])):
        raise UserError(f"{export_dir}: llama.cpp cannot serve this drafter: {'; '.join(problems)}")
    ids = [int(i) for i in hf["dflash_config"]["target_layer_ids"]]

    writer = gguf.GGUFWriter(str(out_file), ARCH)
    writer.add_name(export_dir.resolve().name)
    writer.add_block_count(int(hf["num_hidden_layers"]))
    writer.add_context_length(int(hf["max_position_embeddings"]))
    writer.add_embedding_length(int(hf["hidden_size"]))
    writer.add_feed_forward_length(int(hf["intermediate_size"]))
    writer.add_head_count(int(hf["num_attention_heads"]))
    writer.add_head_count_kv(int(hf["num_key_value_heads"]))
    writer.add_key_length(int(hf["head_dim"]))
    writer.add_value_length(int(hf["head_dim"]))
    writer.add_rope_freq_base(float(hf["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(hf["rms_norm_eps"]))
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_uint32(f"{ARCH}.block_size", int(hf["block_size"]))
    writer.add_array(f"{ARCH}.target_layers", [i + 1 for i in ids])  # layer inputs: our id + 1
    if hf.get("is_causal") is not None:
        writer.add_bool(f"{ARCH}.attention.causal", bool(hf["is_causal"]))
    if kind.first_draft_slot == 0:  # every slot drafts, the anchor's too
        writer.add_bool(f"{ARCH}.sample_from_anchor", True)
    for key, value in kind.llama_cpp.metadata(hf).items():
        {bool: writer.add_bool, int: writer.add_uint32, float: writer.add_float32}[type(value)](key, value)
    _copy_vocabulary(writer, target_gguf)
    writer.add_uint32(gguf.Keys.Tokenizer.MASK_ID, int(hf["dflash_config"]["mask_token_id"]))
    _add_rope_scaling(writer, hf)
    if hf.get("use_sliding_window") and hf.get("sliding_window"):  # as the converter writes them
        writer.add_sliding_window(int(hf["sliding_window"]))
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in hf["layer_types"]])
    # float32: the bfloat16 export widens exactly, and the drafter is small beside the target.
    weights = load_file(str(export_dir / "model.safetensors"))
    if draft_token_ids is not None:
        weights = _draft_vocabulary_weights(weights, kind, target_gguf, np.asarray(draft_token_ids, np.int64))
        writer.add_tensor("d2t", np.asarray(draft_token_ids, np.int64))
    for name, array in sorted(weights.items()):
        writer.add_tensor(gguf_name(name, kind), np.ascontiguousarray(array, dtype=np.float32))
    return write_file(writer, out_file)


def _draft_vocabulary_weights(weights: dict, kind: Kind, target_gguf: str | os.PathLike, token_ids: np.ndarray) -> dict:
    """`weights` with an LM head of the draft tokens only (the target's head rows, or its tied
    embedding's) and the kind's own projections onto the vocabulary cut to the same tokens, which
    llama.cpp sizes by the draft vocabulary."""
    from gguf import GGUFReader, dequantize

    tensors = {t.name: t for t in GGUFReader(target_gguf).tensors}
    head = tensors.get("output.weight") or tensors["token_embd.weight"]
    if token_ids.size == 0 or token_ids.min() < 0 or token_ids.max() >= head.data.shape[0]:
        raise UserError(f"draft token ids must lie in the target's vocabulary of {head.data.shape[0]}")
    out = dict(weights)
    out[HEAD] = dequantize(head.data[token_ids], head.tensor_type)  # rows are whole quantization blocks
    for name in kind.llama_cpp.vocab_rows:
        out[name] = out[name][token_ids]
    return out


def _add_rope_scaling(writer, hf: dict[str, Any]) -> None:
    """RoPE scaling as the converter writes it: YaRN's keys, Llama 3's frequency divisors."""
    import gguf

    r = hf.get("rope_scaling") or {}
    if r.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(r["factor"]))
        writer.add_rope_scaling_orig_ctx_len(int(r["original_max_position_embeddings"]))
        if r.get("attention_factor") is not None:
            writer.add_rope_scaling_yarn_attn_factor(float(r["attention_factor"]))
        writer.add_rope_scaling_yarn_beta_fast(float(r["beta_fast"]))
        writer.add_rope_scaling_yarn_beta_slow(float(r["beta_slow"]))
    elif r.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(hf))


def llama3_rope_factors(hf: dict[str, Any]) -> np.ndarray:
    """Llama 3's RoPE scaling as llama.cpp applies it: a divisor of each frequency (the
    `rope_freqs` tensor of the converter's LlamaModel)."""
    r, dim = hf["rope_scaling"], int(hf["head_dim"])
    freqs = 1.0 / float(hf["rope_theta"]) ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    wavelen = 2 * np.pi / freqs
    old, low, high = (
        float(r["original_max_position_embeddings"]),
        float(r["low_freq_factor"]),
        float(r["high_freq_factor"]),
    )
    smooth = (old / wavelen - low) / (high - low)
    factors = np.where(wavelen < old / high, 1.0, np.where(wavelen > old / low, r["factor"], 0.0))
    between = (wavelen >= old / high) & (wavelen <= old / low)
    factors[between] = 1 / ((1 - smooth[between]) / r["factor"] + smooth[between])
    return factors.astype(np.float32)


def _target_metadata(path: str | os.PathLike) -> dict[str, Any]:
    from gguf import GGUFReader

    try:
        return {name: field.contents() for name, field in GGUFReader(path).fields.items()}
    except (ValueError, IndexError, OSError) as e:
        raise UserError(f"{path}: not a readable GGUF target ({e})") from None


def _copy_vocabulary(writer, target_gguf: str | os.PathLike) -> None:
    """The target's `tokenizer.*` metadata, with its value types, as the converter's
    `--target-model-dir` gives it (llama.cpp compares the two vocabularies token by token)."""
    from gguf import GGUFReader

    for name, field in GGUFReader(target_gguf).fields.items():
        if name.startswith("tokenizer.") and name != "tokenizer.ggml.mask_token_id":
            copy_field(writer, name, field)
