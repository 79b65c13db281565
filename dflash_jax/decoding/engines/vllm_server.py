"""vLLM in the loop: its OpenAI-compatible server on a Hugging Face target, alone or with a drafter
export as its speculative model, greedy.

`VllmServer` is an `EngineServer` (decoding/engines/server.py: the process group, bounded waits,
one-line failures) running `python -m vllm.entrypoints.openai.api_server` (the CPU build's `vllm`
command looks up a distribution named `vllm` and fails) one sequence at a time. Its `complete`
sends one prompt as token ids to `/v1/completions` and reads the engine's counters from
`/metrics` before and after: the drafting steps (`spec_decode_num_drafts`), draft tokens, accepted
tokens and the request's decode time. vLLM counts drafts accepted past `max_tokens` or a stop
token too, so a prompt's accepted count can exceed ours by the last step's; its steps are ours.

`vllm_drafting` is the drafter's `--speculative-config`, or one line saying why this vLLM cannot
serve its kind (`Kind.vllm`); `hf_target` turns a GGUF target into the Hugging Face weights vLLM
serves (it has no GGUF loader that runs on a CPU).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path

from absl import logging

from dflash_jax.decoding.engines.server import HOST, Completion, EngineServer, excerpt, free_port
from dflash_jax.decoding.engines.vllm import VllmEnv
from dflash_jax.errors import UserError
from dflash_jax.models import drafter_format
from dflash_jax.models.drafter_config import DrafterConfig
from dflash_jax.models.formats.gguf import GgufTensors, weights_file

# The counters `complete` reads, summed over their label sets: /metrics' name -> Completion's.
COUNTERS = {
    "vllm:spec_decode_num_drafts_total": "steps",
    "vllm:spec_decode_num_draft_tokens_total": "drafted",
    "vllm:spec_decode_num_accepted_tokens_total": "accepted",
    "vllm:request_decode_time_seconds_sum": "decode_s",
    "vllm:request_prefill_time_seconds_sum": "prompt_s",
    "vllm:request_prefill_kv_computed_tokens_sum": "prompt_tokens",
}
SAMPLE_NAME = re.compile(r"[^{\s]*")
KV_CACHE_GIB = "1"  # the CPU build's KV cache (VLLM_CPU_KVCACHE_SPACE): plenty for one sequence
# The engine's config as its log states it at start-up, e.g. `dtype=torch.float32`.
STATED = {
    "dtype": re.compile(r"\bdtype=torch\.(\w+)"),
    "num_speculative_tokens": re.compile(r"\bnum_spec_tokens=(\d+)"),
}
CONVERTED_FROM = "dflash_jax.converted_from"  # model.safetensors metadata: the GGUF file it holds


@dataclasses.dataclass(frozen=True)
class VllmDrafting:
    """The drafter vLLM loads: the export, its kind's method and the drafts per step."""

    export: Path
    method: str
    num_drafts: int

    @property
    def speculative_config(self) -> dict:
        return {"method": self.method, "model": str(self.export), "num_speculative_tokens": self.num_drafts}


def vllm_drafting(export: Path, env: VllmEnv) -> VllmDrafting:
    """How `env`'s vLLM serves the export at `export`; one line naming the engine, the kind and
    why when it cannot (`Kind.vllm`), before anything starts."""
    hf = json.loads((Path(export) / "config.json").read_text())
    kind = drafter_format.kind_of(hf)
    why = kind.vllm.refused or (kind.vllm.cpu_refused if env.cpu else "")
    if why:
        raise UserError(f"vLLM ({env}) does not serve {export}, a drafter of kind {kind.name!r}: {why}")
    return VllmDrafting(Path(export), kind.vllm.method, DrafterConfig.from_hf(hf).num_drafts)


def hf_target(target: Path, out_dir: Path) -> tuple[Path, bool]:
    """The Hugging Face directory vLLM serves for a resolved target directory, and whether it was
    converted: a GGUF target's weights dequantized to float32 by our reader (the weights our
    decoder runs) into `out_dir`/target.hf with its config and tokenizer files; any other target
    as it is. A conversion of the same file (its path, size and modification time) is reused."""
    gguf = weights_file(target)
    if gguf is None:
        return Path(target), False
    from safetensors import safe_open
    from safetensors.numpy import save_file

    stat = gguf.resolve().stat()
    source = f"{gguf.resolve()} {stat.st_size} {stat.st_mtime_ns}"
    out = Path(out_dir) / "target.hf"
    weights = out / "model.safetensors"
    if weights.is_file():
        with safe_open(weights, "numpy") as f:
            if (f.metadata() or {}).get(CONVERTED_FROM) == source:
                return out, True
    out.mkdir(parents=True, exist_ok=True)
    for file in Path(target).iterdir():
        if file.is_file() and file.suffix != ".gguf":
            (out / file.name).write_bytes(file.read_bytes())
    tensors = GgufTensors(gguf)
    save_file(
        {name: tensors.get(name) for name in sorted(tensors.names())},
        str(weights),
        metadata={"format": "pt", CONVERTED_FROM: source},
    )
    return out, True


