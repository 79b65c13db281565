"""Regenerating a conversation dataset's assistant turns with the target (docs/design.md §3.5).

Streams the input's pending rows (from any source `data.train` takes: `data.sources`) to a
back-end (`decoding.backends`) and appends each result as it finishes. The output is append-only
and resumable: rows already in the output are skipped, a line cut by a crash is dropped and redone.
A row that fails is appended to `<output stem>.failures.jsonl` with its error and retried by the
next run; the others go on. The failures file lists exactly the rows still failing.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from absl import logging
from tqdm import tqdm

from dflash_jax.data.sources import count_rows, iter_chunks, resolve_sources
from dflash_jax.decoding.prompt_sets import conversation, decode_row
from dflash_jax.errors import UserError

ROWS_PER_CHUNK = 1024


def failures_path(output: str) -> str:
    path = Path(output)
    return str(path.with_name(path.stem + ".failures.jsonl"))


def completed_lines(output: str) -> set[int]:
    """Input row numbers already in `output`. Rows are written whole with their newline, so
    text after the last newline is a row cut by a crash: it is removed and its row redone."""
    if not os.path.exists(output):
        return set()
    data = Path(output).read_bytes()
    complete = data.rfind(b"\n") + 1
    if data[complete:].strip():
        logging.warning("%s: dropping an incomplete last line; its row will be redone", output)
    if complete < len(data):
        with open(output, "r+b") as f:
            f.truncate(complete)
    done = set()
    for number, line in enumerate(data[:complete].splitlines(), 1):
        if not line.strip():
            continue
        try:
            done.add(int(json.loads(line)["regenerated"]["line"]))
        except (ValueError, KeyError, TypeError):
            raise UserError(f"{output}:{number} is not a regenerated row; is this the right --output?") from None
    return done


def numbered_rows(paths: list[str]) -> Iterator[tuple[int, object]]:
    """(number, row) of the sources' rows: numbered from 1 over the files in turn, a JSON Lines
    file's rows by line (blank lines count but are not rows), so that the numbers of one JSONL
    input are its line numbers. Rows are raw lines (JSONL) or decoded records."""
    start = 0
    for path in paths:
        end = start
        for chunk in iter_chunks([path], ROWS_PER_CHUNK):
            for i, row in enumerate(chunk.rows):
                if not (isinstance(row, bytes) and not row.strip()):
                    yield start + chunk.first_row + i + 1, row
            end = start + chunk.first_row + len(chunk.rows)
        start = end


def previous_failures(path: str, done: set[int]) -> dict[int, str]:
    """The failure records (JSON lines, by input row) a run left in `path` for rows still not in
    the output; the latest per row. A line cut by a crash is left out."""
    failures = {}
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            for text in f:
                try:
                    line = int(json.loads(text)["line"])
                except (ValueError, KeyError, TypeError):
                    continue
                if line not in done:
                    failures[line] = text if text.endswith("\n") else text + "\n"
    return failures


class Regeneration:
    """Streams the input's pending rows to a back-end and appends each result as it comes.

    The output and failures files are made (with their directory) when their first row is
    written: a run refused before any row leaves no file. When a run ends, however it ends, the
    failures file lists exactly the rows still failing (a row since regenerated is removed; none
    left, no file); a run killed before that leaves extra records, dropped by the next run."""

    def __init__(self, source: str, output: str):
        """Finds the input's files, counts their rows and reads the rows already done, before a
        back-end starts: an input file that cannot be read is a DataError, an output that is not
        a regeneration a UserError."""
        self.paths, self.output = resolve_sources(source), output
        self.total = sum(map(count_rows, self.paths))
        self.done = completed_lines(output)
        self.records: dict[int, dict] = {}  # in-flight rows, by input line
        self.counts = {"done_before": 0, "regenerated": 0, "failed": 0}
        self._files: dict[str, TextIO] = {}  # the output and failures files, once written to
        self._failures: dict[int, str] = {}  # the rows failing, by input line: their failure records

    def run(self, backend, *, limit: int = 0) -> dict:
        done = self.done
        self._failures = previous_failures(failures_path(self.output), done)
        total = self.total
        if limit:  # the bar (and its ETA) covers this run's rows only
            total = min(total, len(done) + limit)
        self.counts["done_before"] = len(done)
        try:
            with (
                contextlib.closing(backend.run(self._pending(done, limit))) as results,
                tqdm(
                    total=total, initial=min(len(done), total), unit="row", desc="regenerate", dynamic_ncols=True
                ) as self._bar,
            ):
                for line, result in results:
                    self._finish(line, result)
        finally:
            for f in self._files.values():
                f.close()
            self._rewrite_failures()
        return self.counts

    def _pending(self, done: set[int], limit: int) -> Iterator[tuple[int, list[dict]]]:
        """(line, messages) of rows to do; rows that are not conversations fail right here."""
        taken = 0
        for line, row in numbered_rows(self.paths):
            if line in done:
                continue
            if limit and taken == limit:
                return
            taken += 1
            try:
                record = decode_row(row.decode("utf-8", "surrogateescape")) if isinstance(row, bytes) else row
                messages = conversation(record)
            except ValueError as e:
                self._record_failure(line, e)
                continue
            self.records[line] = record
            yield line, messages

    def _append(self, path: str, text: str) -> None:
        """Appends `text` to `path` at once (a crash loses no finished row), opening it first."""
        if path not in self._files:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._files[path] = open(path, "a", encoding="utf-8")
        self._files[path].write(text)
        self._files[path].flush()

    def _finish(self, line: int, result) -> None:
        record = self.records.pop(line)
        if isinstance(result, Exception):
            self._record_failure(line, result)
            return
        out = {k: v for k, v in record.items() if k not in ("messages", "conversations", "regenerated")}
        out["messages"] = result.messages
        out["regenerated"] = {"line": line, "finish_reasons": result.finish_reasons}
        self._append(self.output, json.dumps(out, ensure_ascii=False) + "\n")
        self._failures.pop(line, None)
        self.counts["regenerated"] += 1
        self._bar.update(1)

    def _record_failure(self, line: int, error: Exception) -> None:
        text = json.dumps({"line": line, "error": f"{type(error).__name__}: {error}"}) + "\n"
        self._append(failures_path(self.output), text)
        self._failures[line] = text
        self.counts["failed"] += 1
        self._bar.update(1)
        self._bar.set_postfix(failed=self.counts["failed"])

    def _rewrite_failures(self) -> None:
        """The failures file as the rows still failing, by row, written whole or removed."""
        path = failures_path(self.output)
        if not self._failures:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
            return
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            f.writelines(self._failures[line] for line in sorted(self._failures))
        os.replace(path + ".tmp", path)
