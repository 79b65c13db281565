"""A Hugging Face hub cache on disk, laid out as huggingface_hub lays it out, without a network.

    <cache>/models--org--name/blobs/<sha256>                 file contents
    <cache>/models--org--name/snapshots/<commit>/<path>      -> ../../blobs/<sha256> (symlinks)
    <cache>/models--org--name/refs/<branch or tag>           the commit it points at

(datasets--org--name for datasets.) `use_hub_cache` points huggingface_hub at one, offline: the
HF_HUB_CACHE and HF_HUB_OFFLINE variables for processes started later, and the values
huggingface_hub read from them when it was imported, for this one.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def add_to_hub_cache(
    cache: Path,
    repo_id: str,
    files: dict[str, bytes],
    *,
    repo_type: str = "model",
    ref: str = "main",
    commit: str | None = None,
) -> Path:
    """Stores `files` (path in the repository -> contents) as the snapshot of `commit` (default:
    a hash of the contents), which `ref` points at; returns the snapshot directory."""
    repo = Path(cache) / f"{repo_type}s--{repo_id.replace('/', '--')}"
    commit = commit or hashlib.sha1(repr(sorted(files.items())).encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    for name, content in files.items():
        blob = repo / "blobs" / hashlib.sha256(content).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(content)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return snapshot


def directory_files(directory: Path) -> dict[str, bytes]:
    """Every file below `directory`, by its path relative to it, for `add_to_hub_cache`."""
    directory = Path(directory)
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def use_hub_cache(monkeypatch, cache: Path) -> None:
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
