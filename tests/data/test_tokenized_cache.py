"""The tokenized cache: contents and manifest, reuse, staleness, atomic builds, the prepare CLI."""

import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_jax.data import build
from dflash_jax.data.build import cache_inputs, ensure_cache, stale_reasons
from dflash_jax.data.cache import read_manifest
from dflash_jax.data.formats import normalize_record
from dflash_jax.data.sample_encoder import SampleEncoder
from dflash_jax.errors import DataError
from support.chat_data import QWEN3_STYLE_TEMPLATE, chat, data_config, write_jsonl, write_tiny_target

JSONL_RECORDS = [
    chat("What is the capital of France?", "Paris.", system="Be brief."),
    {"text": "A spider has eight legs."},
    chat("Tell me a joke.", "Why did the cat sit on the computer?", "Another.", "To keep an eye on the mouse."),
]
PARQUET_RECORDS = [
    {
        "conversations": [
            {"from": "human", "value": f"How many legs, {i}?"},
            {"from": "gpt", "value": "Eight" + "!" * (i % 8)},
        ]
    }
    for i in range(40)
]


@pytest.fixture
def target(tmp_path):
    return str(write_tiny_target(tmp_path / "target"))


@pytest.fixture
def sources(tmp_path):
    """A directory with a JSONL and a Parquet file."""
    root = tmp_path / "sources"
    root.mkdir()
    write_jsonl(root / "a.jsonl", JSONL_RECORDS)
    pq.write_table(pa.Table.from_pylist(PARQUET_RECORDS), root / "b.parquet")
    return root


def test_cache_holds_every_sample_with_a_complete_manifest(tmp_path, target, sources):
    cache = ensure_cache(data_config(sources, tmp_path / "cache"), target)
    encoder = SampleEncoder(target, enable_thinking=False)
    records = JSONL_RECORDS + PARQUET_RECORDS  # files in sorted order, rows in file order
    assert cache.num_samples == len(records)
    for i, record in enumerate(records):
        want_tokens, want_mask = encoder.encode(normalize_record(record, "auto"))
        tokens, mask = cache.sample(i)
        np.testing.assert_array_equal(tokens, want_tokens)
        np.testing.assert_array_equal(mask, want_mask)
    m = cache.manifest
    assert [(os.path.basename(s["path"]), s["size"]) for s in m["inputs"]["sources"]] == [
        ("a.jsonl", os.path.getsize(sources / "a.jsonl")),
        ("b.parquet", os.path.getsize(sources / "b.parquet")),
    ]
    assert set(m["inputs"]["tokenizer_files"]) == {"tokenizer.json", "tokenizer_config.json"}
    assert m["tokenizer"]["chat_template_sha256"] == hashlib.sha256(QWEN3_STYLE_TEMPLATE.encode()).hexdigest()
    assert m["num_tokens"] == cache.offsets[-1] == len(cache.tokens)
    assert m["num_loss_tokens"] == int(cache.loss_mask.sum())
    assert sum(m["length_histogram"]["counts"]) == m["num_samples"] == m["rows_read"]
    assert not any(m["skipped"].values())


def test_an_unchanged_cache_is_reused(tmp_path, target, sources, monkeypatch):
    data = data_config(sources, tmp_path / "cache")
    first = ensure_cache(data, target)
    monkeypatch.setattr(build, "build_cache", lambda *a: pytest.fail("rebuilt an up-to-date cache"))
    assert ensure_cache(data, target).manifest == first.manifest


