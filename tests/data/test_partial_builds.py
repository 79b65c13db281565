"""A killed cache build leaves its hidden partial directory behind; the next build of the same
cache removes it once its builder is gone (or it is a day old), and says so in one log line."""

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from dflash_jax.data import cache as cache_lib
from dflash_jax.data.build import ensure_cache
from support.chat_data import chat, data_config, write_jsonl, write_tiny_target

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def target(tmp_path):
    return str(write_tiny_target(tmp_path / "target"))


def partials(parent, name="cache"):
    return sorted(p for p in os.listdir(parent) if p.startswith(f".{name}.partial-"))


def make_partial(parent, suffix, builder=None, age_s=0.0):
    path = parent / f".cache.partial-{suffix}"
    path.mkdir()
    if builder is not None:
        (path / cache_lib.BUILDER).write_text(json.dumps(builder))
    if age_s:
        stamp = time.time() - age_s
        os.utime(path, (stamp, stamp))
    return path


@pytest.mark.slow
def test_a_killed_build_is_cleaned_by_the_next_one(tmp_path, target, caplog):
    source = write_jsonl(tmp_path / "train.jsonl", [chat("What is the capital?", "Paris.")] * 3)
    started = tmp_path / "started"
    script = textwrap.dedent(
        f"""
        import sys, time
        sys.path.insert(0, {TESTS!r})
        from dflash_jax.data import cache
        from dflash_jax.data.build import ensure_cache
        from support.chat_data import data_config

        def hang(self, *args):  # the build is under way: its partial directory exists
            open({str(started)!r}, "w").close()
            time.sleep(600)

        cache.CacheWriter.add = hang
        ensure_cache(data_config({str(source)!r}, {str(tmp_path / "cache")!r}), {target!r})
        """
    )
    builder = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.time() + 120
        while not started.exists() and builder.poll() is None and time.time() < deadline:
            time.sleep(0.1)
        assert started.exists(), "the build never started"
    finally:
        os.kill(builder.pid, signal.SIGKILL)
        builder.wait()
    [left] = partials(tmp_path)
    marker = json.loads((tmp_path / left / cache_lib.BUILDER).read_text())
    assert marker["pid"] == builder.pid and marker["host"] == socket.gethostname()

    with caplog.at_level(logging.WARNING):
        cache = ensure_cache(data_config(source, tmp_path / "cache"), target)
    assert cache.num_samples == 3 and partials(tmp_path) == []
    assert not os.path.exists(os.path.join(cache.directory, cache_lib.BUILDER))
    [line] = [r.getMessage() for r in caplog.records if "abandoned" in r.getMessage()]
    assert line == (
        f"removed 1 abandoned partial build(s) of {tmp_path / 'cache'}: {left} "
        f"(its builder, pid {builder.pid} on this host, is no longer running)"
    )


@pytest.mark.slow
def test_only_partials_whose_builder_is_gone_are_removed(tmp_path):
    host = socket.gethostname()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    alive = os.getppid()
    make_partial(tmp_path, "dead", {"host": host, "pid": dead.pid, "started": time.time()})
    make_partial(tmp_path, "alive", {"host": host, "pid": alive, "started": time.time()})
    make_partial(tmp_path, "mine", {"host": host, "pid": os.getpid(), "started": time.time()})
    make_partial(tmp_path, "elsewhere", {"host": "another-host", "pid": 1, "started": time.time()})
    make_partial(tmp_path, "elsewhere-old", {"host": "another-host", "pid": 1, "started": time.time() - 2 * 86400})
    make_partial(tmp_path, "unmarked-old", age_s=2 * 86400)
    make_partial(tmp_path, "unmarked-new")
    (tmp_path / ".other.partial-dead").mkdir()  # another cache's: not ours to judge

    removed = cache_lib.remove_abandoned_partials(str(tmp_path / "cache"))
    assert [r.split(" ")[0] for r in removed] == [
        ".cache.partial-dead",
        ".cache.partial-elsewhere-old",
        ".cache.partial-unmarked-old",
    ]
    assert "started 48 h ago" in removed[1]
    assert partials(tmp_path) == [
        ".cache.partial-alive",
        ".cache.partial-elsewhere",
        ".cache.partial-mine",
        ".cache.partial-unmarked-new",
    ]
    assert (tmp_path / ".other.partial-dead").is_dir()
