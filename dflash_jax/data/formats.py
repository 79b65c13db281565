"""Raw records → normalized samples: OpenAI `messages`, ShareGPT `conversations`, plain `text`.

Everything that can be wrong with one input row is reported as a `BadSample` whose reason is a
key of `SKIP_REASONS` and whose detail says, in words, what is wrong and where in the record
(`messages[1].content is null, not a string`); the cache builder counts them by reason (or stops
at the first one, by config). Nothing here depends on the tokenizer; the checks that do (control
tokens in the text, the chat template) live in `dflash_jax.data.sample_encoder`.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from collections.abc import Iterable
from typing import Any

# Every reason a row can be left out of the cache, with the text shown to users.
SKIP_REASONS = {
    "non_utf8": "the line is not valid UTF-8",
    "malformed_json": "the line is not valid JSON (or is truncated, too deeply nested, or holds a number too large)",
    "unknown_format": "the record is not an object with a `messages`, `conversations` or `text` field",
    "bad_message": "the message list is not a list of objects with a role",
    "bad_content": "a message's text is missing, null or not a string",
    "unknown_role": "a message has a role other than system/user/assistant/tool",
    "unencodable_text": "a text cannot be tokenized (a lone surrogate such as \\ud800 is not a character)",
    "control_token_text": (
        "a text contains a tokenizer control token such as <|im_end|> or the mask token; "
        "it would be encoded as a control id"
    ),
    "no_assistant_turn": "the conversation has no assistant turn, so nothing to learn from",
    "empty_assistant_turn": "an assistant turn has empty content",
    "empty_text": "the `text` field is empty",
    "assistant_first_unsupported": "the conversation opens with an assistant turn, which the chat template refuses",
    "template_error": "the chat template raised an error on this conversation",
    "template_mismatch": "a rendered conversation prefix is not a token prefix of the conversation",
    "empty_loss_mask": "no token of the sample is an assistant token",
    "all_loss_mask": "every token of a chat sample is an assistant token (no prompt)",
    "overlength": "longer than seq_len and data.overlength='drop'",
    "no_loss_after_truncation": "truncation to seq_len removed every assistant token",
}

FORMATS = ("auto", "messages", "conversations", "text")
UTF8_BOM = b"\xef\xbb\xbf"

# ShareGPT speaker names → OpenAI roles.
_SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "tool": "tool",
}
_OPENAI_ROLES = {role: role for role in _SHAREGPT_ROLES.values()}
# An assistant text that opens with a reasoning block, the way many datasets supply reasoning.
_THINK_BLOCK = re.compile(r"\s*<think>(.*?)</think>(.*)", re.DOTALL)
_SURROGATE = re.compile("[\ud800-\udfff]")


class BadSample(Exception):
    """One input row that cannot become a training sample."""

    def __init__(self, reason: str, detail: str = ""):
        if reason not in SKIP_REASONS:
            raise KeyError(f"unknown skip reason {reason!r}")
        self.reason = reason
        self.detail = detail or SKIP_REASONS[reason]
        super().__init__(f"{reason}: {self.detail}")


@dataclasses.dataclass(frozen=True)
class Conversation:
    """Messages as the chat template expects them: dicts with `role` and `content` (and
    `reasoning_content` when the source has it)."""

    messages: tuple[dict[str, str], ...]


@dataclasses.dataclass(frozen=True)
class PlainText:
    """A document trained on every token."""

    text: str


def decode_json_line(line: bytes) -> Any:
    """One JSONL row. A line without its newline is the last line of its file: when it is not
    valid JSON, the file was cut short (an interrupted write or copy) and the detail says so."""
    if line.startswith(UTF8_BOM):  # Windows editors write one; so do files concatenated with cat
        line = line[len(UTF8_BOM) :]
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadSample(
            "non_utf8", f"the line is not valid UTF-8 (byte 0x{line[e.start]:02x} at byte {e.start + 1} of the line)"
        ) from None
    try:
        return json.loads(text, object_pairs_hook=_object_without_duplicate_keys)
    except json.JSONDecodeError as e:
        incomplete = e.pos >= len(text.rstrip()) or e.msg.startswith("Unterminated string")
        if incomplete and not line.endswith(b"\n"):
            raise BadSample(
                "malformed_json",
                "the last line is truncated: it has no newline at the end and stops in the middle of a JSON value",
            ) from None
        if incomplete:
            raise BadSample(
                "malformed_json", "the line stops in the middle of a JSON value (a row split over several lines?)"
            ) from None
        raise BadSample("malformed_json", f"the line is not valid JSON: {_json_error(e)}") from None
    except RecursionError:
        raise BadSample("malformed_json", "the JSON is nested too deeply to read") from None
    except ValueError as e:  # the int() limit on digits, or a duplicate key (below)
        if "integer string conversion" in str(e):
            limit = sys.get_int_max_str_digits()
            raise BadSample("malformed_json", f"the line holds an integer with more than {limit} digits") from None
        raise BadSample("malformed_json", str(e)) from None


def _object_without_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        duplicate = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"an object has the key {duplicate!r} twice, so its value is ambiguous")
    return obj


def _json_error(e: json.JSONDecodeError) -> str:
    """json's message, in words a user recognizes."""
    where = f"column {e.colno}" if e.lineno == 1 else f"line {e.lineno} column {e.colno} of the row"
    messages = {
        "Extra data": f"more than one JSON value on the line (the second starts at {where})",
        "Expecting value": f"a value was expected at {where}",
        "Invalid control character at": f"a raw control character (tab, NUL, ...) inside a string at {where}; escape it",
        "Expecting property name enclosed in double quotes": f"an object key was expected at {where} (a trailing comma?)",
        "Illegal trailing comma before end of object": f"a trailing comma at {where}",  # Python 3.13+
        "Illegal trailing comma before end of array": f"a trailing comma at {where}",
    }
    if e.msg in messages:
        return messages[e.msg]
    msg = e.msg.removesuffix(" at")
    return f"{msg[0].lower()}{msg[1:]} at {where}"


