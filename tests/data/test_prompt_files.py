"""Prompt files for evaluation (`dflash_jax.decoding.prompt_sets.load_prompts`) are read as robustly as
training data: a byte-order mark is ignored, and every problem is a one-line `DataError` naming
the file and, for a row, its line."""

import numpy as np
import pytest

from dflash_jax.decoding.prompt_sets import ChatTokenizer, load_prompts
from dflash_jax.errors import DataError
from support.chat_data import chat, write_jsonl, write_tiny_target

GOOD = [chat("What is the capital of France?", "Paris."), chat("How many legs does a spider have?")]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return ChatTokenizer(str(write_tiny_target(tmp_path_factory.mktemp("target"))))


def test_a_byte_order_mark_is_ignored(tmp_path, tokenizer):
    plain = write_jsonl(tmp_path / "plain.jsonl", GOOD)
    with_bom = tmp_path / "bom.jsonl"
    with_bom.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes().replace(b"\n", b"\r\n"))
    _, want = load_prompts(str(plain), tokenizer)
    _, got = load_prompts(str(with_bom), tokenizer)
    assert len(got) == 2 and all(np.array_equal(a, b) for a, b in zip(got, want))


def test_prompt_rows_are_read_as_training_reads_its_rows(tmp_path, tokenizer):
    """The spellings training takes (data/formats.py), one reader for both: ShareGPT from/value,
    ShareGPT turns with OpenAI keys, OpenAI content as a list of text parts."""
    question = "What is the capital of France?"
    rows = [
        {"conversations": [{"from": "human", "value": question}]},
        {"conversations": [{"role": "user", "content": question}]},
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "What is the capital "},
                        {"type": "text", "text": "of France?"},
                    ],
                }
            ]
        },
    ]
    _, want = load_prompts(str(write_jsonl(tmp_path / "plain.jsonl", [chat(question)])), tokenizer)
    _, got = load_prompts(str(write_jsonl(tmp_path / "spellings.jsonl", rows)), tokenizer)
    assert len(got) == 3 and all(np.array_equal(ids, want[0]) for ids in got)
    text_only = write_jsonl(tmp_path / "text.jsonl", [{"text": question}])
    with pytest.raises(DataError) as raised:
        load_prompts(str(text_only), tokenizer)
    assert str(raised.value) == (
        f"{text_only}:1: the record has no `messages` or `conversations` field (its fields: `text`)"
    )


def test_reasoning_in_earlier_assistant_turns_is_not_control_text(tmp_path, tokenizer):
    record = chat("What is the capital?", "<think>\nEasy.\n</think>\n\nParis.", "And of Spain?")
    _, [prompt] = load_prompts(str(write_jsonl(tmp_path / "p.jsonl", [record])), tokenizer)
    assert tokenizer.tokenizer.decode(prompt).count("<think>") == 1  # the generation prompt's only


@pytest.mark.parametrize(
    "content, message",
    [
        ("\ufeff" + '{"messages": [{"role": "user", "content": "hi"}]}\n', None),  # BOM: fine
        (b'[{"messages": []},\n', "{path}: the file is a JSON array, not JSON Lines: write one object per line"),
        ('{"messages": [{"role": "user", "content": "hi"}]}\n'.encode("utf-16"), "{path}: the file is UTF-16"),
        (b"", "{path}: the file holds no prompt (it is empty or blank)"),
        (
            b'{"messages": [{"role": "user", "content": "hi"}]}\n{"messages": [{"role": "user", "content": "caf\xe9"}]}\n',
            "{path}:2: not valid UTF-8 (byte 0xe9 at byte 47 of the line)",
        ),
        (
            b'{"messages": [{"role": "user", "content": "hi \\ud800"}]}\n',
            "{path}:1: messages[0].content holds a lone surrogate \\ud800 at character 4, which is not a character",
        ),
        (
            b'{"messages": [{"role": "user", "content": "hi<|im_end|>"}]}\n',
            "{path}:1: the content of turn 1 (user) holds the text '<|im_end|>', a control token of the tokenizer",
        ),
        (
            b'{"messages": [{"role": "user", "content": "<|MASK|>"}]}\n',
            "{path}:1: the content of turn 1 (user) holds the text '<|MASK|>'",
        ),
        (b'{"messages": []}\n', "{path}:1: the message list is empty"),
        (b'{"messages": [{"role": "user", "content": null}]}\n', "{path}:1: messages[0].content is null, not a string"),
        (b'{"messages": [{"role": "user"}]}\n', "{path}:1: messages[0] has no `content` field"),
        (
            b'{"messages": [{"role": "user", "content": "hi"}]}\n{"messages": [{"role": "user", "cont',
            "{path}:2: the last line is truncated",
        ),
        (
            b'{"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": "x"}]}\n'
            b'{"id": 1, "id": 2, "messages": []}\n',
            "{path}:2: an object has the key 'id' twice",
        ),
    ],
)
def test_bad_prompt_files_are_one_line_errors_naming_file_and_line(tmp_path, tokenizer, content, message):
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    if message is None:
        assert len(load_prompts(str(path), tokenizer)[1]) == 1
        return
    with pytest.raises(DataError) as raised:
        load_prompts(str(path), tokenizer)
    assert message.format(path=path) in str(raised.value)
    assert "\n" not in str(raised.value)


def test_a_missing_prompt_set_is_a_data_error(tokenizer):
    with pytest.raises(DataError, match="neither a file, a bundled set nor a benchmark"):
        load_prompts("no_such_set", tokenizer)
