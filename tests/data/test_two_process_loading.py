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
