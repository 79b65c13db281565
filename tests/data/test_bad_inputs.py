"""Every kind of bad input row is counted by reason (or stops the build with its file and line)."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_jax.data.build import ensure_cache
from dflash_jax.data.formats import SKIP_REASONS
from dflash_jax.errors import DataError
from support.chat_data import TOOL_REFUSING_TEMPLATE, chat, data_config, write_jsonl, write_tiny_target

STRICT_TEMPLATE = TOOL_REFUSING_TEMPLATE
LONG = " ".join(["the capital of France is Paris"] * 20)  # well over 64 tokens

# (row, reason it is skipped); None = a good row.
ROWS = [
    (chat("What is the capital?", "Paris."), None),
    (b'{"messages": [{"role": "user", "content": "caf\xe9"}]}', "non_utf8"),
    (b'{"messages": [{"role": "user"', "malformed_json"),
    (b"[1, 2, 3]", "unknown_format"),
    ({"prompt": "hi", "completion": "there"}, "unknown_format"),
    ({"text": 42}, "bad_content"),
    ({"messages": [{"content": "no role"}, {"role": "assistant", "content": "x"}]}, "bad_message"),
    ({"messages": [{"role": "user", "content": {"image": 1}}, {"role": "assistant", "content": "x"}]}, "bad_content"),
    ({"messages": {"role": "user"}}, "bad_message"),
    ({"messages": [{"role": "narrator", "content": "hi"}, {"role": "assistant", "content": "x"}]}, "unknown_role"),
    ({"conversations": [{"from": "alien", "value": "hi"}, {"from": "gpt", "value": "x"}]}, "unknown_role"),
    (
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]},
        "no_assistant_turn",
    ),
    (chat("What is the capital?", "   "), "empty_assistant_turn"),
    ({"text": "  "}, "empty_text"),
    (
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "tool", "content": "{}"},
                {"role": "assistant", "content": "x"},
            ]
        },
        "template_error",
    ),
    (chat("What is the capital?", "<think>\nhmm\n</think>\n\nParis.", "And Spain?", "Madrid."), "template_mismatch"),
    (chat(LONG, "Paris."), "no_loss_after_truncation"),
    (b"", None),  # blank lines are not rows
    (chat("Tell me a joke.", LONG), None),  # truncated, kept
    ({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "Paris."}]}, None),
    ({"text": "A spider has eight legs."}, None),
]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return str(write_tiny_target(tmp_path_factory.mktemp("target"), STRICT_TEMPLATE))


def expected_skips(rows):
    counts = {reason: 0 for reason in SKIP_REASONS}
    for _, reason in rows:
        if reason:
            counts[reason] += 1
    return counts


def test_each_bad_row_is_counted_by_reason_with_its_line(tmp_path, target):
    source = write_jsonl(tmp_path / "bad.jsonl", [row for row, _ in ROWS])
    manifest = ensure_cache(data_config(source, tmp_path / "cache"), target).manifest
    assert manifest["skipped"] == expected_skips(ROWS)
    assert manifest["num_samples"] == 4 and manifest["truncated"] == 1
    assert manifest["rows_read"] == len(ROWS) - 1
    for line, (_, reason) in enumerate(ROWS, start=1):
        if reason:
            assert any(e.startswith(f"{source}:{line}: ") for e in manifest["skipped_examples"][reason]), reason


def test_overlength_rows_are_dropped_and_counted_when_asked(tmp_path, target):
    source = write_jsonl(
        tmp_path / "long.jsonl", [chat("Tell me a joke.", LONG), chat("What is the capital?", "Paris.")]
    )
    manifest = ensure_cache(data_config(source, tmp_path / "cache", overlength="drop"), target).manifest
    assert manifest["skipped"]["overlength"] == 1 and manifest["num_samples"] == 1
    assert manifest["truncated"] == 0
    assert "tokens > seq_len 64" in manifest["skipped_examples"]["overlength"][0]


@pytest.mark.parametrize(
    "template, reason",
    [
        # Renders only assistant text: nothing is prompt.
        (
            "{%- for m in messages %}{%- if m.role == 'assistant' %}{{ m.content }}{%- endif %}{%- endfor %}",
            "all_loss_mask",
        ),
        # Never renders assistant text: nothing to train on.
        (
            "{%- for m in messages %}{%- if m.role == 'user' %}{{ m.content }}{%- endif %}{%- endfor %}",
            "empty_loss_mask",
        ),
    ],
)
def test_degenerate_masks_are_counted(tmp_path, template, reason):
    target = str(write_tiny_target(tmp_path / "target", template))
    source = write_jsonl(tmp_path / "a.jsonl", [chat("What is the capital?", "Paris."), {"text": "Paris."}])
    manifest = ensure_cache(data_config(source, tmp_path / "cache"), target).manifest
    assert manifest["skipped"][reason] == 1 and manifest["num_samples"] == 1


def test_on_bad_sample_error_stops_at_the_first_bad_row_naming_file_and_line(tmp_path, target):
    source = write_jsonl(tmp_path / "bad.jsonl", [row for row, _ in ROWS])
    with pytest.raises(DataError) as e:
        ensure_cache(data_config(source, tmp_path / "cache", on_bad_sample="error"), target)
    assert str(e.value) == (
        f"{source}:2: the line is not valid UTF-8 (byte 0xe9 at byte 47 of the line) [non_utf8]; "
        "set data.on_bad_sample='skip' to skip and count such rows"
    )
    assert not (tmp_path / "cache").exists()


def test_a_cache_with_skips_is_not_used_silently_when_bad_samples_are_errors(tmp_path, target):
    source = write_jsonl(tmp_path / "bad.jsonl", [row for row, _ in ROWS[:3]])
    ensure_cache(data_config(source, tmp_path / "cache"), target)
    with pytest.raises(DataError, match=r"^\S*bad.jsonl:2: the line is not valid UTF-8 .*\[non_utf8\]; set data"):
        ensure_cache(data_config(source, tmp_path / "cache", on_bad_sample="error"), target)


def test_parquet_rows_are_located_by_row_number(tmp_path, target):
    records = [
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "Paris."}]},
        {"conversations": [{"from": "alien", "value": "hi"}, {"from": "gpt", "value": "Paris."}]},
    ]
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "chats.parquet")
    manifest = ensure_cache(data_config(tmp_path / "chats.parquet", tmp_path / "cache"), target).manifest
    assert manifest["skipped"]["unknown_role"] == 1 and manifest["num_samples"] == 1
    assert manifest["skipped_examples"]["unknown_role"][0].startswith(f"{tmp_path / 'chats.parquet'} (row 1): ")


def test_unreadable_sources_and_options_are_reported(tmp_path, target):
    (tmp_path / "broken.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match="broken.parquet: cannot read the Parquet file"):
        ensure_cache(data_config(tmp_path / "broken.parquet", tmp_path / "cache"), target)
    with pytest.raises(DataError, match="missing.jsonl"):
        ensure_cache(data_config(tmp_path / "missing.jsonl", tmp_path / "cache"), target)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="empty: no .jsonl or .parquet file in this directory"):
        ensure_cache(data_config(tmp_path / "empty", tmp_path / "cache"), target)
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(DataError, match="unsupported file type"):
        ensure_cache(data_config(tmp_path / "notes.txt", tmp_path / "cache"), target)
    source = write_jsonl(tmp_path / "ok.jsonl", [json.dumps(chat("hi", "Paris."))])
    # Options are checked once, by the config resolver, through DataConfig.problems().
    assert data_config(source, tmp_path / "cache", overlength="cut").problems() == [
        "data.overlength='cut' is not one of truncate, drop"
    ]
    (tmp_path / "a_file").write_text("not a directory")
    with pytest.raises(DataError, match="^cannot write .*a_file: .*; set data.cache_dir to a writable place"):
        ensure_cache(data_config(source, tmp_path / "a_file" / "cache"), target)


def test_a_source_without_any_usable_row_is_an_error(tmp_path, target):
    source = write_jsonl(tmp_path / "all_bad.jsonl", [b'{"messages": [', {"text": ""}])
    with pytest.raises(
        DataError, match=r"no usable sample in \S+: 2 rows read, all skipped: 1 malformed_json .*1 empty_text"
    ):
        ensure_cache(data_config(source, tmp_path / "cache"), target)
