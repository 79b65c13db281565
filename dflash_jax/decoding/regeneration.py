"""Regenerating a conversation dataset's assistant turns with the target (docs/design.md §3.5).

Streams the input's pending rows (from any source `data.train` takes: `data.sources`) to a
back-end (`decoding.backends`) and appends each result as it finishes. The output is append-only
and resumable: rows already in the output are skipped, a line cut by a crash is dropped and redone.
A row that fails is appended to `<output stem>.failures.jsonl` with its error and retried by the
next run; the others go on.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

from absl import logging
from tqdm import tqdm

from dflash_jax.data.sources import count_rows, iter_chunks, resolve_sources
from dflash_jax.decoding.prompt_sets import conversation, decode_row
from dflash_jax.errors import DataError

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
            raise DataError(f"{output}:{number} is not a regenerated row; is this the right --output?") from None
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


class Regeneration:
    """Streams the input's pending rows to a back-end and appends each result as it comes."""

    def __init__(self, source: str, output: str):
        self.paths, self.output = resolve_sources(source), output
        self.records: dict[int, dict] = {}  # in-flight rows, by input line
        self.counts = {"done_before": 0, "regenerated": 0, "failed": 0}

    def run(self, backend, *, limit: int = 0) -> dict:
        done = completed_lines(self.output)
        total = sum(map(count_rows, self.paths))
        if limit:  # the bar (and its ETA) covers this run's rows only
            total = min(total, len(done) + limit)
        self.counts["done_before"] = len(done)
        with (
            open(self.output, "a", encoding="utf-8") as self._out,
            open(failures_path(self.output), "a", encoding="utf-8") as self._failures,
            tqdm(
                total=total, initial=min(len(done), total), unit="row", desc="regenerate", dynamic_ncols=True
            ) as self._bar,
        ):
            for line, result in backend.run(self._pending(done, limit)):
                self._finish(line, result)
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

    def _finish(self, line: int, result) -> None:
        record = self.records.pop(line)
        if isinstance(result, Exception):
            self._record_failure(line, result)
            return
        out = {k: v for k, v in record.items() if k not in ("messages", "conversations", "regenerated")}
        out["messages"] = result.messages
        out["regenerated"] = {"line": line, "finish_reasons": result.finish_reasons}
        self._out.write(json.dumps(out, ensure_ascii=False) + "\n")
        self._out.flush()
        self.counts["regenerated"] += 1
        self._bar.update(1)

    def _record_failure(self, line: int, error: Exception) -> None:
        self._failures.write(json.dumps({"line": line, "error": f"{type(error).__name__}: {error}"}) + "\n")
        self._failures.flush()
        self.counts["failed"] += 1
        self._bar.update(1)
        self._bar.set_postfix(failed=self.counts["failed"])