class VllmServer(EngineServer):
    engine = "vLLM"
    # The exception line of a traceback (`ValueError: ...`, pydantic's `Value error, ...`).
    FAILURE = re.compile(r"^(\(\w+ pid=\d+\) )?([\w.]*(Error|Exception)\b[:,]|Value error, )")

    def __init__(
        self,
        env: VllmEnv,
        target: Path,
        drafting: VllmDrafting | None = None,
        *,
        dtype: str,
        stop_tokens: Sequence[int] = (),
        max_model_len: int = 0,
        threads: int = 0,
        extra_args: Sequence[str] = (),
        start_timeout: float = 900.0,
        request_timeout: float = 600.0,
    ):
        self.target, self.stop_tokens, self.drafting = str(target), [int(t) for t in stop_tokens], drafting
        port = free_port()
        cmd = [str(env.python), "-m", "vllm.entrypoints.openai.api_server", "--model", self.target]
        cmd += ["--host", HOST, "--port", str(port), "--dtype", dtype, "--max-num-seqs", "1", "--seed", "0"]
        if max_model_len:
            cmd += ["--max-model-len", str(max_model_len)]
        if not env.cpu:
            cmd += ["--attention-backend", "flash_attn"]  # as the README serves on a GPU
        if drafting:
            cmd += ["--speculative-config", json.dumps(drafting.speculative_config)]
        cmd += list(extra_args)
        environ = dict(os.environ)
        if env.cpu:
            environ.setdefault("VLLM_CPU_KVCACHE_SPACE", KV_CACHE_GIB)
            if threads:  # the cores its model runs on (by default: all but one, reserved for the server)
                environ["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{threads - 1}"
        super().__init__(cmd, port, env=environ, start_timeout=start_timeout, request_timeout=request_timeout)
        asked = {"dtype": dtype, "num_speculative_tokens": str(drafting.num_drafts) if drafting else None}
        for problem in self.ignored(asked):
            logging.warning("%s", problem)

    def ignored(self, asked: dict[str, str | None]) -> list[str]:
        """What the engine's log says it runs that differs from what it was asked (a silently
        downcast dtype, say), one line each."""
        text = Path(self.log.name).read_text(errors="replace")
        found = []
        for name, value in asked.items():
            stated = STATED[name].findall(text)
            if value is not None and stated and stated[-1] != value:
                found.append(f"{self.engine} runs {name} {stated[-1]}, not the {value} it was asked for")
        return found

    def counters(self) -> dict[str, float]:
        values = dict.fromkeys(COUNTERS.values(), 0.0)
        for line in self.get("/metrics").decode("utf-8", "replace").splitlines():
            name = SAMPLE_NAME.match(line).group()  # a sample: `name{labels} value`, or `name value`
            if name in COUNTERS:
                try:
                    values[COUNTERS[name]] += float(line.rsplit(" ", 1)[-1])
                except ValueError:
                    raise self.failed(f"/metrics: not a Prometheus sample: {excerpt(line)!r}") from None
        return values

    def complete(self, prompt: Sequence[int], max_new_tokens: int, *, cache_prompt: bool = False) -> Completion:
        """Greedy (every sampling default of the model's generation config overridden), stopping
        at our stop tokens; vLLM caches prompt prefixes whatever `cache_prompt` says."""
        del cache_prompt
        body = {
            "model": self.target,
            "prompt": [int(t) for t in prompt],
            "max_tokens": max_new_tokens,
            "temperature": 0.0,
            "top_p": 1.0,
            "top_k": 0,
            "repetition_penalty": 1.0,
            "stop_token_ids": self.stop_tokens,
            "return_token_ids": True,
        }
        before = self.counters()
        reply = self.post("/v1/completions", body)
        after = self.counters()
        delta = {name: after[name] - before[name] for name in after}
        try:
            tokens = [int(t) for t in reply["choices"][0]["token_ids"]]
        except (KeyError, IndexError, TypeError, ValueError):
            raise self.failed(
                f"/v1/completions: not a completion with token ids: {excerpt(json.dumps(reply))}"
            ) from None
        return Completion(
            tokens=tokens,
            steps=round(delta["steps"]) if self.drafting else max(len(tokens) - 1, 0),
            drafted=round(delta["drafted"]),
            accepted=round(delta["accepted"]),
            decode_tokens=max(len(tokens) - 1, 0),  # its decode time runs from the first token to the last
            decode_ms=1000 * delta["decode_s"],
            prompt_tokens=round(delta["prompt_tokens"]),
            prompt_ms=1000 * delta["prompt_s"],
        )
