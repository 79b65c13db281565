r"""Measure a DFlash drafter as a serving engine would: acceptance length and speed-up.

    dflash-jax evaluate --drafter=runs/default [--prompts=heldout_prompts,my_prompts.jsonl] \
        [--limit=32] [--max_new_tokens=256] [--batch_size=1] [--temperature=0] [--output=eval_results]
    dflash-jax evaluate --target=Qwen/Qwen3-8B --drafter=z-lab/Qwen3-8B-DFlash-b16 \
        --prompts=gsm8k,math500,humaneval,mbpp,mt-bench

--drafter is an export directory or hub id (ours or a released DFlash drafter) or a training
workdir (latest checkpoint, or --step). --target is a Hugging Face model directory or hub id
(org/name[@revision], from the hub cache: HF_HUB_OFFLINE=1 works once it is there); it may be left
out when --drafter is a training workdir or an export inside one: the run's checkpoint names its
target. --prompts lists bundled held-out sets (heldout_prompts, stdlib_heldout), JSONL files of
chat rows, and the standard benchmarks gsm8k, math500, humaneval, mbpp and mt-bench (multi-turn),
read from the hub cache in their published formats, or NAME=PATH for a local copy of one (e.g.
gsm8k=test-00000-of-00001.parquet). For every set, the same prompts are decoded by DFlash
speculative decoding and by the target alone (block size 1), after compiling both, and the run
reports τ (mean acceptance length), its histogram, per-slot acceptance rates, tokens/s, time per
output token and the speed ratio: a table on the terminal, `eval.json` and `eval.png` in
--output. --draft_vocab=N drafts among the N tokens the drafter's training used most (its
token_frequencies.json): on a CPU with a large vocabulary the drafter's LM head is most of its
step; the target still verifies over every token, so decoding stays lossless.

--engine=llama.cpp or --engine=vllm also serves the same prompts (each row's first turn, as token
ids, one at a time, greedy) with that engine's server on 127.0.0.1, alone and with the drafter
(decoding/engines/), and prints the engine's τ, drafting steps, drafted and accepted tokens,
speed with and without the drafter, whether its texts equal the target alone's, and what a step
costs in the engine, beside ours (eval.json: "engine"). A server that fails, dies or hangs
(--engine_timeout a request) ends the run in one line, its processes stopped.

llama.cpp: `llama-server` (decoding/engines/llama_cpp.py finds it; `dflash-jax install-llama-cpp`
builds it) on the GGUF --target (a Qwen3 one written as `<output>/target.gguf`; with
--engine_weights=float32 its tensors dequantized, `<output>/target.float32.gguf`), the drafter
converted to GGUF (`<output>/drafter.gguf`; with --draft_vocab, llama.cpp's reduced draft
vocabulary of the same tokens); what a step costs splits into its verify forward, timed alone,
and its drafter.

vLLM: --vllm_python's, $DFLASH_JAX_VLLM_PYTHON's (a vLLM of yours: on a GPU machine, say) or the
CPU build `dflash-jax install-vllm` installs (decoding/engines/vllm.py), serving the Hugging Face
--target (a GGUF one dequantized to float32 into `<output>/target.hf`: vLLM's CPU build loads no
GGUF) in --dtype, with the drafter export as its speculative model (`"method"` the kind's,
`num_speculative_tokens` the drafts a block proposes); a kind the engine cannot serve is refused
in one line before anything starts.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path

from absl import flags

from dflash_jax import cli
from dflash_jax.decoding import report
from dflash_jax.decoding.draft_vocab import draft_token_ids
from dflash_jax.decoding.engines.llama_cpp import require_server
from dflash_jax.decoding.engines.llama_server import Drafting, LlamaServer
from dflash_jax.decoding.engines.server import EngineServer, evaluate_engine
from dflash_jax.decoding.engines.vllm import require_env
from dflash_jax.decoding.engines.vllm_server import VllmServer, hf_target, vllm_drafting
from dflash_jax.decoding.measurement import write_outputs
from dflash_jax.decoding.prompt_sets import ChatTokenizer, load_prompt_set
from dflash_jax.decoding.report import engine_table
from dflash_jax.decoding.speculative import check_fits
from dflash_jax.errors import UserError
from dflash_jax.models import families
from dflash_jax.models.architecture import DTYPES
from dflash_jax.models.formats.gguf_export import llama_cpp_problems
from dflash_jax.models.formats.gguf_target import served_gguf, widened_gguf
from dflash_jax.models.formats.hf import read_config
from dflash_jax.models.formats.hub import resolve_model
from dflash_jax.training.acceptance_eval import run_evaluation
from dflash_jax.training.drafters import any_drafter_config, is_export_dir, run_meta
from dflash_jax.training.workdir import Workdir, check_writable

ENGINES = ["llama.cpp", "vllm"]
ENGINE_WEIGHTS = ("file", "float32")
RENAMED_FLAGS = {"drafter_step": "step", "num_prompts": "limit", "out_dir": "output"}


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    fv = dict(flag_values=flag_values)
    flags.DEFINE_string(
        "target",
        None,
        "Hugging Face target directory, .gguf file or hub id org/name[@revision] (weights, tokenizer); "
        "default: the target named by --drafter's training run.",
        **fv,
    )
    flags.DEFINE_string("drafter", None, "Drafter export directory or hub id, or a training workdir.", **fv)
    flags.DEFINE_integer("step", None, "Checkpoint step when --drafter is a workdir (default: the latest).", **fv)
    flags.DEFINE_list(
        "prompts",
        ["heldout_prompts"],
        "Bundled sets (heldout_prompts, stdlib_heldout), chat JSONL paths, benchmarks (gsm8k, math500, "
        "humaneval, mbpp, mt-bench) or NAME=PATH for a local copy of a benchmark.",
        **fv,
    )
    flags.DEFINE_integer("limit", 0, "At most this many prompts of each set (0: all).", lower_bound=0, **fv)
    flags.DEFINE_integer(
        "max_new_tokens", 256, "Tokens generated per prompt at most (stop tokens end earlier).", lower_bound=1, **fv
    )
    flags.DEFINE_integer(
        "batch_size", 1, "Prompts decoded together (speed-ups are usually quoted at 1).", lower_bound=1, **fv
    )
    cli.define_sampling_flags("0: greedy (lossless); > 0: rejection sampling.", flag_values)
    flags.DEFINE_float(
        "confidence_threshold",
        0.0,
        "Drafters with a confidence head: propose the drafts up to the first slot whose confidence is below this (0: the whole block).",
        lower_bound=0,
        upper_bound=1,
        **fv,
    )
    flags.DEFINE_integer(
        "draft_vocab",
        0,
        "Draft among the drafter's this many most frequent trained-on tokens (its token_frequencies.json; "
        "0: the whole vocabulary). Lossless: the target still verifies over every token.",
        lower_bound=0,
        **fv,
    )
    flags.DEFINE_bool("enable_thinking", False, "Render prompts with thinking enabled (Qwen3 templates).", **fv)
    cli.define_dtype_flag("Weight and compute dtype of both models", sorted(DTYPES), flag_values)
    flags.DEFINE_string("output", "eval_results", "Directory for eval.json and eval.png.", **fv)
    flags.DEFINE_enum("engine", None, ENGINES, "Also serve the prompts with this engine.", **fv)
    flags.DEFINE_integer(
        "engine_threads",
        0,
        "The engine's CPU threads (0: its default; vLLM's CPU build: the cores 0..N-1 its model runs on).",
        lower_bound=0,
        **fv,
    )
    flags.DEFINE_list(
        "engine_weights",
        ["file"],
        "llama.cpp: the targets it serves, each in turn: `file`, the GGUF as it is; `float32`, every tensor "
        "dequantized (the weights our decoder runs, on the engine's float32 kernels).",
        **fv,
    )
    flags.DEFINE_float(
        "engine_timeout", 600.0, "Seconds the engine may take to answer one prompt.", lower_bound=1, **fv
    )
    flags.DEFINE_string(
        "vllm_python",
        None,
        "--engine=vllm: the Python interpreter of the vLLM to run (default: $DFLASH_JAX_VLLM_PYTHON, else the "
        "environment `dflash-jax install-vllm` makes).",
        **fv,
    )
    flags.mark_flags_as_required(["drafter"], **fv)


def main(argv, f: flags.FlagValues = flags.FLAGS):
    del argv
    sampling = cli.sampling_config(f)
    check_writable(f.output, "--output")  # before any model is loaded
    drafter = str(_model(f.drafter, "--drafter"))
    target = _target(f.target, drafter, f.step)
    _check_fits(drafter, target, f.step)
    engine = _prepare_engine(f, target, drafter) if f.engine else None  # its problems, before our decoder runs
    evaluation = run_evaluation(
        target,
        drafter,
        f.prompts,
        drafter_step=f.step,
        num_prompts=f.limit,
        max_new_tokens=f.max_new_tokens,
        batch_size=f.batch_size,
        sampling=sampling,
        enable_thinking=f.enable_thinking,
        dtype=DTYPES[cli.dtype_flag(f)],
        seed=f.seed,
        confidence_threshold=f.confidence_threshold,
        draft_vocab=f.draft_vocab,
    )
    if engine:
        evaluation["engine"] = {
            "name": f.engine,
            "server": engine.server,
            "served": {
                served: evaluate_engine(
                    serve, engine.prompts, max_new_tokens=f.max_new_tokens, verify_tokens=engine.num_drafts + 1
                )
                for served, serve in engine.servers.items()
            },
        }
    write_outputs(evaluation, f.output)
    print(report.table(evaluation["sets"]))
    if engine:
        print(engine_table(evaluation["sets"], evaluation["engine"]))
    print(f"wrote {f.output}/eval.json and {f.output}/eval.png")


@dataclasses.dataclass(frozen=True)
class _Engine:
    """An engine, ready to serve: what runs (`server`), a server of each target it serves (by the
    name the table gives it) alone or with the drafter (`serve(drafted)`), the drafts a step
    proposes and each set's prompts (the first turn of every row)."""

    server: str
    servers: dict[str, Callable[[bool], EngineServer]]
    num_drafts: int
    prompts: dict[str, list]


