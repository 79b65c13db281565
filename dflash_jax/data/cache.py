"""The tokenized cache on disk: flat token / loss-mask arrays plus sample offsets, read through
memory maps, and a JSON manifest.

    tokens.u32     all samples' token ids, concatenated (uint32)
    loss_mask.u8   1 where the token is trained on (uint8), aligned with tokens
    offsets.npy    int64 [num_samples + 1]: sample i is tokens[offsets[i]:offsets[i+1]]
    samples.npy    per sample (SAMPLE_FIELDS): its source file and row, and its prompt's key
                   (for the held-out split, data/heldout.py); not in the content digest, so
                   caches rebuilt only to add it keep the digest runs resume with
    manifest.json  written last: what the cache was built from, counts, skips by reason

A cache is built in a hidden sibling directory and renamed into place, so a directory with a
manifest is always complete. The hidden directory names its builder (host name and pid, in
`builder.json`); a build that was killed leaves it behind, and the next build of the same cache
removes it once its builder is gone (same host, pid no longer running) or it is a day old.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import socket
import time
import uuid

import numpy as np

from dflash_jax.errors import DataError, some_of

MANIFEST = "manifest.json"
TOKENS = "tokens.u32"
LOSS_MASK = "loss_mask.u8"
OFFSETS = "offsets.npy"
SAMPLES = "samples.npy"
COUNT_CHUNK = 1 << 26  # tokens read at once when counting them
# source: index into the manifest's inputs.sources; row: 0-based line (JSON Lines) or row
# (Parquet) in it; prompt_key: `heldout.prompt_key` of its prompt, when has_prompt.
SAMPLE_FIELDS = np.dtype([("source", "<u4"), ("row", "<i8"), ("prompt_key", "<u8"), ("has_prompt", "?")])
BUILDER = "builder.json"
# A partial directory this old is abandoned whoever built it (its builder may be on another host).
ABANDONED_AFTER_S = 24 * 3600


def _writing(fn):
    """Turns an OSError while writing the cache (a read-only or full disk) into a `DataError`."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except OSError as e:
            where = e.filename or getattr(args[0] if args else None, "directory", None) or "the tokenized cache"
            raise DataError(
                f"cannot write {where}: {e.strerror or e}; set data.cache_dir to a writable place with free space"
            ) from None

    return wrapper


class CacheWriter:
    """Appends samples to a cache directory under construction."""

    @_writing
    def __init__(self, directory: str):
        self.directory = directory
        self._tokens = open(os.path.join(directory, TOKENS), "wb")
        self._mask = open(os.path.join(directory, LOSS_MASK), "wb")
        self._lengths: list[np.ndarray] = []
        self._samples: list[np.ndarray] = []
        self._digest = hashlib.sha256()

    @_writing
    def add(self, tokens: np.ndarray, loss_mask: np.ndarray, lengths: np.ndarray, samples: np.ndarray | None = None):
        """Appends samples given concatenated, with their lengths (and `SAMPLE_FIELDS` of each)."""
        tokens, loss_mask = tokens.astype(np.uint32), loss_mask.astype(np.uint8)
        for array, f in ((tokens, self._tokens), (loss_mask, self._mask)):
            f.write(array.tobytes())
            self._digest.update(array.tobytes())
        self._lengths.append(np.asarray(lengths, np.int64))
        if samples is not None:
            self._samples.append(np.asarray(samples, SAMPLE_FIELDS))

    @property
    def lengths(self) -> np.ndarray:
        """Lengths of the samples added so far."""
        return np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int64)

    @_writing
    def finish(self, manifest: dict) -> dict:
        """Writes offsets, then the manifest (last, so it marks the directory complete)."""
        self._tokens.close()
        self._mask.close()
        offsets = np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int64)
        np.save(os.path.join(self.directory, OFFSETS), offsets)
        self._digest.update(offsets.tobytes())
        if self._samples:
            samples = np.concatenate(self._samples)
            if len(samples) != len(offsets) - 1:
                raise ValueError(f"{len(samples)} sample records for {len(offsets) - 1} samples")
            np.save(os.path.join(self.directory, SAMPLES), samples)
        manifest = {**manifest, "content_sha256": self._digest.hexdigest(), "complete": True}
        write_json_atomically(os.path.join(self.directory, MANIFEST), manifest)
        return manifest

    def abort(self) -> None:
        self._tokens.close()
        self._mask.close()


