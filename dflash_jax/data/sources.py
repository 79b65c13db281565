"""Finding the source files and streaming their rows in chunks, never the whole file at once.

Sources are local files, directories and globs, files of a Hugging Face dataset
(`hf://datasets/org/name[@revision]/<glob>`, found through the hub cache: `models.hub`), or a
data set by name (`ultrachat`, `sharegpt`, ...: `presets`). A `.json` file (one JSON array of
rows, as ShareGPT publishes it) is read whole, and only when named, never from a directory.

A problem with a whole file (missing, unreadable, not JSON Lines, not UTF-8 by its byte-order
mark, damaged Parquet) is a `DataError` naming the file; a problem with one row is the row's
(see `formats`), counted or reported with its 1-based line (JSONL) or 0-based row (Parquet).
"""

from __future__ import annotations

import dataclasses
import difflib
import glob
import json
import os
import pathlib
from collections.abc import Iterator
from typing import Any, BinaryIO

import pyarrow as pa
import pyarrow.parquet as pq

from dflash_jax.data.formats import FORMATS, UTF8_BOM, a_json_type, decode_json_line
from dflash_jax.data.presets import PRESETS
from dflash_jax.errors import DataError
from dflash_jax.models.formats.hub import HF_DATASETS, resolve_dataset_files

SOURCE_SUFFIXES = (".jsonl", ".parquet")
JSON_ARRAY = ".json"
_EXPECTED = " or ".join(SOURCE_SUFFIXES)
# What the first bytes of a file that is not UTF-8 JSON Lines say it is (longest mark first).
_MAGIC = (
    (b"\xff\xfe\x00\x00", "the file is UTF-32 (it starts with a UTF-32 byte-order mark); convert it to UTF-8"),
    (b"\x00\x00\xfe\xff", "the file is UTF-32 (it starts with a UTF-32 byte-order mark); convert it to UTF-8"),
    (b"\xff\xfe", "the file is UTF-16 (it starts with a UTF-16 byte-order mark); convert it to UTF-8"),
    (b"\xfe\xff", "the file is UTF-16 (it starts with a UTF-16 byte-order mark); convert it to UTF-8"),
    (b"\x1f\x8b", "the file is gzip-compressed; decompress it first"),
    (b"PAR1", "the file is Parquet, not JSON Lines; name it .parquet"),
)


@dataclasses.dataclass(frozen=True)
class RawChunk:
    """Consecutive rows of one file: raw lines (JSONL, decoded by the worker so that encoding
    errors are counted there) or dicts (Parquet)."""

    path: str
    first_row: int
    rows: list[bytes] | list[dict[str, Any]]
    nbytes: int

    def location(self, i: int) -> str:
        """Where row `i` of this chunk comes from, as a user can open it: `file:line` (1-based)
        for JSON Lines, `file (row n)` (0-based, as pyarrow and pandas count) for Parquet."""
        if _is_jsonl(self.path):
            return f"{self.path}:{self.first_row + i + 1}"
        return f"{self.path} (row {self.first_row + i})"


def resolve_sources(spec: str) -> list[str]:
    """Files named by `spec`: comma-separated files, directories (searched recursively, hidden
    files and directories left out), globs, hub datasets (hf://datasets/...) or preset names (a
    local path of that name comes first). Suffixes match in any case (.JSONL too)."""
    paths: list[str] = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        part = os.path.expanduser(part)
        if part in PRESETS and not os.path.lexists(part):
            part = PRESETS[part].source
        if part.startswith(HF_DATASETS):
            named_json = part.lower().endswith(JSON_ARRAY)
            found = [str(p) for p in resolve_dataset_files(part) if _is_source(p.name, named_json)]
            if not found:
                raise DataError(f"{part}: the dataset files it names hold no {_EXPECTED} file")
        elif os.path.isdir(part):
            found = _files_under(part)
            if not found:
                raise DataError(f"{part}: no {_EXPECTED} file in this directory{_other_files(part)}")
        elif glob.has_magic(part):
            found = []
            for match in sorted(glob.glob(part, recursive=True)):
                if os.path.isdir(match):
                    found.extend(_files_under(match))
                elif os.path.isfile(match) and _is_source(match):
                    found.append(match)
            if not found:
                raise DataError(f"{part}: the pattern matches no {_EXPECTED} file")
        elif os.path.isfile(part):
            if not _is_source(part, named=True):
                raise DataError(f"{part}: unsupported file type (expected {_EXPECTED})")
            found = [part]
        elif os.path.lexists(part):
            raise DataError(f"{part}: not a regular file (a broken link?)")
        else:
            raise DataError(f"data source {part!r} does not exist, nor is it a data set name{_near_names(part)}")
        paths.extend(os.path.abspath(p) for p in found)
    if not paths:
        raise DataError("no data source given (set config.data.train)")
    return paths


