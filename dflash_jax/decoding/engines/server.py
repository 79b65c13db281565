"""A serving engine in the loop: its server on 127.0.0.1, prompts as token ids, its own counters.

`EngineServer` is what every engine shares. It starts the engine's server command in a process
group of its own (so that stopping it stops the workers the engine forks, even once the server
itself is dead), on a free port of 127.0.0.1, and waits for its `/health` (bounded by
`start_timeout`); it sends requests (each bounded by `request_timeout`, no HTTP proxy) and stops
the server: SIGTERM (and SIGCONT, for a stopped one) to the group, a bounded wait, then SIGKILL.
Every failure is one `UserError` naming the engine, what failed, whether the server is still
running, the last line of its log that explains it, and where its whole log is kept (a failed
server's log outlives the command; a server that ends well leaves none). An engine module
subclasses it with its command line, its `complete` (one prompt, greedy, the engine's counters
as a `Completion`) and the log lines that explain its failures (`FAILURE`).

`run_prompts`, `forward_cost`, `engine_figures` and `evaluate_engine` measure any engine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np
from tqdm import tqdm

from dflash_jax.errors import UserError

HOST = "127.0.0.1"
STOP_TIMEOUT = 30.0  # seconds a server has to exit on SIGTERM before it is killed
HEALTH_TIMEOUT = 5.0  # seconds one /health probe may take during start-up
EXCERPT_CHARS = 200
# Requests go straight to the server: an HTTP proxy in the environment must not see them.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@dataclasses.dataclass(frozen=True)
class Completion:
    """One prompt's output from an engine, with the engine's own counters."""

    tokens: list[int]  # the new tokens, a stop token included
    steps: int  # target forwards after the first token (the prefill's): drafting steps, or tokens - 1 alone
    drafted: int  # draft tokens proposed
    accepted: int  # drafts accepted, as the engine counts them
    decode_tokens: int  # the tokens decode_ms covers
    decode_ms: float  # the engine's decoding time after the prompt
    prompt_tokens: int = 0  # the prompt tokens the engine ran (those not already in its cache)
    prompt_ms: float = 0.0


class EngineServer:
    """An engine's server process (see the module doc). Subclasses set `engine` and `FAILURE` and
    call `__init__` with their command line, built for `port` (`free_port()`)."""

    engine = "the engine"  # what every message names
    FAILURE = re.compile(r"error|failed", re.IGNORECASE)  # a log line that explains a failure
    # A failure line that points at another for its cause (vLLM's engine core start-up): the
    # line it points at is the one to show.
    POINTER = re.compile(r"see root cause above", re.IGNORECASE)
    # Whether `complete(..., cache_prompt=True)` reuses the cached prompt, so that a request's
    # prompt_ms times the forward of its new tokens alone (`forward_cost`).
    times_a_forward = False

    def __init__(
        self,
        cmd: Sequence[str],
        port: int,
        *,
        env: Mapping[str, str] | None = None,
        start_timeout: float,
        request_timeout: float,
    ):
        self.port, self.request_timeout = port, request_timeout
        self.url = f"http://{HOST}:{port}"
        # Explains a failure: kept where one is reported (`_failure`), removed on a clean close.
        self.log = tempfile.NamedTemporaryFile(prefix="dflash-jax-engine-server-", suffix=".log", delete=False)
        self._keep_log = False
        self._served_from = 0  # where the log stood when the server became healthy
        try:
            self.process = subprocess.Popen(
                list(cmd), stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        except BaseException:
            self.log.close()
            os.unlink(self.log.name)
            raise
        try:
            self._wait_healthy(start_timeout)
        except BaseException:
            self.close()
            raise

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise self._failure(f"{self.engine} exited with code {self.process.returncode}")
            try:
                with _OPENER.open(f"{self.url}/health", timeout=HEALTH_TIMEOUT) as response:
                    if response.status == 200:
                        self._served_from = os.path.getsize(self.log.name)
                        return
            except (urllib.error.URLError, OSError, http.client.HTTPException):
                pass
            time.sleep(0.5)
        raise self._failure(f"{self.engine} did not become healthy within {timeout:.0f} s")

    def log_tail(self) -> str:
        """The log's last line that explains a failure (`FAILURE`); before the server became
        healthy, else its last line (a start-up's last words), once it serves, those since then."""
        with open(self.log.name, "rb") as f:
            f.seek(self._served_from)
            lines = [line.strip() for line in f.read().decode("utf-8", "replace").splitlines()]
        lines = [line for line in lines if line]
        explaining = [line for line in lines if self.FAILURE.search(line)]
        explaining = [line for line in explaining if not self.POINTER.search(line)] or explaining
        if not explaining and self._served_from:
            return "its log says no more since it started serving"
        last = (explaining or lines or ["(no output)"])[-1]
        return last if len(last) <= 2 * EXCERPT_CHARS else last[: 2 * EXCERPT_CHARS] + "..."

    def get(self, path: str) -> bytes:
        return self._exchange(path, None)

    def post(self, path: str, body: dict) -> dict:
        """The JSON object the engine answers to `body` at `path`."""
        answer = self._exchange(path, json.dumps(body).encode())
        try:
            reply = json.loads(answer)
        except ValueError:
            reply = None
        if not isinstance(reply, dict):
            raise self.failed(f"{path} answered something other than a JSON object: {excerpt(answer)!r}")
        return reply

    def _exchange(self, path: str, data: bytes | None) -> bytes:
        request = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with _OPENER.open(request, timeout=self.request_timeout) as response:
                return response.read()
        except urllib.error.HTTPError as e:
            problem = f"HTTP {e.code}: {excerpt(e.read())}"
        except TimeoutError:
            problem = f"no answer within {self.request_timeout:g} s"
        except urllib.error.URLError as e:
            reason = e.reason
            problem = f"no answer within {self.request_timeout:g} s" if isinstance(reason, TimeoutError) else reason
        except (OSError, http.client.HTTPException) as e:
            problem = str(e) or type(e).__name__
        raise self.failed(f"{path}: {problem}")

    def failed(self, problem: str) -> UserError:
        """A request's failure as one line: the problem, the server's state and its log's word."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=2)  # a server that is dying says so in its exit code
        code = self.process.returncode
        state = "is still running" if code is None else f"exited with code {code}"
        return self._failure(f"{self.engine} on port {self.port}: {problem}; the server {state}")

    def _failure(self, message: str) -> UserError:
        """`message`, the log's line that explains it, and where the whole log is kept."""
        self._keep_log = True
        return UserError(f"{message}: {self.log_tail()} (its whole log: {self.log.name})")

    def complete(self, prompt: Sequence[int], max_new_tokens: int, *, cache_prompt: bool = False) -> Completion:
        """One prompt's greedy completion and the engine's counters (`cache_prompt`: reuse the
        engine's cache of an earlier prompt that this one extends)."""
        raise NotImplementedError

    def close(self) -> None:
        if not self.log.closed:
            stop_group(self.process)
            self.log.close()
            if not self._keep_log:
                os.unlink(self.log.name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group `pgid`."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        state, _ppid, group = stat[stat.rindex(")") + 2 :].split()[:3]
        if int(group) == pgid and state != "Z":
            members.append(int(entry))
    return members


def stop_group(process: subprocess.Popen, timeout: float = STOP_TIMEOUT) -> None:
    """Stops `process` and every process of its group (it leads one of its own): SIGTERM and
    SIGCONT (a stopped process then handles the SIGTERM), up to `timeout` seconds for the group to
    empty, then SIGKILL; the leader is reaped."""
    pgid = process.pid
    for sig in (signal.SIGTERM, signal.SIGCONT):
        _signal_group(pgid, sig)
    deadline = time.monotonic() + timeout
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=timeout)
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    _signal_group(pgid, signal.SIGKILL)
    process.wait()
    deadline = time.monotonic() + 10  # SIGKILL is not refused; the kernel takes a moment to reap
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def excerpt(data: bytes | str) -> str:
    """The start of an answer, on one line."""
    text = " ".join((data.decode("utf-8", "replace") if isinstance(data, bytes) else data).split())
    return text if len(text) <= EXCERPT_CHARS else text[:EXCERPT_CHARS] + "..."


