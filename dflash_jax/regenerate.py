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

import os

from absl import app, flags

from dflash_jax import cli
from dflash_jax.decoding.backends import HttpBackend, JaxBackend
from dflash_jax.decoding.regeneration import Regeneration, failures_path
from dflash_jax.decoding.sampling import SamplingConfig
from dflash_jax.models.config import DTYPES


def make_backend(f):
    sampling = SamplingConfig(f.temperature, top_p=f.top_p, top_k=f.top_k)
    if f.backend == "http":
        from dflash_jax.decoding.http_client import ChatCompletionsClient

        client = ChatCompletionsClient(
            f.server_url,
            model=f.model,
            api_key=os.environ.get("OPENAI_API_KEY", ""),
            timeout=f.request_timeout,
            retries=f.retries,
        )
        return HttpBackend(
            client,
            concurrency=f.concurrency,
            max_tokens=f.max_new_tokens,
            temperature=f.temperature,
            top_p=f.top_p,
            top_k=f.top_k,
            enable_thinking=f.enable_thinking,
            seed=f.seed if f.temperature else None,
        )
    if not f.target:
        raise app.UsageError("--target is required with --backend=jax")
    from dflash_jax.decoding.chat import ChatTokenizer
    from dflash_jax.models.hf import load_target

    target = load_target(f.target, param_dtype=DTYPES[f.dtype], compute_dtype=DTYPES[f.dtype])
    max_prompt_len = f.max_prompt_len or target.cfg.max_position_embeddings - f.max_new_tokens
    if max_prompt_len < 1:
        raise app.UsageError(f"--max_new_tokens={f.max_new_tokens} leaves no room for a prompt")
    return JaxBackend(
        target,
        ChatTokenizer(f.target, enable_thinking=f.enable_thinking),
        max_new_tokens=f.max_new_tokens,
        batch_size=f.batch_size,
        sampling=sampling,
        max_prompt_len=max_prompt_len,
        seed=f.seed,
    )


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
    flags.DEFINE_integer(
        "max_prompt_len", 0, "jax back-end: longest prompt (0: the target's context minus max_new_tokens).", **fv
    )
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
    print(
        f"{counts['regenerated']} rows regenerated into {f.output} ({counts['done_before']} were done "
        f"before), {counts['failed']} failed" + (f" (see {failures_path(f.output)})" if counts["failed"] else "")
    )


if __name__ == "__main__":
    define_flags()
    cli.run(main)
