r"""Rewrite the assistant turns of a conversation dataset with the target's own responses.

The DFlash recipe trains the drafter on what the target itself would answer (temperature 0,
Qwen3 thinking disabled), not on the dataset's original answers.

    # built-in JAX generation, for targets that fit this machine
    python -m dflash_jax.regenerate --input=train.jsonl --output=train_regen.jsonl \
        --target=assets/tiny-qwen3 [--batch_size=8] [--max_new_tokens=2048]

    # a vLLM / SGLang server you run, e.g. `vllm serve Qwen/Qwen3-8B --port 8000`
    python -m dflash_jax.regenerate --input=train.jsonl --output=train_regen.jsonl \
        --backend=http --server_url=http://localhost:8000/v1 [--concurrency=64]

Rows are OpenAI `messages` or ShareGPT `conversations`; each output row is the input row with
`messages` rewritten and `regenerated: {line, finish_reasons}` added. The output is append-only
and the run resumes: rows already in --output are skipped, a line cut by a crash is dropped and
redone. A row that fails (bad input, prompt too long, server error) is appended to
`<output stem>.failures.jsonl` with its error and retried by the next run; the others go on.
Rows are written as they finish, so with --concurrency > 1 their order may differ from the input.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator

from absl import app, flags, logging
from tqdm import tqdm

from dflash_jax.decoding.backends import HttpBackend, JaxBackend
from dflash_jax.decoding.chat import conversation, decode_row, jsonl_lines
from dflash_jax.decoding.sampling import SamplingConfig
from dflash_jax.models.config import DTYPES


def failures_path(output: str) -> str:
    path = Path(output)
    return str(path.with_name(path.stem + ".failures.jsonl"))


def completed_lines(output: str) -> set[int]:
    """Input line numbers already in `output`. Rows are written whole with their newline, so
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
            raise ValueError(f"{output}:{number} is not a regenerated row; is this the right --output?") from None
    return done


def count_rows(path: str) -> int:
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


class Regeneration:
    """Streams the input's pending rows to a back-end and appends each result as it comes."""

    def __init__(self, input_path: str, output: str):
        self.input_path, self.output = input_path, output
        self.records: dict[int, dict] = {}  # in-flight rows, by input line
        self.counts = {"done_before": 0, "regenerated": 0, "failed": 0}

    def run(self, backend, *, limit: int = 0) -> dict:
        done = completed_lines(self.output)
        total = count_rows(self.input_path)
        if limit:  # the bar (and its ETA) covers this run's rows only
            total = min(total, len(done) + limit)
        self.counts["done_before"] = len(done)
        with open(self.output, "a", encoding="utf-8") as self._out, \
                open(failures_path(self.output), "a", encoding="utf-8") as self._failures, \
                tqdm(total=total, initial=min(len(done), total), unit="row", desc="regenerate",
                     dynamic_ncols=True) as self._bar:
            for line, result in backend.run(self._pending(done, limit)):
                self._finish(line, result)
        return self.counts

    def _pending(self, done: set[int], limit: int) -> Iterator[tuple[int, list[dict]]]:
        """(line, messages) of rows to do; rows that are not conversations fail right here."""
        taken = 0
        for line, text in jsonl_lines(self.input_path):
            if line in done:
                continue
            if limit and taken == limit:
                return
            taken += 1
            try:
                record = decode_row(text)
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


