"""Tiny llama GGUF files written with the `gguf` package as llama.cpp's converter writes them.

The reference behaviour transcribed here (llama.cpp `convert_hf_to_gguf.py`, LlamaModel): tensors
under GGUF names (`token_embd`, `blk.N.attn_q`, ...), no `output` tensor when the embeddings are
tied, the rows of every q/k head permuted so that the two halves RoPE rotates together are
interleaved, the hyper-parameters under `llama.*`, and a byte-level BPE tokenizer as
`tokenizer.ggml.*` metadata with its chat template. The vocabulary opens with SmolLM2's 17
control tokens (ids 0-16, `<|im_end|>` = 2), so the smollm2 recipe runs on these files.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

SMOLLM2_CONTROL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<repo_name>",
    "<reponame>",
    "<file_sep>",
    "<filename>",
    "<gh_stars>",
    "<issue_start>",
    "<issue_comment>",
    "<issue_closed>",
    "<jupyter_start>",
    "<jupyter_text>",
    "<jupyter_code>",
    "<jupyter_output>",
    "<jupyter_script>",
    "<empty_output>",
)
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# What the tiny BPE vocabulary is learned from: prose, code and numbers, as the tests encode.
CORPUS = (
    "The quick brown fox jumps over the lazy dog. def add(a, b):\n    return a + b\n",
    "Write a function that returns the sum of two numbers 12 and 345, then print(result).",
    "import os\nfor name in os.listdir('.'):\n    if name.endswith('.py'):\n        print(name)\n",
    "Hello world! How are you today? I'm fine, thanks; we'll see what they've done.",
)
SIZES = dict(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, head_dim=16, context=512)


def train_vocabulary(vocab_size: int = 400) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of a byte-level BPE learned from CORPUS, the control tokens first."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SMOLLM2_CONTROL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS * 20, trainer)
    vocab = tokenizer.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    merges = [" ".join(pair) for pair in json.loads(tokenizer.to_str())["model"]["merges"]]
    types = [3 if t in SMOLLM2_CONTROL_TOKENS else 1 for t in tokens]
    return tokens, types, merges


def interleave_qk(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's permute of q/k rows: per head, rows r and r + D/2 become neighbours."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_tiny_gguf(
    path: str | os.PathLike,
    *,
    seed: int = 0,
    weight_type: str = "Q4_1",
    embedding_type: str = "Q8_0",
    tie_word_embeddings: bool = True,
    pre: str = "smollm",
    add_bos_token: bool = False,
    architecture: str = "llama",
    extra_tensors: dict[str, tuple[np.ndarray, str]] | None = None,
    **sizes: int,
) -> Path:
    """A tiny random llama (SIZES, or `sizes` instead) in GGUF, its matrices stored as
    `weight_type`, the embedding as `embedding_type`, norms as F32. `extra_tensors`: name -> (raw
    data, GGML type name)."""
    import gguf

    s = {**SIZES, **sizes}
    rng = np.random.default_rng(seed)
    tokens, types, merges = train_vocabulary()
    vocab = len(tokens)

    def normal(*shape, scale=0.15):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name("tiny test llama")
    writer.add_block_count(s["layers"])
    writer.add_context_length(s["context"])
    writer.add_embedding_length(s["hidden"])
    writer.add_feed_forward_length(s["intermediate"])
    writer.add_head_count(s["heads"])
    writer.add_head_count_kv(s["kv_heads"])
    writer.add_rope_freq_base(100000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_rope_dimension_count(s["head_dim"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(add_bos_token)
    writer.add_chat_template(SMOLLM2_TEMPLATE)

    def add(name, values, kind):
        qtype = gguf.GGMLQuantizationType[kind]
        writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)

    h, hd = s["hidden"], s["head_dim"]
    add("token_embd.weight", normal(vocab, h, scale=0.5), embedding_type)
    add("output_norm.weight", 1 + normal(h), "F32")
    if not tie_word_embeddings:
        add("output.weight", normal(vocab, h, scale=0.5), weight_type)
    for i in range(s["layers"]):
        add(f"blk.{i}.attn_norm.weight", 1 + normal(h), "F32")
        add(f"blk.{i}.ffn_norm.weight", 1 + normal(h), "F32")
        add(f"blk.{i}.attn_q.weight", interleave_qk(normal(s["heads"] * hd, h), s["heads"]), weight_type)
        add(f"blk.{i}.attn_k.weight", interleave_qk(normal(s["kv_heads"] * hd, h), s["kv_heads"]), weight_type)
        add(f"blk.{i}.attn_v.weight", normal(s["kv_heads"] * hd, h), weight_type)
        add(f"blk.{i}.attn_output.weight", normal(h, s["heads"] * hd), weight_type)
        add(f"blk.{i}.ffn_gate.weight", normal(s["intermediate"], h), weight_type)
        add(f"blk.{i}.ffn_up.weight", normal(s["intermediate"], h), weight_type)
        add(f"blk.{i}.ffn_down.weight", normal(h, s["intermediate"]), weight_type)
    for name, (data, kind) in (extra_tensors or {}).items():
        writer.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)
