r"""Rewrite the assistant turns of a conversation dataset with the target's own responses.

The DFlash recipe trains the drafter on what the target itself would answer (temperature 0,
Qwen3 thinking disabled), not on the dataset's original answers.

    # built-in JAX generation, for targets that fit this machine
    dflash-jax regenerate --input=train.jsonl --output=train_regen.jsonl \
        --target=assets/tiny-qwen3 [--batch_size=8] [--max_new_tokens=2048]

    # vLLM / SGLang servers you run, e.g. `vllm serve Qwen/Qwen3-8B --port 8000`, one per GPU
    dflash-jax regenerate --input=ultrachat --output=train_regen.jsonl \
        --backend=http --server_url=http://localhost:8000/v1,http://localhost:8001/v1 [--concurrency=64]

--target is the target model: with the jax back-end a model directory or hub id to load, with
the http back-end the name the servers serve it under (default: each server's first model).
--input is any source `data.train` takes: JSONL, Parquet or `.json` array files, directories,
globs, `hf://datasets/ORG/NAME/<glob>` or a data set by name (`data.presets`). Rows are OpenAI
`messages` or ShareGPT `conversations`; each output row is the input row with
`messages` rewritten and `regenerated: {line, finish_reasons}` added (`line`: the row's number,
from 1, over the input's files in turn; a JSONL file's line number). The output is append-only
and the run resumes: rows already in --output are skipped, a line cut by a crash is dropped and
redone. A row that fails (bad input, prompt too long) is appended to
`<output stem>.failures.jsonl` with its error and retried by the next run; the others go on; the
failures file lists exactly the rows still failing. A server that fails by its own errors (nothing
listens, it hangs past --request_timeout, answers HTTP 5xx or something other than JSON) for 3
conversations in a row stops the run in one line, keeping the rows done. --output and its directory
are made when the first row is written. Rows are written as they finish, so with --concurrency > 1
their order may differ from the input.
"""

from __future__ import annotations

import dataclasses
import os

from absl import flags

from dflash_jax import cli
from dflash_jax.data.presets import describe_presets
from dflash_jax.decoding.backends import HttpBackend, JaxBackend, ServerDown
from dflash_jax.decoding.regeneration import Regeneration, failures_path
from dflash_jax.errors import DataError, UserError
from dflash_jax.models.architecture import DTYPES
from dflash_jax.models.formats.hub import resolve_model
from dflash_jax.training.workdir import check_writable

RENAMED_FLAGS = {"model": "target"}
SERVE_EXAMPLE = "vllm serve Qwen/Qwen3-8B --port 8000"


def make_backend(f):
    sampling = cli.sampling_config(f)
    if f.backend == "http":
        return HttpBackend(
            [_server(url, f) for url in f.server_url],
            concurrency=f.concurrency,
            max_tokens=f.max_new_tokens,
            enable_thinking=f.enable_thinking,
            seed=None if sampling.greedy else f.seed,
            **dataclasses.asdict(sampling),  # the chat request's temperature, top_p and top_k
        )
    if not f.target:
        raise UserError("--target is required with --backend=jax: a model directory or hub id (org/name)")
    from dflash_jax.decoding.prompt_sets import ChatTokenizer
    from dflash_jax.models.formats.hf import load_target

    try:
        target_dir = resolve_model(f.target)
    except UserError as e:
        raise UserError(f"--target={e}") from None
    dtype = DTYPES[cli.dtype_flag(f)]
    target = load_target(target_dir, param_dtype=dtype, compute_dtype=dtype)
    max_prompt_len = f.max_prompt_len or target.cfg.max_position_embeddings - f.max_new_tokens
    if max_prompt_len < 1:
        raise UserError(
            f"--max_new_tokens={f.max_new_tokens} leaves no room for a prompt in the target's "
            f"{target.cfg.max_position_embeddings} positions"
        )
    return JaxBackend(
        target,
        ChatTokenizer(target_dir, enable_thinking=f.enable_thinking),
        max_new_tokens=f.max_new_tokens,
        batch_size=f.batch_size,
        sampling=sampling,
        max_prompt_len=max_prompt_len,
        seed=f.seed,
    )