def normalize_record(record: Any, data_format: str) -> Conversation | PlainText:
    """The sample a decoded record holds, in `data_format` ('auto' picks by field name: the first
    of `messages`, `conversations`, `text` present and not null)."""
    data_format = _record_format(record, data_format, FORMATS[1:])
    if data_format == "text":
        return _plain_text(record["text"])
    messages = _messages(record, data_format)
    check_assistant_turns(messages, data_format)
    return Conversation(messages)


def chat_messages(record: Any) -> tuple[dict[str, str], ...]:
    """A chat record's messages (`messages` or `conversations`), read as training reads them, its
    assistant turns unchecked: a prompt to answer, or a conversation to regenerate."""
    messages = _messages(record, _record_format(record, "auto", ("messages", "conversations")))
    if not messages:
        raise BadSample("bad_message", "the message list is empty")
    return messages


def _record_format(record: Any, data_format: str, formats: tuple[str, ...]) -> str:
    """`data_format`, or with 'auto' the first of `formats` the record holds (not null first)."""
    if not isinstance(record, dict):
        raise BadSample("unknown_format", f"the row is a JSON {_json_type(record)}, not an object")
    if data_format == "auto":
        data_format = next((f for f in formats if record.get(f) is not None), None) or next(
            (f for f in formats if f in record), ""
        )
    if data_format not in record:
        fields = ", ".join(f"`{k}`" for k in sorted(record)[:8]) or "none"
        names = [f"`{f}`" for f in formats]
        wanted = f"`{data_format}` (data.format)" if data_format else f"{', '.join(names[:-1])} or {names[-1]}"
        raise BadSample("unknown_format", f"the record has no {wanted} field (its fields: {fields})")
    return data_format


def _messages(record: dict, data_format: str) -> tuple[dict[str, str], ...]:
    turns = record[data_format]
    if not isinstance(turns, list):
        hint = (
            " (it holds JSON text: decode it into a list)"
            if isinstance(turns, str) and turns.lstrip().startswith("[")
            else ""
        )
        raise BadSample("bad_message", f"`{data_format}` is {a_json_type(turns)}, not a list of messages{hint}")
    return tuple(_message(turn, f"{data_format}[{i}]", data_format) for i, turn in enumerate(turns))


def _plain_text(text: Any) -> PlainText:
    if not isinstance(text, str):
        raise BadSample("bad_content", f"`text` is {a_json_type(text)}, not a string")
    if not text.strip():
        raise BadSample("empty_text", "the `text` field is empty")
    _check_encodable(text, "`text`")
    return PlainText(text)