def _near_names(name: str) -> str:
    """' (ultrachat, sharegpt, ...); did you mean ultrachat?': the names, and the nearest one to a
    mistyped name (as for a mistyped config field)."""
    closest = difflib.get_close_matches(name.lower(), PRESETS, n=1)
    return f" ({', '.join(PRESETS)})" + (f"; did you mean {closest[0]}?" if closest else "")


def _is_source(path: str, named: bool = False) -> bool:
    """A file of rows; a JSON array only when named itself (a directory's .json files are
    metadata as often as data)."""
    return path.lower().endswith(SOURCE_SUFFIXES + ((JSON_ARRAY,) if named else ()))


def _is_jsonl(path: str) -> bool:
    return path.lower().endswith(".jsonl")


def _files_under(root: str) -> list[str]:
    """Source files below `root`, sorted; hidden ones (.ipynb_checkpoints, .git, our own partial
    caches) are not data."""
    found = []
    for p in pathlib.Path(root).rglob("*"):
        hidden = any(part.startswith(".") for part in p.relative_to(root).parts)
        if not hidden and _is_source(p.name) and p.is_file():
            found.append(str(p))
    return sorted(found)


def _other_files(root: str) -> str:
    """' (it holds 2 other files, e.g. train.json)' for an error message, or ''."""
    others = sorted(p.name for p in pathlib.Path(root).rglob("*") if p.is_file())
    if not others:
        return " (it is empty)"
    return f" (it holds {len(others)} other file{'s' * (len(others) > 1)}, e.g. {others[0]})"


def describe_sources(paths: list[str]) -> list[dict[str, Any]]:
    """What the cache depends on about each file: a changed size or mtime makes it stale."""
    out = []
    for path in paths:
        try:
            st = os.stat(path)
        except OSError as e:
            raise DataError(f"{path}: cannot read the file ({e.strerror})") from None
        out.append({"path": path, "size": st.st_size, "mtime_ns": st.st_mtime_ns})
    return out


def iter_chunks(paths: list[str], rows_per_chunk: int, data_format: str = "auto") -> Iterator[RawChunk]:
    for path in paths:
        if _is_jsonl(path):
            yield from _jsonl_chunks(path, rows_per_chunk)
        elif _is_json_array(path):
            yield from _json_array_chunks(path, rows_per_chunk)
        else:
            yield from _parquet_chunks(path, rows_per_chunk, data_format)


def count_rows(path: str) -> int:
    """The rows of one source file (JSON Lines: its non-blank lines); a file that cannot be read
    as a whole (another encoding or format, damaged Parquet) is a DataError naming it."""
    if _is_jsonl(path):
        with _open_jsonl(path) as f:
            return sum(1 for line in f if line.strip())
    if _is_json_array(path):
        return len(_json_array(path))
    try:
        return pq.ParquetFile(path).metadata.num_rows
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: cannot read the Parquet file: {' '.join(str(e).split())[:300]}") from None


def _is_json_array(path: str) -> bool:
    return path.lower().endswith(JSON_ARRAY)


def _json_array(path: str) -> list[Any]:
    """A `.json` file's rows: it must hold one JSON array (read whole: such files are small
    enough, ShareGPT's is 0.7 GB)."""
    try:
        with open(path, "rb") as f:
            value = json.loads(f.read().removeprefix(UTF8_BOM))
    except OSError as e:
        raise DataError(f"{path}: cannot read the file ({e.strerror})") from None
    except ValueError as e:
        jsonl = isinstance(e, json.JSONDecodeError) and e.msg == "Extra data"
        problem = "it holds several JSON values: JSON Lines? name it .jsonl" if jsonl else f"not valid JSON ({e})"
        raise DataError(f"{path}: {problem}") from None
    if not isinstance(value, list):
        raise DataError(f"{path}: a .json source holds one JSON array of rows, not {a_json_type(value)}")
    return value


def _json_array_chunks(path: str, rows_per_chunk: int) -> Iterator[RawChunk]:
    rows = _json_array(path)
    bytes_per_row = os.path.getsize(path) / max(len(rows), 1)
    for first in range(0, len(rows), rows_per_chunk):
        chunk = rows[first : first + rows_per_chunk]
        yield RawChunk(path, first, chunk, round(len(chunk) * bytes_per_row))


def _open_jsonl(path: str) -> BinaryIO:
    """A JSON Lines file, open for reading, its start checked."""
    try:
        f = open(path, "rb")
    except OSError as e:
        raise DataError(f"{path}: cannot read the file ({e.strerror})") from None
    try:
        check_jsonl_start(path, f)
    except Exception:
        f.close()
        raise
    return f


