"""The tokenizer a GGUF file describes, as the Hugging Face files transformers would read.

A GGUF holds no tokenizer.json: llama.cpp stores the vocabulary, merges, token types, special
token ids and chat template as metadata (`tokenizer.ggml.*`, `tokenizer.chat_template`). This
builds from them the same tokenizer transformers builds when it loads the file
(`AutoTokenizer.from_pretrained(dir, gguf_file=...)`, which needs torch): for a byte-level BPE
vocabulary (`tokenizer.ggml.model` 'gpt2', as SmolLM2's, Llama 3's and Qwen's), a BPE model over
the vocabulary in GPT-2's byte alphabet, the text split as the vocabulary's merges were learned
(`tokenizer.ggml.pre`), the tokens the file marks CONTROL added as special tokens and those it
marks USER_DEFINED as plain added tokens, and bos/eos/unk/pad and add_bos/add_eos from the
metadata. Other tokenizer kinds (sentencepiece 'llama', 't5', ...) are a one-line error.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from dflash_jax.errors import ModelError

# gguf.constants.TokenType
CONTROL, USER_DEFINED = 3, 4

# How the text is split before BPE, per `tokenizer.ggml.pre`: None is GPT-2's own split (the
# ByteLevel pre-tokenizer's regex), which is also what transformers uses for SmolLM2's 'smollm'
# (llama.cpp adds a split before every digit there; the SmolLM2 vocabulary has no merge with a
# digit, so both give the same ids). Otherwise the split regex of the vocabulary's tokenizer.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS: dict[str | None, str | None] = {
    None: None,
    "default": None,
    "gpt2": None,
    "gpt-2": None,  # llama.cpp's name for it (convert_hf_to_gguf.py)
    "smollm": None,
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
}


def tokenizer_files(metadata: Mapping[str, Any]) -> dict[str, str]:
    """tokenizer.json, tokenizer_config.json and (if the file has one) chat_template.jinja."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelError(f"GGUF tokenizer {kind!r} is not supported (supported: 'gpt2', byte-level BPE)")
    pre = metadata.get("tokenizer.ggml.pre")
    if pre not in PRE_TOKENIZER_SPLITS:
        known = ", ".join(sorted(p for p in PRE_TOKENIZER_SPLITS if p))
        raise ModelError(f"GGUF tokenizer pre-tokenizer {pre!r} is not supported (supported: {known})")
    tokens = list(metadata["tokenizer.ggml.tokens"])
    types = list(metadata.get("tokenizer.ggml.token_type") or [])
    tokenizer = _tokenizer(tokens, types, metadata.get("tokenizer.ggml.merges") or [], pre)
    tokenizer.post_processor = _post_processor(metadata, tokens)
    files = {
        "tokenizer.json": tokenizer.to_str(),
        "tokenizer_config.json": json.dumps(_tokenizer_config(metadata, tokens), indent=2) + "\n",
    }
    template = metadata.get("tokenizer.chat_template")
    if template:
        files["chat_template.jinja"] = template
    return files


def _tokenizer(tokens: list[str], types: list[int], merges: list[str], pre: str | None) -> Tokenizer:
    spelling = _byte_spelling()
    alphabet = set(spelling.values())
    # Tokens stored as raw text (some converters write a space or newline as itself) are spelled
    # in the byte alphabet, as the merges are.
    vocab = {
        token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8")): i
        for i, token in enumerate(tokens)
    }
    tokenizer = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=[tuple(merge.split(" ")) for merge in merges],
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    split = PRE_TOKENIZER_SPLITS[pre]
    if split is None:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tokenizer.decoder = decoders.ByteLevel()
    # A CONTROL token outside the byte alphabet is a mislabelled vocabulary entry: left out, as
    # transformers leaves it out (adding it would grow the vocabulary past the embedding).
    tokenizer.add_special_tokens(
        [
            AddedToken(token, normalized=False, special=True)
            for token, kind in zip(tokens, types)
            if kind == CONTROL and set(token) <= alphabet
        ]
    )
    tokenizer.add_tokens(
        [
            AddedToken(token, normalized=False, special=False)
            for token, kind in zip(tokens, types)
            if kind == USER_DEFINED and token in vocab
        ]
    )
    return tokenizer


def _post_processor(metadata: Mapping[str, Any], tokens: list[str]) -> processors.TemplateProcessing:
    """The bos / eos tokens `tokenizer.ggml.add_bos_token` / `add_eos_token` put around a text
    (and around each text of a pair, the second with type id 1)."""
    around = {}
    for name in ("bos", "eos"):
        token_id = metadata.get(f"tokenizer.ggml.{name}_token_id")
        if metadata.get(f"tokenizer.ggml.add_{name}_token") and token_id is not None:
            around[name] = (tokens[token_id], token_id)

    def template(part: str, type_id: int) -> str:
        bos, eos = (f"{around[n][0]}:{type_id}" if n in around else "" for n in ("bos", "eos"))
        return " ".join(filter(None, (bos, f"${part}:{type_id}", eos)))

    return processors.TemplateProcessing(
        single=template("A", 0),
        pair=f"{template('A', 0)} {template('B', 1)}",
        special_tokens=list(around.values()),
    )


def _tokenizer_config(metadata: Mapping[str, Any], tokens: list[str]) -> dict[str, Any]:
    config: dict[str, Any] = {"tokenizer_class": "TokenizersBackend"}
    for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        token_id = metadata.get(f"tokenizer.ggml.{key}_token_id")
        config[f"{name}_token"] = tokens[token_id] if token_id is not None else None
    for flag in ("add_bos_token", "add_eos_token"):
        if f"tokenizer.ggml.{flag}" in metadata:
            config[flag] = bool(metadata[f"tokenizer.ggml.{flag}"])
    return config


def _byte_spelling() -> dict[int, str]:
    """GPT-2's byte -> character table: printable bytes stand for themselves, the others take
    the characters from 256 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelling = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in spelling:
            spelling[b] = chr(256 + extra)
            extra += 1
    return spelling
