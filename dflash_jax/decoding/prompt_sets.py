"""Prompt sets for decoding, rendered with the target's own chat template as a serving engine would.

A prompt set is named by a spec (`resolve_prompt_set`):

    heldout_prompts, stdlib_heldout       bundled chat JSONL sets (assets/data/<name>.jsonl)
    path/to/prompts.jsonl                 chat JSONL rows; the set is named by the file stem
    gsm8k, math500, humaneval, mbpp,      standard benchmarks from the Hugging Face hub cache,
    mt-bench                              in their published formats (data/benchmarks.py)
    gsm8k=path/to/test.parquet            a local copy of a benchmark, in its published format

or is the held-out split of the training data (`HeldoutPrompts`, named `heldout:<N> of
<data.train>`). Chat rows are OpenAI `messages` (role/content) or ShareGPT `conversations`
(from/value); a row's prompt is its conversation without trailing assistant turns. A multi-turn
benchmark row (mt-bench) is several user turns, each asked after the target's own answer to the
ones before.

Prompt files are read as the training data is (`dflash_jax.data`): a UTF-8 byte-order mark is
ignored, a file in another encoding or that is not JSON Lines is refused, and a row that cannot
be a prompt (not UTF-8, not JSON, not a conversation, holding the text of a control token such
as <|im_end|>) stops loading with one line naming `file:line`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jinja2
import numpy as np

from dflash_jax.bundled import ASSETS
from dflash_jax.data.benchmarks import BENCHMARKS, read_benchmark
from dflash_jax.data.build import ensure_cache
from dflash_jax.data.formats import (
    UTF8_BOM,
    BadSample,
    chat_messages,
    control_token_pattern,
    decode_json_line,
    find_control_text,
    split_think_block,
)
from dflash_jax.data.heldout import heldout_prompts
from dflash_jax.data.sample_encoder import control_tokens
from dflash_jax.data.settings import DataConfig
from dflash_jax.data.sources import check_jsonl_start
from dflash_jax.errors import DataError
from dflash_jax.models.formats.hub import resolve_dataset_files

BUNDLED_DATA = ASSETS / "data"
BUNDLED_SETS = ("heldout_prompts", "stdlib_heldout")
Messages = list[dict[str, str]]


@dataclasses.dataclass(frozen=True)
class PromptSet:
    """Rows to decode. A row lists the messages to send before each of its answers: one entry
    for a single-turn row; in a multi-turn row each later entry (a user turn) follows the
    target's own answer to the entries before it."""

    name: str
    rows: list[list[Messages]]


@dataclasses.dataclass(frozen=True)
class HeldoutPrompts:
    """The prompts `data.heldout_rows` keeps out of training (data/heldout.py), read back from
    the tokenized cache of `data` for the target in `target_path` (built first if missing)."""

    data: DataConfig
    target_path: str

    @property
    def name(self) -> str:
        return f"heldout:{self.data.heldout_rows} of {self.data.train}"

    def prompts(self) -> list[Messages]:
        cache = ensure_cache(self.data, self.target_path)
        return heldout_prompts(cache, self.data.heldout_rows, self.data.format)


def resolve_prompt_set(spec: str) -> tuple[str, str]:
    """(display name, what `load_prompt_set` reads) of a prompt set spec, checked: a file must
    exist, and a benchmark be in the hub cache (downloaded when the hub can be reached)."""
    if os.path.isfile(spec):
        return Path(spec).stem, spec
    bundled = BUNDLED_DATA / f"{spec}.jsonl"
    if bundled.is_file():
        return spec, str(bundled)
    if spec in BENCHMARKS:
        resolve_dataset_files(BENCHMARKS[spec].dataset)
        return spec, spec
    name, is_copy, path = spec.partition("=")
    if is_copy and name in BENCHMARKS:
        if not os.path.isfile(path):
            raise PromptSetNotFound(f"{spec}: no such file (a local copy of {name} in its published format)")
        return name, spec
    raise PromptSetNotFound(
        f"prompt set {spec!r} is neither a file, a bundled set nor a benchmark (bundled: {', '.join(BUNDLED_SETS)}; "
        f"benchmarks: {', '.join(BENCHMARKS)}; a local copy of a benchmark: NAME=PATH)"
    )


class PromptSetNotFound(DataError, FileNotFoundError):
    """A prompt set that is neither a file nor a bundled set."""


class BadRow(DataError, ValueError):
    """A prompt row (or file) that cannot be used; the message names the file and line."""


def conversation(record: Any) -> list[dict[str, str]]:
    """A record's messages as [{"role", "content"}, ...] in OpenAI roles, read as training data is
    (`formats.chat_messages`); a row that is not a chat is a ValueError."""
    try:
        return list(chat_messages(record))
    except BadSample as e:
        raise ValueError(e.detail) from None