def _jsonl_chunks(path: str, rows_per_chunk: int) -> Iterator[RawChunk]:
    with _open_jsonl(path) as f:
        first_row, rows, nbytes = 0, [], 0
        for line in f:
            rows.append(line)
            nbytes += len(line)
            if len(rows) == rows_per_chunk:
                yield RawChunk(path, first_row, rows, nbytes)
                first_row, rows, nbytes = first_row + len(rows), [], 0
        if rows:
            yield RawChunk(path, first_row, rows, nbytes)


def check_jsonl_start(path: str, f) -> None:
    """File-level mistakes, told from the first bytes and the first line: another encoding or
    format, or one JSON document (an array, a pretty-printed object) instead of JSON Lines."""
    head = f.read(4)
    f.seek(0)
    for magic, problem in _MAGIC:
        if head.startswith(magic):
            raise DataError(f"{path}: {problem}")
    if len(head) == 4 and (bool(head[0]), bool(head[1]), bool(head[2]), bool(head[3])) in ((1, 0, 1, 0), (0, 1, 0, 1)):
        raise DataError(f"{path}: the file looks like UTF-16 (every other byte is zero); convert it to UTF-8")
    first = b""
    for line in f:
        if line.strip():
            first = line.removeprefix(UTF8_BOM).strip()
            break
    f.seek(0)
    if first == b"{":
        raise DataError(
            f"{path}: the file is one JSON object spread over several lines, not JSON Lines: write one object per line"
        )
    if first.startswith(b"["):
        try:
            value = json.loads(first)
        except ValueError:
            value = None  # the start of an array that goes on over several lines
        if not isinstance(value, list) or not value or all(isinstance(v, dict) for v in value):
            raise DataError(f"{path}: the file is a JSON array, not JSON Lines: write one object per line")


def _parquet_chunks(path: str, rows_per_chunk: int, data_format: str) -> Iterator[RawChunk]:
    try:
        parquet = pq.ParquetFile(path)
        names = set(parquet.schema_arrow.names)
        wanted = _format_columns(data_format)
        columns = [c for c in wanted if c in names]
        if not columns:
            have = ", ".join(sorted(names)[:8]) or "none"
            raise DataError(
                f"{path}: the Parquet file has no {' or '.join(f'`{c}`' for c in wanted)} column (its columns: {have})"
            )
        bytes_per_row = os.path.getsize(path) / max(parquet.metadata.num_rows, 1)
        first_row = 0
        for batch in parquet.iter_batches(batch_size=rows_per_chunk, columns=columns, use_threads=False):
            rows = batch.to_pylist()
            yield RawChunk(path, first_row, rows, round(len(rows) * bytes_per_row))
            first_row += len(rows)
    except (pa.ArrowException, OSError) as e:
        size = os.path.getsize(path) if os.path.isfile(path) else -1
        problem = "the file is empty (0 bytes)" if size == 0 else " ".join(str(e).split())[:300]
        raise DataError(f"{path}: cannot read the Parquet file: {problem}") from None


def _format_columns(data_format: str) -> tuple[str, ...]:
    """The Parquet columns a record of `data_format` may come from."""
    return FORMATS[1:] if data_format == "auto" else (data_format,)


def read_rows(path: str, rows: list[int], data_format: str = "auto") -> list[Any]:
    """The records at 0-based `rows` of one source file (JSON Lines: line index; Parquet: row),
    in the order asked, reading only what holds them: the lines up to the last row asked, the
    Parquet row groups holding a row asked."""
    wanted = sorted(set(rows))
    found: dict[int, Any] = {}
    if _is_json_array(path):
        rows_held = _json_array(path)
        found.update((r, rows_held[r]) for r in wanted if r < len(rows_held))
    elif _is_jsonl(path):
        lines = set(wanted)
        with open(path, "rb") as f:
            for i, line in enumerate(f):
                if i in lines:
                    found[i] = decode_json_line(line)
                if i == wanted[-1]:
                    break
    else:
        parquet = pq.ParquetFile(path)
        columns = [c for c in _format_columns(data_format) if c in parquet.schema_arrow.names]
        start = 0
        for group in range(parquet.num_row_groups):
            size = parquet.metadata.row_group(group).num_rows
            inside = [r for r in wanted if start <= r < start + size]
            if inside:
                table = parquet.read_row_group(group, columns=columns)
                found.update((r, table.slice(r - start, 1).to_pylist()[0]) for r in inside)
            start += size
    missing = [r for r in wanted if r not in found]
    if missing:
        raise DataError(f"{path}: has no row {missing[0]}; it changed since it was tokenized")
    return [found[r] for r in rows]