def _message(turn: Any, where: str, data_format: str) -> dict[str, str]:
    if data_format == "conversations" and isinstance(turn, dict) and "from" not in turn and "role" in turn:
        data_format = "messages"  # ShareGPT files that spell their turns the OpenAI way
    key_role, key_content = ("role", "content") if data_format == "messages" else ("from", "value")
    roles = _OPENAI_ROLES if data_format == "messages" else _SHAREGPT_ROLES
    if not isinstance(turn, dict):
        raise BadSample("bad_message", f"{where} is {a_json_type(turn)}, not an object with `{key_role}`")
    if key_role not in turn:
        fields = ", ".join(f"`{k}`" for k in sorted(turn)[:8]) or "none"
        raise BadSample("bad_message", f"{where} has no `{key_role}` field (its fields: {fields})")
    role = turn[key_role]
    if not isinstance(role, str) or role not in roles:
        shown = repr(role) if isinstance(role, str) else a_json_type(role)
        raise BadSample("unknown_role", f"{where}.{key_role} is {shown[:60]} (known: {', '.join(sorted(roles))})")
    if key_content not in turn:
        raise BadSample("bad_content", f"{where} has no `{key_content}` field")
    message = {"role": roles[role], "content": _text_content(turn[key_content], f"{where}.{key_content}", data_format)}
    reasoning = turn.get("reasoning_content")
    if reasoning is not None and not isinstance(reasoning, str):
        raise BadSample("bad_content", f"{where}.reasoning_content is {a_json_type(reasoning)}, not a string")
    if reasoning:
        _check_encodable(reasoning, f"{where}.reasoning_content")
        message["reasoning_content"] = reasoning
    return message


def _text_content(content: Any, where: str, data_format: str) -> str:
    """A string, or (OpenAI `messages` only) the concatenated parts of a list of
    `{"type": "text", "text": ...}` parts."""
    if isinstance(content, str):
        text = content
    elif (
        data_format == "messages"
        and isinstance(content, list)
        and content
        and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content)
    ):
        text = "".join(p["text"] for p in content)
    elif data_format == "messages" and isinstance(content, list):
        raise BadSample(
            "bad_content", f"{where} is a list that is not a non-empty list of {{type: text, text: string}} parts"
        )
    else:
        raise BadSample("bad_content", f"{where} is {a_json_type(content)}, not a string")
    _check_encodable(text, where)
    return text


def _check_encodable(text: str, where: str) -> None:
    """JSON's \\ud800 escapes decode to lone surrogates: not characters, so no tokenizer takes them."""
    found = _SURROGATE.search(text)
    if found:
        raise BadSample(
            "unencodable_text",
            f"{where} holds a lone surrogate \\u{ord(found.group()):04x} at character {found.start() + 1}, which is not a character",
        )


def check_assistant_turns(messages: tuple[dict[str, str], ...], data_format: str = "messages") -> None:
    if not any(m["role"] == "assistant" for m in messages):
        raise BadSample(
            "no_assistant_turn", "the conversation has no assistant turn" if messages else "the message list is empty"
        )
    for i, m in enumerate(messages):
        if m["role"] == "assistant" and not m["content"].strip() and not m.get("reasoning_content", "").strip():
            raise BadSample("empty_assistant_turn", f"{data_format}[{i}] is an assistant turn with empty content")


def split_think_block(message: dict[str, str]) -> dict[str, str]:
    """An assistant message whose content opens with a `<think>...</think>` block, with the
    block's text moved to `reasoning_content` (Qwen3's own template splits it the same way).
    When `reasoning_content` is already set the block is dropped if it says the same thing, and
    otherwise kept (so the control-token check refuses the row). Other messages are unchanged."""
    found = _THINK_BLOCK.fullmatch(message["content"]) if message["role"] == "assistant" else None
    if not found or "<think>" in found.group(1):
        return message
    reasoning, content = found.group(1).strip("\n"), found.group(2).lstrip("\n")
    existing = message.get("reasoning_content")
    if existing and existing.strip() != reasoning.strip():
        return message
    out = {**message, "content": content}
    if existing or reasoning:
        out["reasoning_content"] = existing or reasoning
    return out


def find_control_text(messages: Iterable[dict[str, str]], pattern: re.Pattern) -> str | None:
    """Where the first control-token text in `messages` is ("the content of turn 2 (assistant)
    holds the text '<|im_end|>'"), or None. `pattern` matches any of the control tokens."""
    for i, message in enumerate(messages):
        for field in ("content", "reasoning_content"):
            found = pattern.search(message.get(field) or "")
            if found:
                return f"the {field} of turn {i + 1} ({message['role']}) holds the text {found.group()!r}"
    return None


def control_token_pattern(tokens: Iterable[str]) -> re.Pattern | None:
    """A regex that finds any of `tokens` (longest first), or None when there are none."""
    tokens = sorted({t for t in tokens if t}, key=len, reverse=True)
    return re.compile("|".join(map(re.escape, tokens))) if tokens else None


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, (list, tuple)):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def a_json_type(value: Any) -> str:
    """`null`, `a number`, `an object`, ...: how a value's type reads in a sentence."""
    name = _json_type(value)
    if name == "null":
        return "null"
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"
