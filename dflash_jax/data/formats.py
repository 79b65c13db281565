"""Raw records → normalized samples: OpenAI `messages`, ShareGPT `conversations`, plain `text`.

Everything that can be wrong with one input row is reported as a `BadSample` whose reason is a
key of `SKIP_REASONS`; the cache builder counts them by reason (or stops, by config).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

# Every reason a row can be left out of the cache, with the text shown to users.
SKIP_REASONS = {
    "non_utf8": "the line is not valid UTF-8",
    "malformed_json": "the line is not valid JSON",
    "unknown_format": "the record is not an object with a `messages`, `conversations` or `text` field",
    "bad_message": "a message is not an object with a role and text content",
    "unknown_role": "a message has a role other than system/user/assistant/tool",
    "no_assistant_turn": "the conversation has no assistant turn, so nothing to learn from",
    "empty_assistant_turn": "an assistant turn has empty content",
    "empty_text": "the `text` field is empty",
    "template_error": "the chat template raised an error on this conversation",
    "template_mismatch": "a rendered conversation prefix is not a token prefix of the conversation",
    "empty_loss_mask": "no token of the sample is an assistant token",
    "all_loss_mask": "every token of a chat sample is an assistant token (no prompt)",
    "overlength": "longer than seq_len and data.overlength='drop'",
    "no_loss_after_truncation": "truncation to seq_len removed every assistant token",
}

FORMATS = ("auto", "messages", "conversations", "text")

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
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadSample("non_utf8", f"invalid UTF-8 at byte {e.start}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise BadSample("malformed_json", f"{e.msg} at column {e.colno}") from None


def normalize_record(record: Any, data_format: str) -> Conversation | PlainText:
    """The sample a decoded record holds, in `data_format` ('auto' picks by field name)."""
    if not isinstance(record, dict):
        raise BadSample("unknown_format", f"expected a JSON object, got {type(record).__name__}")
    if data_format == "auto":
        data_format = next((f for f in FORMATS[1:] if f in record), "")
    if data_format not in record:
        raise BadSample("unknown_format", f"fields present: {sorted(record)[:8]}")
    if data_format == "text":
        return _plain_text(record["text"])
    key_role, key_content = ("role", "content") if data_format == "messages" else ("from", "value")
    roles = _OPENAI_ROLES if data_format == "messages" else _SHAREGPT_ROLES
    turns = record[data_format]
    if not isinstance(turns, (list, tuple)):
        raise BadSample("bad_message", f"`{data_format}` is a {type(turns).__name__}, not a list")
    messages = tuple(_message(turn, key_role, key_content, roles) for turn in turns)
    _check_assistant_turns(messages)
    return Conversation(messages)


def _plain_text(text: Any) -> PlainText:
    if not isinstance(text, str):
        raise BadSample("unknown_format", f"`text` is a {type(text).__name__}, not a string")
    if not text.strip():
        raise BadSample("empty_text")
    return PlainText(text)


def _message(turn: Any, key_role: str, key_content: str, roles: dict[str, str]) -> dict[str, str]:
    if not isinstance(turn, dict) or key_role not in turn:
        raise BadSample("bad_message", f"expected an object with `{key_role}`, got {str(turn)[:80]!r}")
    role = turn[key_role]
    if not isinstance(role, str) or role not in roles:
        raise BadSample("unknown_role", f"role {role!r} (known: {', '.join(sorted(roles))})")
    message = {"role": roles[role], "content": _text_content(turn.get(key_content), role)}
    reasoning = turn.get("reasoning_content")
    if isinstance(reasoning, str) and reasoning:
        message["reasoning_content"] = reasoning
    return message


def _text_content(content: Any, role: str) -> str:
    """A string, or the concatenated text parts of an OpenAI content list."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return "".join(p["text"] for p in content)
    raise BadSample("bad_message", f"{role} content is a {type(content).__name__} that is not text")


def _check_assistant_turns(messages: tuple[dict[str, str], ...]) -> None:
    if not any(m["role"] == "assistant" for m in messages):
        raise BadSample("no_assistant_turn")
    for i, m in enumerate(messages):
        if m["role"] == "assistant" and not m["content"].strip() and not m.get("reasoning_content"):
            raise BadSample("empty_assistant_turn", f"message {i} is an empty assistant turn")
