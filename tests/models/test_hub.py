"""Hub ids resolve through a populated huggingface_hub cache offline; anything else is one line."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from huggingface_hub import constants

from dflash_jax.data.sources import resolve_sources
from dflash_jax.errors import UserError
from dflash_jax.models.formats import hub as hub_lib
from dflash_jax.models.formats.hub import resolve_dataset_files, resolve_model
from support.hub_cache import add_to_hub_cache, use_hub_cache

MAIN, TAGGED = "a" * 40, "b" * 40
CONFIG = b'{"model_type": "qwen3"}'


@pytest.fixture
def hub(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    add_to_hub_cache(cache, "org/model", {"config.json": CONFIG, "model.safetensors": b"weights"}, commit=MAIN)
    add_to_hub_cache(cache, "org/model", {"config.json": b"{}"}, ref="v1", commit=TAGGED)
    add_to_hub_cache(
        cache,
        "org/chats",
        {"data/train-0.jsonl": b"{}\n", "data/train-1.parquet": b"PAR1", "data/test.jsonl": b"{}\n", "README.md": b""},
        repo_type="dataset",
    )
    use_hub_cache(monkeypatch, cache)
    return cache


def test_model_ids_resolve_to_their_cached_snapshots(hub, tmp_path, monkeypatch):
    snapshots = hub / "models--org--model" / "snapshots"
    assert resolve_model("org/model") == snapshots / MAIN
    assert (resolve_model("org/model") / "config.json").read_bytes() == CONFIG
    assert resolve_model("org/model@v1") == snapshots / TAGGED
    assert resolve_model(f"org/model@{MAIN}") == snapshots / MAIN
    local = tmp_path / "org" / "model"  # a local directory wins over an id that reads the same
    local.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert resolve_model("org/model") == local.relative_to(tmp_path)


@pytest.mark.parametrize(
    "spec, message",
    [
        (
            "org/missing",
            "org/missing: no such directory, and not in the Hugging Face cache ({hub}) while HF_HUB_OFFLINE is set; "
            "fetch it on a machine with network access: hf download org/missing",
        ),
        (
            "org/model@v2",
            "org/model@v2: no such directory, and not in the Hugging Face cache ({hub}) while HF_HUB_OFFLINE is set; "
            "fetch it on a machine with network access: hf download org/model --revision v2",
        ),
        (
            "/no/such/dir",
            "/no/such/dir: no such directory, and not a Hugging Face model id (org/name or org/name@revision)",
        ),
        ("a/b/c", "a/b/c: no such directory, and not a Hugging Face model id (org/name or org/name@revision)"),
    ],
)
def test_what_cannot_be_found_is_one_line_saying_how_to_get_it(hub, spec, message):
    with pytest.raises(UserError) as raised:
        resolve_model(spec)
    assert str(raised.value) == message.format(hub=hub)


def test_dataset_globs_match_files_inside_the_repository(hub):
    snapshot = next((hub / "datasets--org--chats" / "snapshots").iterdir())
    assert resolve_dataset_files("hf://datasets/org/chats/data/train-*") == [
        snapshot / "data/train-0.jsonl",
        snapshot / "data/train-1.parquet",
    ]
    assert len(resolve_dataset_files("hf://datasets/org/chats")) == 4
    assert resolve_sources("hf://datasets/org/chats,hf://datasets/org/chats/data/test.jsonl") == [
        str(snapshot / f) for f in ("data/test.jsonl", "data/train-0.jsonl", "data/train-1.parquet", "data/test.jsonl")
    ]
    with pytest.raises(UserError) as raised:
        resolve_dataset_files("hf://datasets/org/chats/eval/*.jsonl")
    assert str(raised.value).endswith(
        "no file of the cached snapshot of org/chats (4 files) matches 'eval/*.jsonl'; fetch it on a machine with "
        "network access: hf download org/chats --repo-type dataset --include 'eval/*.jsonl'"
    )
    with pytest.raises(UserError, match="hf download org/other --repo-type dataset --include train.jsonl$"):
        resolve_sources("hf://datasets/org/other/train.jsonl")


@pytest.mark.slow
def test_the_environment_variables_alone_point_a_new_process_at_the_cache(hub):
    code = "from dflash_jax.models.formats.hub import resolve_model; print(resolve_model('org/model'))"
    env = {**os.environ, "HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1"}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert run.stdout.strip() == str(hub / "models--org--model" / "snapshots" / MAIN), run.stderr[-2000:]


def test_online_only_what_loading_needs_is_downloaded_and_a_failed_download_falls_back_to_the_cache(hub, monkeypatch):
    cached = hub_lib.snapshot_download
    requests = []

    def flaky_download(repo_id, *, local_files_only, **kwargs):
        requests.append((repo_id, local_files_only, kwargs["allow_patterns"], kwargs["ignore_patterns"]))
        if not local_files_only:
            raise ConnectionResetError("connection reset by peer")
        return cached(repo_id, local_files_only=True, **kwargs)

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hub_lib, "snapshot_download", flaky_download)
    assert resolve_model("org/model").name == MAIN
    assert len(resolve_dataset_files("hf://datasets/org/chats/data/*.jsonl")) == 2
    weights = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt"]
    assert requests == [
        ("org/model", False, weights, ["original/*"]),
        ("org/model", True, weights, ["original/*"]),
        ("org/chats", False, ["data/*.jsonl"], None),
        ("org/chats", True, ["data/*.jsonl"], None),
    ]
    with pytest.raises(UserError) as raised:
        resolve_model("org/absent")
    assert str(raised.value) == (
        "org/absent: no such directory, and not in the Hugging Face cache, and downloading failed "
        "(connection reset by peer)"
    )