def test_changes_to_sources_tokenizer_or_options_make_the_cache_stale(tmp_path, target, sources):
    data = data_config(sources, tmp_path / "cache")
    built = ensure_cache(data, target).manifest["inputs"]

    def reasons(**overrides):
        return stale_reasons(built, cache_inputs(data_config(sources, tmp_path / "cache", **overrides), target))

    assert reasons() == []
    assert reasons(seq_len=128) == ["data.seq_len 64 -> 128"]
    assert reasons(enable_thinking=True) == ["data.enable_thinking False -> True"]
    write_jsonl(sources / "c.jsonl", JSONL_RECORDS[:1])
    assert reasons() == [f"new source {sources / 'c.jsonl'}"]
    os.remove(sources / "c.jsonl")
    with open(sources / "a.jsonl", "ab") as f:
        f.write(json.dumps(chat("hi", "Paris.")).encode() + b"\n")
    size_before, size_after = built["sources"][0]["size"], os.path.getsize(sources / "a.jsonl")
    assert reasons() == [f"source {sources / 'a.jsonl'} changed (size {size_before} -> {size_after}, modified)"]
    write_tiny_target(tmp_path / "target", QWEN3_STYLE_TEMPLATE.replace("<|im_start|>system", "<|im_start|>sys"))
    assert "tokenizer file tokenizer_config.json changed" in reasons()
    # ...and the next use rebuilds it.
    assert ensure_cache(data, target).num_samples == len(JSONL_RECORDS + PARQUET_RECORDS) + 1


def test_an_interrupted_build_never_leaves_a_cache_that_looks_complete(tmp_path, target, sources, monkeypatch):
    data = data_config(sources, tmp_path / "cache")
    monkeypatch.setattr(build, "ROWS_PER_CHUNK", 4)
    tokenize = build.ChunkTokenizer.__call__
    calls = []

    def interrupted(self, chunk):
        calls.append(chunk)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return tokenize(self, chunk)

    monkeypatch.setattr(build.ChunkTokenizer, "__call__", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ensure_cache(data, target)
    assert sorted(os.listdir(tmp_path)) == ["sources", "target"]  # no partial directory left
    assert read_manifest(str(tmp_path / "cache")) is None
    monkeypatch.setattr(build.ChunkTokenizer, "__call__", tokenize)
    assert ensure_cache(data, target).num_samples == len(JSONL_RECORDS + PARQUET_RECORDS)


@pytest.mark.slow
def test_tokenizing_on_two_processes_builds_the_same_cache(tmp_path, target, sources):
    one = ensure_cache(data_config(sources, tmp_path / "one"), target)
    two = ensure_cache(data_config(sources, tmp_path / "two", tokenize_processes=2), target)
    assert two.manifest["content_sha256"] == one.manifest["content_sha256"]
    assert two.num_samples == one.num_samples


@pytest.mark.slow
def test_a_cache_dir_holding_someones_files_is_refused_and_left_as_it_was(tmp_path, target, sources):
    """A build replaces its cache directory whole: a directory of other files is refused in one
    line, before anything is built; an empty one is built into."""
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("keep me\n")
    with pytest.raises(DataError, match=rf"^data.cache_dir={theirs} holds notes.txt and is no tokenized cache"):
        ensure_cache(data_config(sources, theirs), target)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".theirs")] == []
    assert (theirs / "notes.txt").read_text() == "keep me\n" and len(list(theirs.iterdir())) == 1
    (tmp_path / "empty").mkdir()
    assert ensure_cache(data_config(sources, tmp_path / "empty"), target).num_samples == len(
        JSONL_RECORDS + PARQUET_RECORDS
    )


def test_prepare_command_builds_the_cache_and_prints_steps(tmp_path, target, sources):
    config = tmp_path / "config.py"
    config.write_text(
        "import dataclasses\n"
        "import ml_collections\n"
        "from support.chat_data import data_config\n"
        "def get_config():\n"
        f"    config = ml_collections.ConfigDict({{'target': {{'path': {target!r}}}}})\n"
        f"    data = data_config({str(sources)!r}, {str(tmp_path / 'cache')!r})\n"
        "    config.data = ml_collections.ConfigDict(dataclasses.asdict(data))\n"
        "    return config\n"
    )
    run = subprocess.run(
        [sys.executable, "-m", "dflash_jax.prepare", f"--config={config}", "--num_epochs=2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert "43 samples" in run.stdout and "steps per epoch (4 x 64): [" in run.stdout
    assert read_manifest(str(tmp_path / "cache"))["num_samples"] == 43
