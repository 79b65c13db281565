"""Finding the source files and streaming their rows in chunks, never the whole file at once."""

from __future__ import annotations

import dataclasses
import glob
import os
import pathlib
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

SOURCE_SUFFIXES = (".jsonl", ".parquet")


@dataclasses.dataclass(frozen=True)
class RawChunk:
    """Consecutive rows of one file: raw lines (JSONL, decoded by the worker so that encoding
    errors are counted there) or dicts (Parquet)."""

    path: str
    first_row: int
    rows: list[bytes] | list[dict[str, Any]]
    nbytes: int

    def location(self, i: int) -> str:
        """Where row `i` of this chunk comes from, as a user can open it."""
        if self.path.endswith(".jsonl"):
            return f"{self.path}:{self.first_row + i + 1}"
        return f"{self.path} (row {self.first_row + i})"


def resolve_sources(spec: str) -> list[str]:
    """Files named by `spec`: comma-separated files, directories (searched recursively) or globs."""
    paths: list[str] = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        part = os.path.expanduser(part)
        if os.path.isdir(part):
            found = sorted(str(p) for p in pathlib.Path(part).rglob("*") if p.suffix in SOURCE_SUFFIXES)
        elif glob.has_magic(part):
            found = sorted(p for p in glob.glob(part, recursive=True) if p.endswith(SOURCE_SUFFIXES))
        elif os.path.isfile(part):
            if not part.endswith(SOURCE_SUFFIXES):
                raise ValueError(f"{part}: unsupported file type (expected {' or '.join(SOURCE_SUFFIXES)})")
            found = [part]
        else:
            raise FileNotFoundError(f"data source {part!r} does not exist")
        if not found:
            raise FileNotFoundError(f"no {' or '.join(SOURCE_SUFFIXES)} files in {part!r}")
        paths.extend(os.path.abspath(p) for p in found)
    if not paths:
        raise ValueError("no data source given (set config.data.train)")
    return paths


def describe_sources(paths: list[str]) -> list[dict[str, Any]]:
    """What the cache depends on about each file: a changed size or mtime makes it stale."""
    out = []
    for path in paths:
        st = os.stat(path)
        out.append({"path": path, "size": st.st_size, "mtime_ns": st.st_mtime_ns})
    return out


def iter_chunks(paths: list[str], rows_per_chunk: int) -> Iterator[RawChunk]:
    for path in paths:
        reader = _jsonl_chunks if path.endswith(".jsonl") else _parquet_chunks
        yield from reader(path, rows_per_chunk)


def _jsonl_chunks(path: str, rows_per_chunk: int) -> Iterator[RawChunk]:
    with open(path, "rb") as f:
        first_row, rows, nbytes = 0, [], 0
        for line in f:
            rows.append(line)
            nbytes += len(line)
            if len(rows) == rows_per_chunk:
                yield RawChunk(path, first_row, rows, nbytes)
                first_row, rows, nbytes = first_row + len(rows), [], 0
        if rows:
            yield RawChunk(path, first_row, rows, nbytes)


def _parquet_chunks(path: str, rows_per_chunk: int) -> Iterator[RawChunk]:
    try:
        parquet = pq.ParquetFile(path)
        bytes_per_row = os.path.getsize(path) / max(parquet.metadata.num_rows, 1)
        first_row = 0
        for batch in parquet.iter_batches(batch_size=rows_per_chunk, use_threads=False):
            rows = batch.to_pylist()
            yield RawChunk(path, first_row, rows, round(len(rows) * bytes_per_row))
            first_row += len(rows)
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{path}: cannot read Parquet file: {e}") from e
