"""Two real JAX processes each load only their rows; together they form the global batch."""

import socket
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from dflash_jax.data.cache import CacheWriter

pytestmark = pytest.mark.slow  # two processes

WORKER = textwrap.dedent(
    """
    import itertools, os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    process_id, port, cache_dir = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
    from dflash_jax.data.cache import TokenizedCache
    from dflash_jax.data.pipeline import DataPipeline
    from dflash_jax.data.settings import DataConfig

    def pipeline():
        settings = DataConfig(seq_len=32, global_batch_rows=8, read_threads=0)
        return DataPipeline(TokenizedCache(cache_dir), settings)

    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data", None))
    it = pipeline().iterator(sharding=sharding)
    assert list(it._rows) == list(range(4 * process_id, 4 * process_id + 4)), it._rows
    single = pipeline().iterator(process_index=0, process_count=1)
    for want in itertools.islice(single, 6):
        got = next(it)
        for key, value in got.items():
            assert value.shape == (8, 32)
            gathered = np.asarray(multihost_utils.process_allgather(value, tiled=True))
            assert np.array_equal(gathered, want[key]), (process_id, key)
    print("ok", process_id)
    """
)


def test_each_process_loads_its_rows_of_the_global_batch(tmp_path):
    rng = np.random.default_rng(0)
    lengths = rng.integers(3, 33, 100)
    writer = CacheWriter(str(tmp_path))
    tokens = rng.integers(1, 1000, int(lengths.sum()))
    writer.add(tokens, rng.integers(0, 2, len(tokens)), lengths)
    writer.finish({"inputs": {}})
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, str(p), port, str(tmp_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for p in range(2)
    ]
    for p, worker in enumerate(workers):
        output, _ = worker.communicate(timeout=120)
        assert worker.returncode == 0 and f"ok {p}" in output, output[-3000:]


SAME_CACHE_WORKER = textwrap.dedent(
    """
    import sys
    import jax

    process_id, port, cache_dir = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
    from dflash_jax.data.cache import TokenizedCache
    from dflash_jax.data.same_cache import check_same_cache
    from dflash_jax.errors import DataError

    try:
        check_same_cache(TokenizedCache(cache_dir))
        print("same", process_id)
    except DataError as e:
        print("error:", e)
    """
)


def write_cache(directory, seed: int) -> str:
    rng = np.random.default_rng(seed)
    directory.mkdir()
    writer = CacheWriter(str(directory))
    lengths = rng.integers(3, 33, 20)
    tokens = rng.integers(1, 1000, int(lengths.sum()))
    writer.add(tokens, rng.integers(0, 2, len(tokens)), lengths)
    writer.finish({"inputs": {}})
    return str(directory)


def run_two(worker: str, args: list[list[str]]) -> list[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", worker, str(p), port, *args[p]],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for p in range(2)
    ]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    return outputs


def test_hosts_that_see_different_caches_stop_with_one_line(tmp_path):
    # Two local copies of one cache (each host tokenized the same data): the same contents.
    same = run_two(SAME_CACHE_WORKER, [[write_cache(tmp_path / f"same{p}", seed=0)] for p in range(2)])
    assert all(f"same {p}" in out for p, out in enumerate(same)), same
    # Another host's cache holds other data: both processes stop, each with one line.
    differ = run_two(SAME_CACHE_WORKER, [[write_cache(tmp_path / f"differ{p}", seed=p)] for p in range(2)])
    for out in differ:
        line = next(line for line in out.splitlines() if line.startswith("error:"))
        assert "the hosts see different tokenized caches (process 1's differs from process 0's" in line, out
        assert line.endswith("put data.cache_dir on storage every host shares, with the same data.train")