def _prepare_engine(f: flags.FlagValues, target: str, drafter: str) -> _Engine:
    """Everything the engine needs, or its one-line refusal, before our decoder or a server runs."""
    export = drafter if is_export_dir(drafter) else Workdir.at(drafter).export
    if not is_export_dir(export):
        raise UserError(f"--engine={f.engine} needs the drafter's export; {drafter} has none (run dflash-jax export)")
    prepare = _llama_cpp if f.engine == "llama.cpp" else _vllm
    return prepare(f, target, Path(export), _engine_prompts(f, target))


def _engine_prompts(f: flags.FlagValues, target: str) -> dict[str, list]:
    chat = ChatTokenizer(target, enable_thinking=f.enable_thinking)
    prompts = {}
    for spec in f.prompts:
        prompt_set = load_prompt_set(spec, chat, limit=f.limit)
        prompts[prompt_set.name] = [chat.prompt_ids(row[0]) for row in prompt_set.rows]
    return prompts


def _llama_cpp(f: flags.FlagValues, target: str, export: Path, prompts: dict[str, list]) -> _Engine:
    if unknown := sorted(set(f.engine_weights) - set(ENGINE_WEIGHTS)):
        raise UserError(f"--engine_weights={','.join(unknown)}: choose among {', '.join(ENGINE_WEIGHTS)}")
    # Before a target GGUF is written for it: a drafter llama.cpp cannot serve.
    if problems := llama_cpp_problems(read_config(export), families.target_config(read_config(target)).num_layers):
        raise UserError(f"--engine=llama.cpp cannot serve {export}: {'; '.join(problems)}")
    binary = require_server()
    os.makedirs(f.output, exist_ok=True)
    served = served_gguf(target, Path(f.output) / "target.gguf")
    targets = {
        weights: widened_gguf(served, Path(f.output) / "target.float32.gguf") if weights == "float32" else served
        for weights in dict.fromkeys(f.engine_weights)
    }
    draft_tokens = draft_token_ids(export, f.draft_vocab) if f.draft_vocab else None  # as our decoder drafts
    drafting = Drafting.convert(export, served, Path(f.output) / "drafter.gguf", draft_tokens)
    print(f"llama.cpp ({binary}): {drafting.spec_type}, {drafting.num_drafts} drafts a step")

    def server(target_gguf: Path) -> Callable[[bool], EngineServer]:
        return lambda drafted: LlamaServer(
            binary,
            target_gguf,
            drafting if drafted else None,
            threads=f.engine_threads,
            request_timeout=f.engine_timeout,
        )

    servers = {weights: server(target_gguf) for weights, target_gguf in targets.items()}
    return _Engine(str(binary), servers, drafting.num_drafts, prompts)


