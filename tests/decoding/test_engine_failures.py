"""An engine that fails mid-evaluation ends `dflash-jax evaluate --engine` in bounded time with one
line on stderr and exit status 1, and leaves no server process behind: a real `llama-server`
killed (SIGKILL) while a request is in flight, and one that hangs (SIGSTOP) past
--engine_timeout. The engine's process-group handling is checked without an engine too: a
server that forks a child and dies leaves no child behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash_jax.decoding.engines.llama_cpp import build_server, find_server
from dflash_jax.decoding.engines.server import EngineServer, free_port, group_members
from dflash_jax.decoding.engines.vllm_server import VllmServer
from dflash_jax.errors import UserError
from dflash_jax.models.formats.hf import export_drafter, load_target
from dflash_jax.models.formats.hub import resolve_model
from support.chat_data import chat, write_jsonl
from support.decoding_models import make_drafter, perturbed
from support.gguf_checkpoint import CORPUS, write_tiny_gguf
from support.stderr import kept_log, remove_kept_log, user_lines
from support.training_runs import REPO

ENGINE_TIMEOUT = 5  # seconds a request may take in the hang test
BOUND = 60  # seconds from the failure to the command's exit: a request's timeout, stopping the server, slack


@pytest.fixture(scope="module")
def evaluation(tmp_path_factory, llama_server_binary):
    """The arguments of an evaluation on a tiny GGUF target whose engine runs for a while: a
    drafter export of it, 8 prompts of 512 new tokens each."""
    root = tmp_path_factory.mktemp("engine_failures")
    target_gguf = write_tiny_gguf(root / "target.gguf", layers=4, weight_type="F32", embedding_type="F32")
    target = load_target(resolve_model(str(target_gguf)))
    export = export_drafter(perturbed(make_drafter(target, kind="dflash", block_size=4, mask_id=3)), root / "export")
    prompts = write_jsonl(root / "prompts.jsonl", [chat(text) for text in (CORPUS * 2)[:8]])
    return [
        f"--drafter={export}",
        f"--target={target_gguf}",
        f"--prompts={prompts}",
        "--max_new_tokens=512",
        "--engine=llama.cpp",
        "--engine_threads=1",
        "--dtype=float32",
    ]


def _llama_servers(parent: int | None = None, serving: str | None = None) -> list[tuple[int, list[str]]]:
    """The live llama-server processes (pid, command line): children of `parent`, or serving the
    model file `serving`."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                args = Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace").split("\0")
                state, ppid = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[:2]
            except OSError:
                continue
            if not args[0].endswith("llama-server") or state == "Z":
                continue
            if (parent is not None and int(ppid) == parent) or (serving is not None and serving in args):
                found.append((int(entry), args))
    return found


def _serving(port: int) -> bool:
    """Whether a connection to `port` on 127.0.0.1 is established: a request in flight."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                if state == "01" and int(local.rsplit(":", 1)[1], 16) == port:
                    return True
    return False


def _fail_mid_request(args: list[str], sig: int, out: Path) -> tuple[subprocess.CompletedProcess, float, str]:
    """Runs the evaluation, sends `sig` to its first llama-server once a request is in flight
    there, and returns the finished command, the seconds from the signal to its exit and the
    model file that server served."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "-m", "dflash_jax.evaluate", *args, f"--output={out}"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 900  # our decoder compiles and decodes first, then the engine starts
        signalled = None
        while signalled is None and time.monotonic() < deadline and proc.poll() is None:
            for pid, server_args in _llama_servers(parent=proc.pid)[:1]:
                port = int(server_args[server_args.index("--port") + 1])
                # Twice in a row: a request in flight, not the last moment of one.
                if _serving(port) and (time.sleep(0.01) or _serving(port)):
                    os.kill(pid, sig)
                    signalled, model = time.monotonic(), server_args[server_args.index("-m") + 1]
            time.sleep(0.005)
        assert signalled is not None, f"no request in flight was seen (exit {proc.poll()})"
        stdout, stderr = proc.communicate(timeout=BOUND + 60)
        return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr), time.monotonic() - signalled, model
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _one_error_line(stderr: str) -> str:
    """The command's error: one line, the last on stderr (progress bars above it), no traceback."""
    assert "Traceback" not in stderr, stderr
    errors = [line for line in user_lines(stderr) if line.startswith("error:")]
    assert len(errors) == 1 and user_lines(stderr)[-1] == errors[0], stderr[-3000:]
    return errors[0]


