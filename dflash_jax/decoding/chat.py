"""Chat prompts for decoding: JSONL conversations -> token ids, rendered as a serving engine would.

Rows are OpenAI `messages` (role/content) or ShareGPT `conversations` (from/value). The prompt of
a row is its conversation without trailing assistant turns, rendered with the target's own chat
template and a generation prompt. Bundled held-out sets are named by their file stem in
`assets/data/` (e.g. `heldout_prompts`).

Prompt files are read as the training data is (`dflash_jax.data`): a UTF-8 byte-order mark is
ignored, a file in another encoding or that is not JSON Lines is refused, and a row that cannot
be a prompt (not UTF-8, not JSON, not a conversation, holding the text of a control token such
as <|im_end|>) stops loading with one line naming `file:line`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jinja2
import numpy as np

from dflash_jax.data.chat import control_tokens
from dflash_jax.data.formats import (
    UTF8_BOM,
    BadSample,
    a_json_type,
    control_token_pattern,
    decode_json_line,
    find_control_text,
    split_think_block,
)
from dflash_jax.data.sources import check_jsonl_start
from dflash_jax.errors import DataError

BUNDLED_DATA = Path(__file__).resolve().parents[2] / "assets" / "data"
BUNDLED_SETS = ("heldout_prompts", "stdlib_heldout")
ROLES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "tool": "tool",
}


def resolve_prompt_set(spec: str) -> tuple[str, str]:
    """A bundled set name or a JSONL path -> (display name, path)."""
    if os.path.isfile(spec):
        return Path(spec).stem, spec
    bundled = BUNDLED_DATA / f"{spec}.jsonl"
    if bundled.is_file():
        return spec, str(bundled)
    raise PromptSetNotFound(
        f"prompt set {spec!r} is neither a file nor a bundled set (bundled: {', '.join(BUNDLED_SETS)})"
    )


class PromptSetNotFound(DataError, FileNotFoundError):
    """A prompt set that is neither a file nor a bundled set."""


class BadRow(DataError, ValueError):
    """A prompt row (or file) that cannot be used; the message names the file and line."""


def conversation(record: Any) -> list[dict[str, str]]:
    """A record's messages as [{"role", "content"}, ...] in OpenAI roles."""
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    if "messages" in record:
        turns, role_key, content_key = record["messages"], "role", "content"
    elif "conversations" in record:
        turns, role_key, content_key = record["conversations"], "from", "value"
    else:
        raise ValueError(f"no `messages` or `conversations` field (fields: {sorted(record)[:8]})")
    if not isinstance(turns, list) or not turns:
        raise ValueError("the conversation must be a non-empty list of turns")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise ValueError(f"turn {i} is {a_json_type(turn)}, not an object with `{role_key}` and `{content_key}`")
        role, content = turn.get(role_key), turn.get(content_key)
        if not isinstance(role, str) or role not in ROLES:
            raise ValueError(f"turn {i} has role {role!r} (known: {', '.join(sorted(ROLES))})")
        if not isinstance(content, str):
            what = "missing" if content_key not in turn else a_json_type(content)
            raise ValueError(f"turn {i} content is {what}, not a string")
        surrogate = next((c for c in content if "\ud800" <= c <= "\udfff"), None)
        if surrogate:
            raise ValueError(
                f"turn {i} content holds a lone surrogate \\u{ord(surrogate):04x}, which is not a character"
            )
        messages.append({"role": ROLES[role], "content": content})
    return messages


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


def load_prompts(spec: str, chat: ChatTokenizer, *, limit: int = 0) -> tuple[str, list[np.ndarray]]:
    """(set name, chat-templated prompt token arrays) of a bundled set or JSONL file."""
    name, path = resolve_prompt_set(spec)
    tokens = control_tokens(chat.tokenizer)
    pattern = control_token_pattern(tokens)
    split_think = {"<think>", "</think>"} <= set(tokens)
    prompts = []
    for number, text in jsonl_lines(path):
        if limit and len(prompts) == limit:
            break
        try:
            messages = prompt_messages(conversation(decode_row(text)))
            if split_think:  # reasoning of earlier assistant turns, as the training data has it
                messages = [split_think_block(m) for m in messages]
            found = find_control_text(messages, pattern) if pattern else None
            if found:
                raise ValueError(f"{found}, a control token of the tokenizer")
            prompts.append(chat.prompt_ids(messages))
        except (ValueError, TypeError, jinja2.TemplateError) as e:
            raise BadRow(f"{path}:{number}: {' '.join(str(e).split())}") from None
    if not prompts:
        raise BadRow(f"{path}: the file holds no prompt (it is empty or blank)")
    return name, prompts