def _vllm(f: flags.FlagValues, target: str, export: Path, prompts: dict[str, list]) -> _Engine:
    if f.engine_weights != ["file"]:
        raise UserError("--engine_weights applies to --engine=llama.cpp; vLLM serves Hugging Face weights in --dtype")
    if f.draft_vocab:
        raise UserError("--draft_vocab applies to --engine=llama.cpp; vLLM drafts over the whole vocabulary")
    env = require_env(f.vllm_python)
    drafting = vllm_drafting(export, env)
    os.makedirs(f.output, exist_ok=True)
    served, converted = hf_target(Path(target), Path(f.output))
    if converted:
        print(f"vLLM loads no GGUF file on a CPU: serving the target's weights dequantized to float32 from {served}")
    dtype = cli.dtype_flag(f)
    longest = max((len(p) for sets in prompts.values() for p in sets), default=0)
    positions = families.target_config(read_config(target)).max_position_embeddings
    chat = ChatTokenizer(target, enable_thinking=f.enable_thinking)
    print(f"vLLM ({env}: {env.python}): method {drafting.method!r}, {drafting.num_drafts} drafts a step, {dtype}")

    def serve(drafted: bool) -> EngineServer:
        return VllmServer(
            env,
            served,
            drafting if drafted else None,
            dtype=dtype,
            stop_tokens=chat.stop_tokens,
            # Room for a last step's whole block past max_new_tokens: vLLM cuts the drafts that
            # would pass its max_model_len, and a cut step is one our decoder does not take.
            max_model_len=min(positions, longest + f.max_new_tokens + 2 * (drafting.num_drafts + 1)),
            threads=f.engine_threads,
            request_timeout=f.engine_timeout,
        )

    return _Engine(f"{env.python} ({env})", {dtype: serve}, drafting.num_drafts, prompts)