class TokenizedCache:
    """Read-only view of a complete cache directory; samples are memory-mapped, not loaded."""

    def __init__(self, directory: str):
        manifest = read_manifest(directory)
        if manifest is None:
            raise FileNotFoundError(f"{directory} holds no complete tokenized cache")
        self.directory = directory
        self.manifest = manifest
        self.offsets = np.load(os.path.join(directory, OFFSETS))
        self.lengths = np.diff(self.offsets)
        self.tokens = np.memmap(os.path.join(directory, TOKENS), np.uint32, mode="r")
        self.loss_mask = np.memmap(os.path.join(directory, LOSS_MASK), np.uint8, mode="r")
        samples = os.path.join(directory, SAMPLES)
        # None in caches written without it (by hand, in tests): they cannot hold rows out.
        self.samples = np.load(samples) if os.path.isfile(samples) else None

    @property
    def num_samples(self) -> int:
        return len(self.lengths)

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        start, end = self.offsets[i], self.offsets[i + 1]
        return self.tokens[start:end], self.loss_mask[start:end]

    def trained_token_counts(self, vocab_size: int, leave_out: np.ndarray) -> np.ndarray:
        """How often each token id is trained on (loss mask 1) in every sample but `leave_out`:
        counts [vocab_size], the cache read in chunks."""
        counts = np.zeros(vocab_size, np.int64)
        for start in range(0, len(self.tokens), COUNT_CHUNK):
            tokens, mask = self.tokens[start : start + COUNT_CHUNK], self.loss_mask[start : start + COUNT_CHUNK]
            counts += np.bincount(tokens[mask.astype(bool)], minlength=vocab_size)[:vocab_size]
        for i in leave_out:
            tokens, mask = self.sample(i)
            counts -= np.bincount(tokens[mask.astype(bool)], minlength=vocab_size)[:vocab_size]
        return counts


def read_manifest(directory: str) -> dict | None:
    """The manifest of a complete cache in `directory`, else None."""
    try:
        with open(os.path.join(directory, MANIFEST)) as f:
            manifest = json.load(f)
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):
        return None
    return manifest if manifest.get("complete") else None


def check_replaceable(directory: str) -> None:
    """A build replaces its cache directory whole (`publish`): refuses, in one line, one that holds
    anything and is no tokenized cache (someone's files), which the build would delete."""
    held = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
    if held and MANIFEST not in held:
        raise DataError(
            f"data.cache_dir={directory} holds {some_of(held)} and is no tokenized cache, which a build would "
            "replace whole: name a new or empty directory ('' for one under ~/.cache/dflash_jax)"
        )


@_writing
def new_partial_dir(final_dir: str) -> str:
    """A fresh hidden directory beside `final_dir` to build into, marked with its builder."""
    parent, name = os.path.split(os.path.abspath(final_dir))
    os.makedirs(parent, exist_ok=True)
    partial = os.path.join(parent, f"{_partial_prefix(name)}{uuid.uuid4().hex[:8]}")
    os.mkdir(partial)
    builder = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
    with open(os.path.join(partial, BUILDER), "w") as f:
        json.dump(builder, f)
    return partial


def remove_abandoned_partials(final_dir: str) -> list[str]:
    """Removes the partial directories of `final_dir` whose builder is gone: on this host with
    a pid that no longer runs, or older than `ABANDONED_AFTER_S` (one without a readable
    `builder.json` counts by its modification time). Returns what it removed, described."""
    parent, name = os.path.split(os.path.abspath(final_dir))
    try:
        entries = os.listdir(parent)
    except OSError:
        return []
    removed = []
    for entry in sorted(entries):
        if not entry.startswith(_partial_prefix(name)):
            continue
        path = os.path.join(parent, entry)
        why = _abandoned(path)
        if why:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(f"{entry} ({why})")
    return removed


def _abandoned(path: str) -> str | None:
    """Why the partial directory at `path` is abandoned, or None if its builder may still run."""
    try:
        with open(os.path.join(path, BUILDER)) as f:
            builder = json.load(f)
        host, pid, started = str(builder["host"]), int(builder["pid"]), float(builder["started"])
    except (OSError, ValueError, KeyError, TypeError):
        host, pid = None, None
        try:
            started = os.path.getmtime(path)
        except OSError:
            return None
    if time.time() - started > ABANDONED_AFTER_S:
        return f"started {(time.time() - started) / 3600:.0f} h ago"
    if host == socket.gethostname() and pid != os.getpid() and not _running(pid):
        return f"its builder, pid {pid} on this host, is no longer running"
    return None


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _partial_prefix(name: str) -> str:
    return f".{name}.partial-"


@_writing
def publish(partial_dir: str, final_dir: str) -> None:
    """Moves a finished cache into place, replacing a stale one; never leaves a half state
    that looks complete (at worst, no cache at all)."""
    try:
        os.remove(os.path.join(partial_dir, BUILDER))
    except FileNotFoundError:
        pass
    stale = None
    if os.path.exists(final_dir):
        stale = f"{partial_dir}.stale"
        os.rename(final_dir, stale)
    try:
        os.rename(partial_dir, final_dir)
    except OSError:
        # Another process published first (shared filesystem): keep theirs if it is complete.
        if read_manifest(final_dir) is None:
            raise
        shutil.rmtree(partial_dir, ignore_errors=True)
    if stale:
        shutil.rmtree(stale, ignore_errors=True)


def write_json_atomically(path: str, obj: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