def run_prompts(
    server: EngineServer, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, desc: str = ""
) -> list[Completion]:
    """One completion per prompt, in order (the loop is bounded by len(prompts), each request by
    the server's request_timeout); the first prompt is sent twice, the first time untimed
    (warm-up, as our decoder compiles first). With `desc`, a progress bar on stderr."""
    if prompts:
        server.complete(prompts[0], max_new_tokens)
    completions = []
    # Closed before a failure propagates: the failure's line then starts a line of its own.
    with tqdm(total=len(prompts), desc=desc, unit="prompt", disable=not desc) as bar:
        for prompt in prompts:
            completions.append(server.complete(prompt, max_new_tokens))
            bar.update()
    return completions


def forward_cost(
    server: EngineServer, prompts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]], num_tokens: int
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
        "tokens": float(np.median([c.prompt_tokens for c in runs])),
        "ms": float(np.median([c.prompt_ms for c in runs])),
        "prompts": len(runs),
    }


def engine_figures(alone: Sequence[Completion], drafted: Sequence[Completion], forward: dict | None = None) -> dict:
    """A prompt set's figures in the engine, as `measurement.evaluate_set` reports ours: τ (mean
    over prompts of the tokens per drafting step after the first token), drafted and accepted
    tokens and steps, decode speed (the engine's own timing, after the prompt) with and without
    the drafter, the fraction of outputs identical to the target alone, each prompt's new tokens,
    steps and accepted drafts, and what a step costs in target decode steps (the whole step's is
    the τ at which drafting breaks even); given `forward_cost`'s figure, split into its verify
    and (the rest) its drafter."""
    taus = [(len(c.tokens) - 1) / c.steps for c in drafted if c.steps > 0]

    def speed(completions):
        tokens = sum(c.decode_tokens for c in completions)
        ms = sum(c.decode_ms for c in completions)
        return {
            "tokens": tokens,
            "tokens_per_s": 1000 * tokens / ms if ms else 0.0,
            "ms_per_token": ms / tokens if tokens else 0.0,
        }

    with_drafter, target = speed(drafted), speed(alone)
    steps = sum(c.steps for c in drafted)
    figures = {
        "tau": sum(taus) / len(taus) if taus else float("nan"),
        "steps": steps,
        "drafted": sum(c.drafted for c in drafted),
        "accepted": sum(c.accepted for c in drafted),
        "drafter": with_drafter,
        "target": target,
        "speedup": with_drafter["tokens_per_s"] / target["tokens_per_s"] if target["tokens_per_s"] else None,
        "identical_outputs": sum(a.tokens == d.tokens for a, d in zip(alone, drafted)) / max(len(alone), 1),
        "per_prompt": {
            "new_tokens": [len(c.tokens) for c in drafted],
            "steps": [c.steps for c in drafted],
            "accepted": [c.accepted for c in drafted],
            "identical": [a.tokens == d.tokens for a, d in zip(alone, drafted)],
        },
    }
    if steps and target["ms_per_token"]:
        decode_ms = target["ms_per_token"]
        step_ms = sum(c.decode_ms for c in drafted) / steps
        costs = {"decode_ms": decode_ms, "step_ms": step_ms, "step_in_decode_steps": step_ms / decode_ms}
        if forward and forward["prompts"]:
            costs |= {
                "verify_tokens": forward["tokens"],
                "verify_ms": forward["ms"],
                "drafter_ms": step_ms - forward["ms"],
                "verify_in_decode_steps": forward["ms"] / decode_ms,
                "drafter_in_decode_steps": (step_ms - forward["ms"]) / decode_ms,
            }
        figures["step_costs"] = costs
    return figures


def evaluate_engine(
    serve: Callable[[bool], EngineServer],
    prompt_sets: dict[str, list[Sequence[int]]],
    *,
    max_new_tokens: int,
    verify_tokens: int,
    cost_prompts: int = 8,
) -> dict[str, dict]:
    """`engine_figures` of every prompt set: one server of the target alone (`serve(False)`, which
    also times a verify-sized forward on the first `cost_prompts` prompts of each set where the
    engine can), then one with the drafter (`serve(True)`); one server at a time."""
    with serve(False) as server:
        alone = {
            name: run_prompts(server, prompts, max_new_tokens, desc=f"{server.engine}, target alone: {name}")
            for name, prompts in prompt_sets.items()
        }
        forward = {
            name: forward_cost(
                server, prompts[:cost_prompts], [c.tokens for c in alone[name][:cost_prompts]], verify_tokens
            )
            if server.times_a_forward
            else None
            for name, prompts in prompt_sets.items()
        }
    with serve(True) as server:
        drafted = {
            name: run_prompts(server, prompts, max_new_tokens, desc=f"{server.engine} with the drafter: {name}")
            for name, prompts in prompt_sets.items()
        }
    return {name: engine_figures(alone[name], drafted[name], forward[name]) for name in prompt_sets}
