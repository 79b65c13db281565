"""llama.cpp in the loop: `llama-server` on a GGUF target, alone or with a drafter GGUF, greedy.

`LlamaServer` starts the server on 127.0.0.1 (a free port, loopback only) and stops it; its
`complete` sends one prompt as token ids to `/completion` (no template, no BOS added: the ids
our decoder gets) and returns the tokens and the engine's own counters (`timings`: tokens
predicted, their milliseconds, drafted and accepted tokens). `engine_figures` sums them over a
prompt set; `forward_cost` times the target's forward of a verify's tokens, which splits a drafted
step's time into the verify and the drafter. Every wait is bounded: start-up by `start_timeout`, each request by `request_timeout`.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from tqdm import tqdm

from dflash_jax.errors import UserError
from dflash_jax.models.drafter_config import DrafterConfig
from dflash_jax.models.formats.gguf_export import served_kind, write_drafter_gguf

HOST = "127.0.0.1"


@dataclasses.dataclass(frozen=True)
class Drafting:
    """The drafter a server loads: its GGUF, llama.cpp's speculative type and the drafts per step."""

    gguf: Path
    spec_type: str  # the kind's `--spec-type` (`Kind.llama_cpp`)
    num_drafts: int

    @property
    def verify_tokens(self) -> int:
        """The tokens a verification forward runs: the last accepted token and the drafts."""
        return self.num_drafts + 1

    @classmethod
    def convert(
        cls, export_dir: Path, target_gguf: Path, out_file: Path, draft_token_ids: np.ndarray | None = None
    ) -> Drafting:
        """The drafter exported at `export_dir`, written as GGUF to `out_file` for `target_gguf`
        (drafting among `draft_token_ids` if given)."""
        hf = json.loads((Path(export_dir) / "config.json").read_text())
        write_drafter_gguf(export_dir, target_gguf, out_file, draft_token_ids)
        return cls(Path(out_file), served_kind(hf).llama_cpp.spec_type, DrafterConfig.from_hf(hf).num_drafts)


@dataclasses.dataclass(frozen=True)
class Completion:
    tokens: list[int]
    predicted_n: int
    predicted_ms: float
    draft_n: int
    draft_accepted: int
    prompt_n: int = 0  # the prompt tokens the engine ran (those not already in its cache)
    prompt_ms: float = 0.0

    @property
    def steps(self) -> int:
        """Target verification steps after the prefill's token: each adds its accepted drafts + 1."""
        return self.predicted_n - 1 - self.draft_accepted


class LlamaServer:
    def __init__(
        self,
        binary: Path,
        target: Path,
        drafting: Drafting | None = None,
        *,
        threads: int = 0,
        context: int = 4096,
        extra_args: Sequence[str] = (),
        start_timeout: float = 300.0,
        request_timeout: float = 600.0,
    ):
        self.request_timeout = request_timeout
        self.port = _free_port()
        cmd = [str(binary), "-m", str(target), "--host", HOST, "--port", str(self.port), "-c", str(context)]
        cmd += ["-np", "1", "--no-webui", "--temp", "0", "--top-k", "1"]
        if threads:
            cmd += ["-t", str(threads)]
        if drafting:
            # p-min 0: every draft proposed, as our decoder proposes them (llama.cpp may cut at a probability).
            cmd += ["--spec-type", drafting.spec_type, "--spec-draft-model", str(drafting.gguf)]
            cmd += ["--spec-draft-n-max", str(drafting.num_drafts), "--spec-draft-p-min", "0"]
        cmd += list(extra_args)
        self.log = tempfile.NamedTemporaryFile(prefix="llama-server-", suffix=".log")  # its lines explain a failure
        self.process = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        self._wait_healthy(start_timeout)

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                message = f"llama-server exited with code {self.process.returncode}: {self.log_tail()}"
                self.close()
                raise UserError(message)
            try:
                with urllib.request.urlopen(f"http://{HOST}:{self.port}/health", timeout=5) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        message = f"llama-server did not become healthy within {timeout:.0f} s: {self.log_tail()}"
        self.close()
        raise UserError(message)

    def log_tail(self, lines: int = 1) -> str:
        text = Path(self.log.name).read_text(errors="replace").strip().splitlines()
        errors = [line for line in text if "error" in line.lower() or "failed" in line.lower()]
        return " | ".join((errors or text)[-lines:]) or "(no output)"

    def complete(self, prompt: Sequence[int], max_new_tokens: int, *, cache_prompt: bool = False) -> Completion:
        body = {
            "prompt": [int(t) for t in prompt],
            "n_predict": max_new_tokens,
            "temperature": 0.0,
            "top_k": 1,
            "cache_prompt": cache_prompt,
            "return_tokens": True,
            "stream": False,
        }
        request = urllib.request.Request(
            f"http://{HOST}:{self.port}/completion",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=self.request_timeout) as response:
                reply = json.loads(response.read())
        except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
            raise UserError(f"llama-server request failed ({e}): {self.log_tail()}") from None
        t = reply["timings"]
        return Completion(
            tokens=list(reply["tokens"]),
            predicted_n=int(t["predicted_n"]),
            predicted_ms=float(t["predicted_ms"]),
            draft_n=int(t.get("draft_n", 0)),
            draft_accepted=int(t.get("draft_n_accepted", 0)),
            prompt_n=int(t.get("prompt_n", 0)),
            prompt_ms=float(t.get("prompt_ms", 0.0)),
        )

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()

    def __enter__(self) -> LlamaServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def run_prompts(
    server: LlamaServer, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, desc: str = ""
) -> list[Completion]:
    """One completion per prompt, in order (the loop is bounded by len(prompts), each request by
    the server's request_timeout); the first prompt is sent twice, the first time untimed
    (warm-up, as our decoder compiles first). With `desc`, a progress bar on stderr."""
    if prompts:
        server.complete(prompts[0], max_new_tokens)
    return [server.complete(p, max_new_tokens) for p in tqdm(prompts, desc=desc, unit="prompt", disable=not desc)]