def prompt_messages(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """The conversation up to its last non-assistant turn: what the model is asked to answer."""
    end = len(messages)
    while end and messages[end - 1]["role"] == "assistant":
        end -= 1
    if not end:
        raise ValueError("the conversation has only assistant turns: there is nothing to answer")
    return messages[:end]


def jsonl_lines(path: str) -> Iterator[tuple[int, str]]:
    """(line number, text) of every non-blank line, a leading byte-order mark dropped. A file
    that is not UTF-8 JSON Lines (UTF-16, a JSON array, ...) is a `BadRow` naming it; bytes that
    are not UTF-8 reach `decode_row` as surrogate escapes, which it refuses with their line."""
    try:
        f = open(path, "rb")
    except OSError as e:
        raise BadRow(f"{path}: cannot read the file ({e.strerror})") from None
    with f:
        try:
            check_jsonl_start(path, f)
        except DataError as e:
            raise BadRow(str(e)) from None
        for number, line in enumerate(f, 1):
            if line.strip():
                yield number, line.removeprefix(UTF8_BOM).decode("utf-8", "surrogateescape")


def decode_row(text: str) -> Any:
    """A JSONL row's value; ValueError saying what is wrong with the row, in words."""
    try:
        return decode_json_line(text.encode("utf-8", "surrogateescape"))
    except BadSample as e:
        raise ValueError(e.detail.removeprefix("the line is ")) from None


class ChatTokenizer:
    """The target's tokenizer, chat template and end-of-turn tokens."""

    def __init__(self, tokenizer_dir: str, *, enable_thinking: bool = False):
        import transformers  # slow to import; only the commands that tokenize need it

        self.tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
        if not self.tokenizer.chat_template:
            raise ValueError(f"the tokenizer in {tokenizer_dir} has no chat template")
        self.enable_thinking = enable_thinking
        self.stop_tokens = _stop_tokens(tokenizer_dir, self.tokenizer)

    def prompt_ids(self, messages: list[dict[str, str]]) -> np.ndarray:
        ids = self.tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
            enable_thinking=self.enable_thinking,
        )
        return np.asarray(ids, np.int32)

    def response_text(self, tokens: np.ndarray) -> str:
        """Generated tokens -> the assistant message text (the end-of-turn token dropped)."""
        tokens = list(tokens)
        if tokens and tokens[-1] in self.stop_tokens:
            tokens = tokens[:-1]
        return self.tokenizer.decode(tokens, skip_special_tokens=False)


def _stop_tokens(tokenizer_dir: str, tokenizer) -> tuple[int, ...]:
    """The generation config's eos ids (Qwen3 lists several) and the tokenizer's eos."""
    import transformers

    ids = set()
    try:
        eos = transformers.GenerationConfig.from_pretrained(tokenizer_dir).eos_token_id
        ids.update([eos] if isinstance(eos, int) else eos or [])
    except OSError:  # no generation_config.json
        pass
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    if not ids:
        raise ValueError(f"{tokenizer_dir}: no eos token in the tokenizer or generation config")
    return tuple(sorted(ids))


def load_prompt_set(spec: str | HeldoutPrompts, chat: ChatTokenizer, *, limit: int = 0) -> PromptSet:
    """The first `limit` rows (0: all) of a prompt set. Every row's first turn is rendered here,
    so that a row the template cannot render is an error naming it before anything is decoded."""
    tokens = control_tokens(chat.tokenizer)
    pattern = control_token_pattern(tokens)
    if isinstance(spec, HeldoutPrompts):
        name = spec.name
        rows = [(f"{name}, prompt {i + 1}", [p]) for i, p in enumerate(spec.prompts()[: limit or None])]
    else:
        name, source = resolve_prompt_set(spec)
        benchmark, is_copy, path = source.partition("=")
        if benchmark in BENCHMARKS:
            questions = read_benchmark(benchmark, path if is_copy else None, limit=limit)
            rows = [(where, [[{"role": "user", "content": turn}] for turn in turns]) for where, turns in questions]
        else:
            rows = list(_chat_rows(source, limit, split_think={"<think>", "</think>"} <= set(tokens)))
    checked = []
    for where, turns in rows:
        try:
            for turn in turns:
                found = find_control_text(turn, pattern) if pattern else None
                if found:
                    raise ValueError(f"{found}, a control token of the tokenizer")
            chat.prompt_ids(turns[0])
        except (ValueError, TypeError, jinja2.TemplateError) as e:
            raise BadRow(f"{where}: {' '.join(str(e).split())}") from None
        checked.append(turns)
    return PromptSet(name, checked)


def _chat_rows(path: str, limit: int, *, split_think: bool) -> Iterator[tuple[str, list[Messages]]]:
    """(path:line, [prompt]) of the rows of a chat JSONL file. With `split_think` (a tokenizer
    with <think> tokens), earlier assistant turns keep their reasoning apart, as the training
    data has it."""
    count = 0
    for number, text in jsonl_lines(path):
        if limit and count == limit:
            return
        try:
            messages = prompt_messages(conversation(decode_row(text)))
            if split_think:
                messages = [split_think_block(m) for m in messages]
        except (ValueError, TypeError) as e:
            raise BadRow(f"{path}:{number}: {' '.join(str(e).split())}") from None
        count += 1
        yield f"{path}:{number}", [messages]
    if not count:
        raise BadRow(f"{path}: the file holds no prompt (it is empty or blank)")


def load_prompts(spec: str | HeldoutPrompts, chat: ChatTokenizer, *, limit: int = 0) -> tuple[str, list[np.ndarray]]:
    """(set name, chat-templated token ids of each row's first turn): what the in-training τ
    decodes (`evaluate` answers every turn of multi-turn rows)."""
    prompt_set = load_prompt_set(spec, chat, limit=limit)
    return prompt_set.name, [chat.prompt_ids(row[0]) for row in prompt_set.rows]
