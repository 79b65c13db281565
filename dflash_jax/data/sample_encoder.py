"""Tokenizing samples with the target's own tokenizer and chat template, and their loss masks.

Templates such as Qwen3's carry no generation markers, and render an assistant turn differently
when it is the last one (with a `<think>` block) than when it is history. So the mask is derived
from token-level differences of rendered conversation prefixes, and every prefix relation it
relies on is checked; a conversation where one does not hold is rejected, never guessed at.

An assistant turn's loss tokens are what the model generates for it: from the end of the
generation prompt (`add_generation_prompt=True`, honouring `enable_thinking`) to the end-of-turn
token. With thinking disabled Qwen3's empty `<think></think>` block is part of the prompt; with
thinking enabled it is generated, so it is trained on.

A conversation that opens with an assistant turn (after an optional system prompt) is rendered
like any other: that turn's loss starts where the template's generation prompt and the rendered
turn part (the empty conversation is never rendered). Templates that refuse such conversations
skip them as `assistant_first_unsupported`.

Control tokens: a text holding the literal string of a control token of the tokenizer (its
special and added tokens: <|im_start|>, <|im_end|>, <think>, <|MASK|>, ...) would be encoded as
that control id, so a row could inject turns, move the loss mask or put the drafter's mask token
into the data. Such rows are skipped as `control_token_text`, for every template alike. Only a
well-formed `<think>...</think>` block opening an assistant text is taken as what it means: the
turn's reasoning (moved to `reasoning_content`, as Qwen3's template itself does). As a last line
of defence, a sample holding the id of <|MASK|> is skipped too.
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Callable

import jinja2
import numpy as np

from dflash_jax.data.formats import (
    BadSample,
    Conversation,
    PlainText,
    check_assistant_turns,
    control_token_pattern,
    find_control_text,
    split_think_block,
)
from dflash_jax.errors import ConfigError, DataError
from dflash_jax.models.drafter_config import MASK_TOKEN

# Files that define a Hugging Face tokenizer and its chat template; the cache depends on them.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)


def tokenizer_fingerprint(tokenizer_dir: str) -> dict[str, str]:
    """sha256 of each tokenizer file present in `tokenizer_dir`."""
    digests = {}
    for name in TOKENIZER_FILES:
        path = os.path.join(tokenizer_dir, name)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                digests[name] = hashlib.file_digest(f, "sha256").hexdigest()
    if not digests:
        raise ConfigError(
            f"target.path={tokenizer_dir!r} holds no tokenizer files ({', '.join(TOKENIZER_FILES[:2])}, ...)"
        )
    return digests


class SampleEncoder:
    """Turns normalized samples into (token ids, loss mask) with the target's tokenizer."""

    def __init__(self, tokenizer_dir: str, enable_thinking: bool):
        import transformers  # slow to import; only the processes that tokenize need it

        self.tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
        self._enable_thinking = enable_thinking
        self._eos_id = self.tokenizer.eos_token_id
        template = self.tokenizer.chat_template
        self.chat_template_sha256 = hashlib.sha256(template.encode()).hexdigest() if template else None
        self.vocab_size = len(self.tokenizer)
        self.tokenizer.model_max_length = sys.maxsize  # lengths are ours to handle (no warning)
        self._tokenizer_dir = tokenizer_dir
        self.control_tokens = control_tokens(self.tokenizer)
        self._control_pattern = control_token_pattern(self.control_tokens)
        # Reasoning blocks are split out only where <think> is a control token (elsewhere it is text).
        self._split_think = {"<think>", "</think>"} <= set(self.control_tokens)
        self.mask_token_id = self.tokenizer.get_added_vocab().get(MASK_TOKEN)

    def encode(self, sample: Conversation | PlainText, max_len: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """int32 token ids and uint8 loss mask of equal length. With `max_len`, the caller keeps
        only the first `max_len` tokens: a sample may then come back longer than that with the
        loss of turns that start beyond it left out (finding them is quadratic in the turns)."""
        if isinstance(sample, PlainText):
            found = self._control_pattern.search(sample.text) if self._control_pattern else None
            if found:
                self._refuse_control_text(f"`text` holds the text {found.group()!r}")
            ids = self._ids(sample.text, add_special_tokens=True)
            mask = np.ones_like(ids, dtype=np.uint8)
        else:
            messages = sample.messages
            if self._split_think:
                messages = tuple(split_think_block(m) for m in messages)
                check_assistant_turns(messages)
            found = find_control_text(messages, self._control_pattern) if self._control_pattern else None
            if found:
                self._refuse_control_text(found)
            ids, mask = self._encode_conversation(messages, max_len)
        if self.mask_token_id is not None and (ids == self.mask_token_id).any():
            raise BadSample("control_token_text", f"the tokenized sample holds the mask token id {self.mask_token_id}")
        return ids, mask

    @staticmethod
    def _refuse_control_text(where: str) -> None:
        raise BadSample("control_token_text", f"{where}, a control token of the tokenizer")

    def _ids(self, text: str, add_special_tokens: bool = False) -> np.ndarray:
        try:
            ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        except (TypeError, ValueError) as e:
            raise BadSample(
                "unencodable_text", f"the tokenizer cannot encode the text ({type(e).__name__}: {e})"
            ) from None
        return np.asarray(ids, np.int32)

    def _render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> np.ndarray:
        if self.tokenizer.chat_template is None:
            raise DataError(
                f"the tokenizer in {self._tokenizer_dir} has no chat template, so it cannot render conversations"
            )
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                enable_thinking=self._enable_thinking,
            )
        except (jinja2.TemplateError, TypeError, ValueError) as e:
            raise BadSample("template_error", f"{type(e).__name__}: {e}") from None
        return self._ids(text)

    def _encode_conversation(
        self, messages: tuple[dict[str, str], ...], max_len: int | None
    ) -> tuple[np.ndarray, np.ndarray]:
        try:
            return self._encode_rendered(messages, max_len)
        except BadSample as e:
            if e.reason == "template_error" and _opening_assistant_turn(messages) is not None:
                raise BadSample("assistant_first_unsupported", f"the chat template refused it ({e.detail})") from None
            raise

    def _encode_rendered(
        self, messages: tuple[dict[str, str], ...], max_len: int | None
    ) -> tuple[np.ndarray, np.ndarray]:
        rendered: dict[tuple[int, bool], np.ndarray] = {}

        def prefix(k: int, add_generation_prompt: bool = False) -> np.ndarray:
            """Tokens of the first k messages (memoized: turns share most prefixes). The empty
            conversation is never rendered: templates may index messages[0]."""
            if k == 0:
                if add_generation_prompt:
                    return self._first_generation_prompt(messages[0])
                return np.zeros(0, np.int32)
            if (k, add_generation_prompt) not in rendered:
                rendered[k, add_generation_prompt] = self._render(list(messages[:k]), add_generation_prompt)
            return rendered[k, add_generation_prompt]

        full = prefix(len(messages))
        mask = np.zeros(len(full), np.uint8)
        end = 0
        for i, message in enumerate(messages):
            if message["role"] == "assistant":
                if max_len is not None and len(prefix(i)) >= max_len:
                    # This turn and the later ones start beyond max_len, where the caller cuts the
                    # sample (len(full) > max_len): their tokens are never trained on.
                    return full, mask
                start, end = self._turn_span(messages, i, prefix, full)
                end = self._loss_end(full, start, end)
                mask[start:end] = 1
        # What follows the last assistant turn carries no loss; leave it out of the sample.
        full, mask = full[:end], mask[:end]
        if not mask.any():
            raise BadSample("empty_loss_mask")
        if mask.all():
            raise BadSample("all_loss_mask")
        return full, mask

    def _turn_span(
        self, messages: tuple[dict[str, str], ...], i: int, prefix: Callable[..., np.ndarray], full: np.ndarray
    ) -> tuple[int, int]:
        """Token range of assistant message i inside `full`, after its generation prompt."""
        context, prompt, own = prefix(i), prefix(i, True), prefix(i + 1)
        if not (_is_prefix(context, full) and _is_prefix(context, prompt)):
            raise BadSample(
                "template_mismatch", f"messages before turn {i} render differently in the full conversation"
            )
        if i == _opening_assistant_turn(messages) and not _is_prefix(prompt, own):
            # No user turn before it, so templates such as Qwen3's render it in its history form
            # (no think block): its own tokens start where the generation prompt and it part.
            start = _common_prefix_len(prompt, own)
            if start <= len(context):
                raise BadSample("template_mismatch", f"cannot find where opening assistant turn {i} starts")
            prompt = prompt[:start]
        if not _is_prefix(prompt, own):
            raise BadSample(
                "template_mismatch",
                f"the generation prompt is not a prefix of assistant turn {i} "
                f"(does enable_thinking={self._enable_thinking} match the data?)",
            )
        if _is_prefix(own, full):
            return len(prompt), len(own)
        # The turn renders differently as history than as the last turn (Qwen3 drops its think
        # block): its own tokens start where the generation prompt and the history form part...
        start = _common_prefix_len(prompt, full)
        # ...and end where the next message starts, which is measured from the other side: that
        # message, rendered right after the context with turn i left out, follows turn i in `full`.
        through_next = prefix(i + 2)
        without_turn = self._render(list(messages[:i]) + [messages[i + 1]], add_generation_prompt=False)
        next_message = without_turn[len(context) :]
        end = len(through_next) - len(next_message)
        if not (
            _is_prefix(through_next, full)
            and _is_prefix(context, without_turn)
            and np.array_equal(through_next[end:], next_message)
            and end > start
        ):
            raise BadSample("template_mismatch", f"cannot find where assistant turn {i} ends in the conversation")
        return start, end

    def _first_generation_prompt(self, first: dict[str, str]) -> np.ndarray:
        """The generation prompt with nothing before it, for a conversation that opens with an
        assistant turn: what the template appends to that turn when asked for a generation
        prompt (rendering the empty conversation is not an option)."""
        alone, prompted = self._render([first], False), self._render([first], True)
        if not _is_prefix(alone, prompted):
            raise BadSample("template_mismatch", "the generation prompt does not follow the rendered first turn")
        return prompted[len(alone) :]

    def _loss_end(self, tokens: np.ndarray, start: int, end: int) -> int:
        """End of the turn's loss span: just after its last end-of-turn token (what follows, e.g.
        a newline, is template text the model never generates)."""
        eos = np.flatnonzero(tokens[start:end] == self._eos_id) if self._eos_id is not None else []
        return start + int(eos[-1]) + 1 if len(eos) else end


def control_tokens(tokenizer) -> tuple[str, ...]:
    """The strings a tokenizer encodes as control ids: its special tokens and the added tokens
    that look like markup (an added token made only of letters, digits and spaces, as some
    tokenizers add for whitespace runs, is vocabulary, not control)."""
    tokens = set(tokenizer.all_special_tokens)
    for added in tokenizer.added_tokens_decoder.values():
        if added.special or any(not (c.isalnum() or c.isspace() or c == "\u2581") for c in added.content):
            tokens.add(added.content)
    return tuple(sorted(t for t in tokens if t))


def _opening_assistant_turn(messages: tuple[dict[str, str], ...]) -> int | None:
    """Index of the assistant turn a conversation opens with (after system turns), or None."""
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            return i
        if message["role"] != "system":
            return None
    return None


def _is_prefix(a: np.ndarray, b: np.ndarray) -> bool:
    return len(a) <= len(b) and np.array_equal(a, b[: len(a)])


def _common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n