def forward_cost(
    server: LlamaServer, prompts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]], num_tokens: int
) -> dict:
    """What a verification costs the engine's target: a forward of `num_tokens` tokens (an anchor
    and its drafts) after a cached prompt, as the engine times it (prompt processing: the batched
    forward a verify runs), the median over the prompts whose continuation is long enough (a
    median: one slow request on a shared machine moves a mean)."""
    runs = []
    for prompt, continuation in zip(prompts, continuations):
        if len(continuation) < num_tokens:
            continue
        server.complete(prompt, 1, cache_prompt=True)  # the prompt, now cached (not the token it generates)
        runs.append(server.complete([*prompt, *continuation[:num_tokens]], 1, cache_prompt=True))
    if not runs:
        return {"tokens": 0, "ms": float("nan"), "prompts": 0}
    return {
        "tokens": float(np.median([c.prompt_n for c in runs])),
        "ms": float(np.median([c.prompt_ms for c in runs])),
        "prompts": len(runs),
    }


def engine_figures(alone: Sequence[Completion], drafted: Sequence[Completion], forward: dict | None = None) -> dict:
    """A prompt set's figures in the engine, as `measurement.evaluate_set` reports ours: τ (mean
    over prompts of the tokens per verification step), drafted and accepted tokens, decode speed
    (the engine's `predicted` timings: after the prompt) with and without the drafter, the
    fraction of outputs identical to the target alone, and, given `forward_cost`'s figure, what a
    step costs: its verify and (the rest) its drafter, in target decode steps (the whole step's is
    the τ at which drafting breaks even)."""
    taus = [(c.predicted_n - 1) / c.steps for c in drafted if c.steps > 0]

    def speed(completions):
        tokens = sum(c.predicted_n for c in completions)
        ms = sum(c.predicted_ms for c in completions)
        return {
            "tokens": tokens,
            "tokens_per_s": 1000 * tokens / ms if ms else 0.0,
            "ms_per_token": ms / tokens if tokens else 0.0,
        }

    with_drafter, target = speed(drafted), speed(alone)
    figures = {
        "tau": sum(taus) / len(taus) if taus else float("nan"),
        "drafted": sum(c.draft_n for c in drafted),
        "accepted": sum(c.draft_accepted for c in drafted),
        "drafter": with_drafter,
        "target": target,
        "speedup": with_drafter["tokens_per_s"] / target["tokens_per_s"] if target["tokens_per_s"] else None,
        "identical_outputs": sum(a.tokens == d.tokens for a, d in zip(alone, drafted)) / max(len(alone), 1),
    }
    steps = sum(c.steps for c in drafted)
    if forward and steps and target["ms_per_token"]:
        decode_ms = target["ms_per_token"]
        step_ms = sum(c.predicted_ms for c in drafted) / steps
        figures["step_costs"] = {
            "decode_ms": decode_ms,
            "step_ms": step_ms,
            "verify_tokens": forward["tokens"],
            "verify_ms": forward["ms"],
            "drafter_ms": step_ms - forward["ms"],
            "step_in_decode_steps": step_ms / decode_ms,
            "verify_in_decode_steps": forward["ms"] / decode_ms,
            "drafter_in_decode_steps": (step_ms - forward["ms"]) / decode_ms,
        }
    return figures


def evaluate_engine(
    binary: Path,
    target_gguf: Path,
    drafting: Drafting,
    prompt_sets: dict[str, list[Sequence[int]]],
    *,
    max_new_tokens: int,
    threads: int = 0,
    cost_prompts: int = 8,
) -> dict[str, dict]:
    """`engine_figures` of every prompt set: one server of the target alone (which also times a
    verify-sized forward on the first `cost_prompts` prompts of each set), then one with the drafter."""
    with LlamaServer(binary, target_gguf, threads=threads) as server:
        alone = {
            name: run_prompts(server, prompts, max_new_tokens, desc=f"llama.cpp, target alone: {name}")
            for name, prompts in prompt_sets.items()
        }
        forward = {
            name: forward_cost(
                server,
                prompts[:cost_prompts],
                [c.tokens for c in alone[name][:cost_prompts]],
                drafting.verify_tokens,
            )
            for name, prompts in prompt_sets.items()
        }
    with LlamaServer(binary, target_gguf, drafting, threads=threads) as server:
        drafted = {
            name: run_prompts(server, prompts, max_new_tokens, desc=f"llama.cpp with the drafter: {name}")
            for name, prompts in prompt_sets.items()
        }
    return {name: engine_figures(alone[name], drafted[name], forward[name]) for name in prompt_sets}
