"""Data sets by name: each preset finds its split's files in the hub cache, in the layout its
dataset card publishes, and every row becomes a conversation; offline, in a fake hub cache."""

from __future__ import annotations

import pytest

from dflash_jax.data.build import ensure_cache
from dflash_jax.data.formats import Conversation, normalize_record
from dflash_jax.data.presets import PRESETS
from dflash_jax.data.sources import count_rows, iter_chunks, resolve_sources
from dflash_jax.errors import DataError
from support.chat_data import TOOL_REFUSING_TEMPLATE, data_config, write_tiny_target
from support.hub_cache import use_hub_cache
from support.preset_files import add_published_datasets, published_files


@pytest.fixture
def hub(tmp_path, monkeypatch):
    use_hub_cache(monkeypatch, tmp_path / "hub")
    return add_published_datasets(tmp_path / "hub")


def test_every_preset_has_a_published_layout_here():
    assert set(published_files()) <= set(PRESETS)
    assert {p.repo_id for p in PRESETS.values()} == {repo for repo, _, _ in published_files().values()}


@pytest.mark.parametrize("name", sorted(published_files()))
def test_a_preset_reads_its_split_as_conversations(hub, name, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # no local file of the preset's name
    paths = resolve_sources(name)
    records = [row for chunk in iter_chunks(paths, 2) for row in chunk.rows]
    assert sum(map(count_rows, paths)) == len(records)
    samples = [normalize_record(record, PRESETS[name].data_format) for record in records]
    assert all(isinstance(s, Conversation) for s in samples)
    questions = [next(m["content"] for m in s.messages if m["role"] == "user") for s in samples]
    assert questions == hub[name]  # that split's rows, in order, and no other split's
    assert [m["role"] for m in samples[0].messages][-2:] == ["user", "assistant"]
    # The same files by their hub address.
    assert resolve_sources(PRESETS[name].source) == paths


def test_a_local_path_comes_before_a_preset_of_its_name(hub, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ultrachat").mkdir()
    (tmp_path / "ultrachat" / "mine.jsonl").write_text('{"text": "x"}\n')
    assert resolve_sources("ultrachat") == [str(tmp_path / "ultrachat" / "mine.jsonl")]


def test_json_array_files_are_read_only_when_named(tmp_path):
    (tmp_path / "rows.json").write_text('[{"text": "a"}, {"text": "b"}]')
    (tmp_path / "rows.jsonl").write_text('{"text": "c"}\n')
    assert resolve_sources(str(tmp_path)) == [str(tmp_path / "rows.jsonl")]  # a directory's .json: metadata
    assert [r for c in iter_chunks(resolve_sources(str(tmp_path / "rows.json")), 8) for r in c.rows] == [
        {"text": "a"},
        {"text": "b"},
    ]
    (tmp_path / "lines.json").write_text('{"text": "a"}\n{"text": "b"}\n')
    with pytest.raises(DataError, match=r"lines.json: it holds several JSON values: JSON Lines\? name it .jsonl"):
        list(iter_chunks([str(tmp_path / "lines.json")], 8))
    (tmp_path / "object.json").write_text('{"text": "a"}')
    with pytest.raises(DataError, match="object.json: a .json source holds one JSON array of rows, not an object"):
        list(iter_chunks([str(tmp_path / "object.json")], 8))


def test_an_unknown_name_lists_the_presets(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        DataError, match="data source 'ultrachat2' does not exist, nor is it a data set name .*ultrachat, sharegpt"
    ):
        resolve_sources("ultrachat2")


def test_the_tokenized_cache_is_built_from_presets_by_name(hub, monkeypatch, tmp_path):
    """What `prepare` and training do with `data.train=sharegpt,nemotron-v2-chat`."""
    monkeypatch.chdir(tmp_path)
    target = str(write_tiny_target(tmp_path / "target", TOOL_REFUSING_TEMPLATE))
    cache = ensure_cache(data_config("sharegpt,nemotron-v2-chat", tmp_path / "cache", seq_len=128), target)
    assert cache.manifest["num_samples"] == len(hub["sharegpt"]) + len(hub["nemotron-v2-chat"])