@pytest.fixture(scope="module")
def llama_server_binary():
    """The pinned llama-server, where the tests' subprocesses find it."""
    binary = find_server() or build_server()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DFLASH_JAX_LLAMA_SERVER", str(binary))
        yield binary


@pytest.mark.slow
def test_a_server_killed_mid_request_ends_the_evaluation_in_one_line(evaluation, tmp_path):
    done, seconds, model = _fail_mid_request(evaluation, signal.SIGKILL, tmp_path / "out")
    line = _one_error_line(done.stderr)
    assert done.returncode == 1 and seconds < BOUND, (done.returncode, seconds)
    assert line.startswith("error: llama.cpp's llama-server on port "), line
    assert "exited with code -9" in line, line
    assert _llama_servers(serving=model) == []  # the server is gone, and nothing it started
    remove_kept_log(line, holding="llama")


@pytest.mark.slow
def test_a_hung_server_ends_the_evaluation_at_the_request_timeout(evaluation, tmp_path):
    done, seconds, model = _fail_mid_request(
        [*evaluation, f"--engine_timeout={ENGINE_TIMEOUT}"], signal.SIGSTOP, tmp_path / "out"
    )
    line = _one_error_line(done.stderr)
    assert done.returncode == 1 and ENGINE_TIMEOUT <= seconds < BOUND, (done.returncode, seconds)
    assert f"no answer within {ENGINE_TIMEOUT} s; the server is still running" in line, line
    assert _llama_servers(serving=model) == []  # stopped: SIGTERM reaches a stopped server with SIGCONT
    remove_kept_log(line, holding="llama")


class _Forking(EngineServer):
    """A 'server' that forks a child (an engine's worker) into its group, answers /health, then
    dies by SIGKILL on request: as vLLM's API server dies, leaving its engine and workers."""

    engine = "a forking server"

    def __init__(self):
        port = free_port()
        script = (
            "import http.server, os, signal, subprocess, sys\n"
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
            "class H(http.server.BaseHTTPRequestHandler):\n"
            "    def log_message(self, *a): pass\n"
            "    def do_GET(self):\n"
            "        if self.path == '/die': os.kill(os.getpid(), signal.SIGKILL)\n"
            "        self.send_response(200); self.end_headers()\n"
            f"http.server.HTTPServer(('127.0.0.1', {port}), H).serve_forever()\n"
        )
        super().__init__([sys.executable, "-c", script], port, start_timeout=60, request_timeout=10)


def test_a_dead_server_leaves_no_worker_and_says_so_in_one_line():
    server = _Forking()
    assert len(group_members(server.process.pid)) == 2  # the server and its worker
    with pytest.raises(UserError) as raised:
        server.get("/die")
    message = str(raised.value)
    assert message.startswith(f"a forking server on port {server.port}: /die: ") and "exited with code -9" in message
    assert len(group_members(server.process.pid)) == 1  # the worker outlives its server...
    server.close()
    assert group_members(server.process.pid) == []  # ...until the group is stopped
    assert message.endswith(f" (its whole log: {server.log.name})") and os.path.exists(server.log.name)
    os.unlink(server.log.name)


def test_a_start_up_that_points_at_its_cause_is_reported_by_that_cause():
    """vLLM's API server ends a failed start with `RuntimeError: Engine core initialization
    failed. See root cause above.`: the line to show is the engine core's own exception."""
    log = [
        "(EngineCore_DP0 pid=7) ERROR [core.py:708] EngineCore failed to start.",
        "(EngineCore_DP0 pid=7) Traceback (most recent call last):",
        "(EngineCore_DP0 pid=7) ValueError: No available memory for the cache blocks. Try increasing "
        "`VLLM_CPU_KVCACHE_SPACE`.",
        "Traceback (most recent call last):",
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}",
    ]

    class _FailingVllm(EngineServer):
        engine = "vLLM"
        FAILURE = VllmServer.FAILURE

    script = f"import sys; print({chr(10).join(log)!r}); sys.exit(1)"
    with pytest.raises(UserError) as raised:
        _FailingVllm([sys.executable, "-c", script], free_port(), start_timeout=60, request_timeout=10)
    kept = kept_log(str(raised.value))
    assert str(raised.value) == f"vLLM exited with code 1: {log[2]} (its whole log: {kept})"
    assert kept.read_text().splitlines() == log  # the whole log outlives the failed server
    kept.unlink()


def test_a_server_that_ends_well_leaves_no_log():
    server = _Forking()
    log = Path(server.log.name)
    assert log.exists()
    server.close()
    assert not log.exists()
