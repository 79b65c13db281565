"""Every host of a multi-host run trains on one tokenized cache, or stops at start-up.

Each process loads only its own rows of every global batch, by index into its view of the cache;
hosts that tokenized different data (another `data.train`, a changed file, a local cache built
from another copy) would silently train on batches no single data set holds. Each process
gathers the others' content hashes (`content_sha256` of the manifest) and compares them.
"""

from __future__ import annotations

import jax
import numpy as np

from dflash_jax.data.cache import TokenizedCache
from dflash_jax.errors import DataError


def check_same_cache(cache: TokenizedCache) -> None:
    """A one-line DataError on every process when some process's cache holds other contents."""
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    # The first 16 bytes of the hash, as int32s: every collective back-end gathers those.
    mine = np.frombuffer(bytes.fromhex(cache.manifest["content_sha256"])[:16], np.int32)
    every = np.asarray(multihost_utils.process_allgather(mine)).reshape(jax.process_count(), -1)
    differ = [p for p in range(len(every)) if not np.array_equal(every[p], every[0])]
    if differ:
        raise DataError(
            f"the hosts see different tokenized caches (process {differ[0]}'s differs from process 0's; this "
            f"process reads {cache.directory}): put data.cache_dir on storage every host shares, with the same data.train"
        )