def _model(spec: str, flag: str):
    try:
        return resolve_model(spec)
    except UserError as e:
        raise UserError(f"{flag}={e}") from None


def _target(spec: str | None, drafter: str, step: int | None) -> str:
    """--target, else the target.path saved in the checkpoint of the run `drafter` belongs to."""
    if spec:
        return str(_model(spec, "--target"))
    workdir = _run_of(drafter)
    if workdir is None:
        raise UserError(
            f"--target is required: --drafter={drafter} is not a training workdir (nor an export inside one) "
            "whose checkpoint names the target"
        )
    try:
        # The export inside a workdir is of its last step; any checkpoint names the same target.
        named = run_meta(workdir, None if is_export_dir(drafter) else step)["config"]["target"]["path"]
    except UserError as e:
        raise UserError(f"--drafter={drafter}: {e}") from None
    try:
        return str(resolve_model(named))
    except UserError as e:
        raise UserError(f"the target of --drafter={drafter}, target.path={e}; pass --target") from None


def _check_fits(drafter: str, target: str, step: int | None) -> None:
    """The drafter was made for this target, as their config files say (the drafter's weights files'
    headers checked too), before either model loads."""
    try:
        target_cfg = families.target_config(read_config(target))
    except FileNotFoundError as e:
        raise UserError(f"--target={target}: {e}") from None
    check_fits(any_drafter_config(drafter, step), target_cfg, f"--drafter={drafter}", f"the target {target}")


def _run_of(drafter: str) -> Workdir | None:
    """The training workdir `drafter` is, or holds as its export or best export; None otherwise."""
    if Workdir.at(drafter).has_checkpoints():
        return Workdir.at(drafter)
    parent = Workdir.at(os.path.dirname(os.path.abspath(drafter)))
    exports = (parent.export, parent.export_best)
    if parent.has_checkpoints() and any(os.path.samefile(drafter, e) for e in exports if os.path.isdir(e)):
        return parent
    return None


def run() -> None:
    """The command: `dflash-jax evaluate`, or `python -m dflash_jax.evaluate`."""
    cli.run(main, define_flags, renamed=RENAMED_FLAGS)


if __name__ == "__main__":
    run()
