"""`regenerate --backend=http` against real OpenAI-compatible servers: llama.cpp's `llama-server`
(the pinned build) serving the bundled tiny target written as GGUF, and vLLM's CPU build serving
it in float32. Each writes the same rows as `--backend=jax` for the same greedy settings: both
servers render the prompt with the target's own chat template (the one `ChatTokenizer` renders),
stop on the same tokens (the generation config's and the tokenizer's end of sequence) and return
the answer without its stop token, as `ChatTokenizer.response_text` does; float32 weights and
caches on both sides, so that no near-tie flips a greedy token. A server killed (SIGKILL) mid-run
stops the run in one line naming `--server_url`; the rerun against a new server writes exactly the
rows missing, and stopping the killed server leaves none of its processes behind (vLLM's engine
and worker outlive its API server until its process group is stopped)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from absl import flags

from dflash_jax import regenerate
from dflash_jax.bundled import ASSETS
from dflash_jax.decoding.engines.llama_cpp import build_server, find_server
from dflash_jax.decoding.engines.llama_server import LlamaServer
from dflash_jax.decoding.engines.server import group_members
from dflash_jax.decoding.engines.vllm import find_python, probe
from dflash_jax.decoding.engines.vllm_server import VllmServer
from dflash_jax.decoding.regeneration import failures_path
from dflash_jax.errors import UserError
from dflash_jax.models.formats.gguf_target import write_target_gguf

pytestmark = pytest.mark.slow

TARGET = os.path.join(ASSETS, "tiny-qwen3")
ROWS = 8  # of the held-out prompts
MAX_NEW_TOKENS = 48
KILL_AFTER = 3  # rows written before the server is killed
# llama.cpp's float32 KV caches (float16 by default).
EXACT = ("-ctk", "f32", "-ctv", "f32")


def _run(args: list[str]) -> None:
    flag_values = flags.FlagValues()
    regenerate.define_flags(flag_values)
    flag_values(["regenerate", *args])
    regenerate.main([], flag_values)


def _rows(path: Path) -> dict[int, dict]:
    """The output's rows by input line; a line written twice fails."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    by_line = {row["regenerated"]["line"]: row for row in rows}
    assert len(by_line) == len(rows), "a row was written twice"
    return by_line


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    path = tmp_path_factory.mktemp("regenerate") / "input.jsonl"
    lines = Path(ASSETS, "data", "heldout_prompts.jsonl").read_text().splitlines()[:ROWS]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def jax_rows(source, tmp_path_factory):
    output = tmp_path_factory.mktemp("jax") / "out.jsonl"
    _run([f"--input={source}", f"--output={output}", f"--target={TARGET}", "--backend=jax", "--dtype=float32",
          f"--max_new_tokens={MAX_NEW_TOKENS}", "--batch_size=4"])  # fmt: skip
    rows = _rows(output)
    assert sorted(rows) == list(range(1, ROWS + 1))
    return rows


def _llama_cpp(tmp_path_factory):
    binary = find_server() or build_server()
    target_gguf = write_target_gguf(TARGET, tmp_path_factory.mktemp("gguf") / "tiny-qwen3.gguf")
    return lambda: LlamaServer(binary, target_gguf, threads=1, extra_args=EXACT)


def _vllm(tmp_path_factory):
    python = find_python()
    env = probe(python) if python else None
    if env is None:
        pytest.skip("vLLM is not installed: `dflash-jax install-vllm` installs its CPU build")
    return lambda: VllmServer(env, Path(TARGET), dtype="float32", max_model_len=1024)


@pytest.mark.parametrize("engine", ["llama.cpp", "vllm"])
def test_a_real_server_writes_the_jax_rows_and_a_rerun_after_its_death_writes_the_rest(
    engine, source, jax_rows, tmp_path, tmp_path_factory
):
    start = (_llama_cpp if engine == "llama.cpp" else _vllm)(tmp_path_factory)
    output = tmp_path / "out.jsonl"
    args = [f"--input={source}", f"--output={output}", "--backend=http", f"--max_new_tokens={MAX_NEW_TOKENS}"]
    args += ["--concurrency=1", "--retries=0", "--request_timeout=300"]

    with start() as server:

        def kill_when_rows_are_written():
            deadline = time.monotonic() + 600
            while not (output.exists() and len(output.read_text().splitlines()) >= KILL_AFTER):
                if time.monotonic() > deadline:
                    return
                time.sleep(0.05)
            os.kill(server.process.pid, signal.SIGKILL)  # the server alone: an engine's workers stay

        killer = threading.Thread(target=kill_when_rows_are_written, daemon=True)
        killer.start()
        with pytest.raises(UserError) as raised:
            _run([*args, f"--server_url={server.url}/v1"])
        killer.join(timeout=5)
        pgid = server.process.pid
    assert str(raised.value).startswith(f"--server_url={server.url}/v1: stopped: "), raised.value
    assert "\n" not in str(raised.value)
    assert group_members(pgid) == []  # closing the server stopped every process it started
    before = _rows(output)
    assert KILL_AFTER <= len(before) < ROWS

    with start() as server:
        _run([*args, f"--server_url={server.url}/v1"])
    after = _rows(output)
    assert sorted(after) == list(range(1, ROWS + 1))  # every row once: the missing ones written
    assert not Path(failures_path(str(output))).exists()  # no row still failing
    assert {line: after[line] for line in before} == before  # the rows done before kept as they were
    for line, row in after.items():
        assert row["messages"] == jax_rows[line]["messages"], (engine, line)
        assert row["regenerated"]["finish_reasons"] == jax_rows[line]["regenerated"]["finish_reasons"], line