def make_backend(f):
    sampling = SamplingConfig(f.temperature, top_p=f.top_p, top_k=f.top_k)
    if f.backend == "http":
        from dflash_jax.decoding.http_client import ChatCompletionsClient

        client = ChatCompletionsClient(f.server_url, model=f.model, api_key=os.environ.get("OPENAI_API_KEY", ""),
                                       timeout=f.request_timeout, retries=f.retries)
        return HttpBackend(client, concurrency=f.concurrency, max_tokens=f.max_new_tokens,
                           temperature=f.temperature, top_p=f.top_p, top_k=f.top_k,
                           enable_thinking=f.enable_thinking, seed=f.seed if f.temperature else None)
    if not f.target:
        raise app.UsageError("--target is required with --backend=jax")
    from dflash_jax.decoding.chat import ChatTokenizer
    from dflash_jax.models.hf import load_target

    target = load_target(f.target, param_dtype=DTYPES[f.dtype], compute_dtype=DTYPES[f.dtype])
    max_prompt_len = f.max_prompt_len or target.cfg.max_position_embeddings - f.max_new_tokens
    if max_prompt_len < 1:
        raise app.UsageError(f"--max_new_tokens={f.max_new_tokens} leaves no room for a prompt")
    return JaxBackend(target, ChatTokenizer(f.target, enable_thinking=f.enable_thinking),
                      max_new_tokens=f.max_new_tokens, batch_size=f.batch_size, sampling=sampling,
                      max_prompt_len=max_prompt_len, seed=f.seed)


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """The CLI's flags; defined when run as a program (tests use their own FlagValues, since
    several CLIs share flag names)."""
    fv = dict(flag_values=flag_values)
    flags.DEFINE_string("input", None, "Conversation JSONL to regenerate.", **fv)
    flags.DEFINE_string("output", None, "Output JSONL (appended to; resumes where it stopped).", **fv)
    flags.DEFINE_enum("backend", "jax", ["jax", "http"], "jax: generate here; http: an OpenAI-compatible server.", **fv)
    flags.DEFINE_string("target", None, "Target directory (jax back-end: weights, tokenizer, chat template).", **fv)
    flags.DEFINE_string("server_url", "http://localhost:8000/v1", "http back-end: base URL of the server.", **fv)
    flags.DEFINE_string("model", "", "http back-end: served model name (default: the server's first model).", **fv)
    flags.DEFINE_integer("concurrency", 16, "http back-end: conversations in flight.", **fv)
    flags.DEFINE_float("request_timeout", 600.0, "http back-end: seconds per request.", **fv)
    flags.DEFINE_integer("retries", 3, "http back-end: retries of transient failures per request.", **fv)
    flags.DEFINE_integer("batch_size", 8, "jax back-end: conversations generated together.", **fv)
    flags.DEFINE_integer("max_prompt_len", 0, "jax back-end: longest prompt (0: the target's context minus max_new_tokens).", **fv)
    flags.DEFINE_enum("dtype", "bfloat16", sorted(DTYPES), "jax back-end: weight and compute dtype.", **fv)
    flags.DEFINE_integer("max_new_tokens", 2048, "Tokens per response at most.", **fv)
    flags.DEFINE_float("temperature", 0.0, "0: greedy, as the DFlash recipe.", **fv)
    flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass (1: off).", **fv)
    flags.DEFINE_integer("top_k", 0, "Top-k sampling (0: off).", **fv)
    flags.DEFINE_bool("enable_thinking", False, "Qwen3 thinking mode (the recipe disables it).", **fv)
    flags.DEFINE_integer("seed", 0, "Sampling seed.", **fv)
    flags.DEFINE_integer("limit", 0, "Regenerate at most this many rows in this run (0: all).", **fv)
    flags.mark_flags_as_required(["input", "output"], **fv)


def main(argv, f: flags.FlagValues = flags.FLAGS):
    del argv
    if not os.path.isfile(f.input):
        raise app.UsageError(f"--input={f.input} is not a file")
    if os.path.abspath(f.input) == os.path.abspath(f.output):
        raise app.UsageError("--output must differ from --input (the output is appended to)")
    counts = Regeneration(f.input, f.output).run(make_backend(f), limit=f.limit)
    print(f"{counts['regenerated']} rows regenerated into {f.output} ({counts['done_before']} were done "
          f"before), {counts['failed']} failed" + (f" (see {failures_path(f.output)})" if counts["failed"] else ""))


if __name__ == "__main__":
    define_flags()
    app.run(main)