def _server(url: str, f):
    """A client of the server at `url`, which must answer now: without a server every row would
    fail, each after its retries."""
    from dflash_jax.decoding.http_client import ChatCompletionsClient, NotAnApi, RequestError, Unreachable

    try:
        # Without a model name, the client asks the server for its models: it fails here at once.
        client = ChatCompletionsClient(
            url,
            api_key=os.environ.get("OPENAI_API_KEY", ""),
            timeout=f.request_timeout,
            retries=f.retries,
        )
    except Unreachable as e:
        raise UserError(f"--server_url={url}: {e}; start the server first (e.g. `{SERVE_EXAMPLE}`)") from None
    except NotAnApi as e:
        raise UserError(
            f"--server_url={url}: {e}; is it an OpenAI-compatible API's base URL (http://host:port/v1)?"
        ) from None
    except RequestError as e:
        raise UserError(f"--server_url={url}: {e}") from None
    if f.target:
        client.model = f.target
    return client


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    fv = dict(flag_values=flag_values)
    flags.DEFINE_string(
        "input",
        None,
        "Conversations to regenerate: any source data.train takes (files, directories, globs, "
        f"hf://datasets/ORG/NAME/<glob>) or a data set by name: {describe_presets()}.",
        **fv,
    )
    flags.DEFINE_string("output", None, "Output JSONL (appended to; resumes where it stopped).", **fv)
    flags.DEFINE_enum("backend", "jax", ["jax", "http"], "jax: generate here; http: an OpenAI-compatible server.", **fv)
    flags.DEFINE_string(
        "target",
        None,
        "The target: jax back-end, a model directory, .gguf file or hub id org/name[@revision]; http back-end, the "
        "served model name (default: the server's first model).",
        **fv,
    )
    flags.DEFINE_list(
        "server_url",
        ["http://localhost:8000/v1"],
        "http back-end: base URLs of the servers, comma-separated (one per GPU, say); rows go to the least busy.",
        **fv,
    )
    flags.DEFINE_integer("concurrency", 16, "http back-end: conversations in flight per server.", lower_bound=1, **fv)
    flags.DEFINE_float("request_timeout", 600.0, "http back-end: seconds per request.", lower_bound=0, **fv)
    flags.DEFINE_integer("retries", 3, "http back-end: retries of transient failures per request.", lower_bound=0, **fv)
    flags.DEFINE_integer("batch_size", 8, "jax back-end: conversations generated together.", lower_bound=1, **fv)
    flags.DEFINE_integer(
        "max_prompt_len",
        0,
        "jax back-end: longest prompt (0: the target's context minus max_new_tokens).",
        lower_bound=0,
        **fv,
    )
    cli.define_dtype_flag("jax back-end: weight and compute dtype", sorted(DTYPES), flag_values)
    flags.DEFINE_integer("max_new_tokens", 2048, "Tokens per response at most.", lower_bound=1, **fv)
    cli.define_sampling_flags("0: greedy, as the DFlash recipe.", flag_values)
    flags.DEFINE_bool("enable_thinking", False, "Qwen3 thinking mode (the recipe disables it).", **fv)
    flags.DEFINE_integer("limit", 0, "At most this many rows regenerated in this run (0: all).", lower_bound=0, **fv)
    flags.mark_flags_as_required(["input", "output"], **fv)


def main(argv, f: flags.FlagValues = flags.FLAGS):
    del argv
    if os.path.abspath(f.output) == os.path.abspath(f.input):
        raise UserError(f"--output={f.output} must differ from --input: the output is appended to")
    # Both before the back-end loads a model or asks a server.
    check_writable(f.output, "--output", directory=False)
    try:
        regeneration = Regeneration(f.input, f.output)
    except DataError as e:
        raise UserError(f"--input={f.input}: {e}") from None
    backend = make_backend(f)
    try:
        counts = regeneration.run(backend, limit=f.limit)
    except ServerDown as e:
        done = regeneration.counts["regenerated"]
        raise UserError(
            f"--server_url={e.url}: stopped: {e}; {done} rows regenerated into {f.output} in this run, "
            "rerun the same command to go on"
        ) from None
    print(
        f"{counts['regenerated']} rows regenerated into {f.output} ({counts['done_before']} done "
        f"before), {counts['failed']} failed" + (f" (see {failures_path(f.output)})" if counts["failed"] else "")
    )


def run() -> None:
    """The command: `dflash-jax regenerate`, or `python -m dflash_jax.regenerate`."""
    cli.run(main, define_flags, renamed=RENAMED_FLAGS)


if __name__ == "__main__":
    run()
