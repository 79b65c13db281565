"""Packed batches from the grain pipeline: layout, exactly-once epochs, exact resume via Orbax."""

import collections
import itertools

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from dflash_jax.data.cache import CacheWriter, TokenizedCache
from dflash_jax.data.pipeline import DataIteratorRestore, DataIteratorSave, DataPipeline
from dflash_jax.data.settings import DataConfig

SEQ_LEN, ROWS = 64, 4


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """300 documents; every token of document d is d + 1, so any token names its document."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(3, SEQ_LEN + 1, 300)
    writer = CacheWriter(str(tmp_path_factory.mktemp("cache")))
    tokens = np.concatenate([np.full(n, d + 1) for d, n in enumerate(lengths)])
    writer.add(tokens, rng.integers(0, 2, len(tokens)), lengths)
    writer.finish({"inputs": {}})
    return TokenizedCache(writer.directory)


def pipeline(cache, **overrides):
    options = dict(seq_len=SEQ_LEN, global_batch_rows=ROWS, seed=0, read_threads=0)
    return DataPipeline(cache, DataConfig(**{**options, **overrides}))


def global_batches(cache, steps, **overrides):
    return list(itertools.islice(pipeline(cache, **overrides).iterator(process_index=0, process_count=1), steps))


def assert_batches_equal(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        for key in b:
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def documents(row):
    """The document ids of a packed row, in order."""
    return [int(row["tokens"][np.argmax(row["segment_ids"] == s)]) - 1 for s in range(1, row["segment_ids"].max() + 1)]


def rows_of(batch):
    return [{k: v[r] for k, v in batch.items()} for r in range(ROWS)]


def test_rows_hold_whole_documents_with_consistent_segments_positions_and_masks(cache):
    data = pipeline(cache)
    it = data.iterator(process_index=0, process_count=1)
    for batch in itertools.islice(it, data.steps_in_epoch(0)):
        assert {k: (v.shape, v.dtype) for k, v in batch.items()} == {
            k: ((ROWS, SEQ_LEN), np.int32) for k in ("tokens", "segment_ids", "positions", "loss_mask")
        }
        for row in rows_of(batch):
            seg = row["segment_ids"]
            used = int((seg > 0).sum())
            assert (seg[used:] == 0).all(), "padding only after the documents"
            for key in ("tokens", "positions", "loss_mask"):
                assert (row[key][used:] == 0).all()
            at = 0
            for s, doc in enumerate(documents(row), start=1):
                start, end = cache.offsets[doc], cache.offsets[doc + 1]
                n = end - start
                np.testing.assert_array_equal(seg[at : at + n], s)  # whole document, one segment
                np.testing.assert_array_equal(row["tokens"][at : at + n], cache.tokens[start:end])
                np.testing.assert_array_equal(row["loss_mask"][at : at + n], cache.loss_mask[start:end])
                np.testing.assert_array_equal(row["positions"][at : at + n], np.arange(n))
                at += n
            assert at == used


def test_each_epoch_uses_every_document_once_in_new_batches(cache):
    data = pipeline(cache)
    it = data.iterator(process_index=0, process_count=1)
    steps = [data.steps_in_epoch(e) for e in range(3)]
    compositions = []
    for epoch, n in enumerate(steps):
        assert it.epoch == epoch or (it.epoch, it.step) == (epoch - 1, steps[epoch - 1])
        batches = [frozenset(d for row in rows_of(b) for d in documents(row)) for b in itertools.islice(it, n)]
        assert collections.Counter(d for b in batches for d in b) == collections.Counter(range(cache.num_samples))
        compositions.append(set(batches))
    assert (it.epoch, it.step) == (2, steps[2])
    assert not compositions[0] & compositions[1] and not compositions[1] & compositions[2]
    assert data.total_steps(3) == sum(steps)


def test_steps_per_epoch_vary_and_are_known_before_the_epoch(cache):
    data = pipeline(cache, global_batch_rows=1)
    steps = [data.steps_in_epoch(e) for e in range(6)]
    assert len(set(steps)) > 1
    it = data.iterator(epoch=4, process_count=1, process_index=0)
    epoch_of_each_batch = [(next(it), it.epoch)[1] for _ in range(steps[4] + steps[5])]
    assert collections.Counter(epoch_of_each_batch) == {4: steps[4], 5: steps[5]}


def save_and_restore(path, saved, fresh):
    mngr = ocp.CheckpointManager(path)
    mngr.save(1, args=ocp.args.Composite(data=DataIteratorSave(saved)))
    mngr.wait_until_finished()
    restored = mngr.restore(1, args=ocp.args.Composite(data=DataIteratorRestore(fresh))).data
    mngr.close()
    return restored


def test_resume_mid_epoch_yields_the_uninterrupted_batches(cache, tmp_path):
    data = pipeline(cache)
    total = data.steps_in_epoch(0) + 5
    reference = global_batches(cache, total)
    interrupted = data.iterator(process_index=0, process_count=1)
    k = data.steps_in_epoch(0) - 3  # resume three steps before the epoch ends
    list(itertools.islice(interrupted, k))
    resumed = save_and_restore(
        tmp_path / "ckpt", interrupted, pipeline(cache).iterator(process_index=0, process_count=1)
    )
    assert (resumed.epoch, resumed.step) == (0, k)
    assert_batches_equal(list(itertools.islice(resumed, total - k)), reference[k:])


def test_two_processes_split_the_global_batch_and_resume_on_one(cache, tmp_path):
    steps = 12
    reference = global_batches(cache, steps)
    halves = [pipeline(cache).iterator(process_index=p, process_count=2) for p in range(2)]
    k = 7
    for want in reference[:k]:
        local = [next(h) for h in halves]
        assert all(part["tokens"].shape == (ROWS // 2, SEQ_LEN) for part in local)
        assert_batches_equal([{key: np.concatenate([p[key] for p in local]) for key in want}], [want])
    one = save_and_restore(
        tmp_path / "two_to_one", halves[0], pipeline(cache).iterator(process_index=0, process_count=1)
    )
    assert_batches_equal(list(itertools.islice(one, steps - k)), reference[k:])


def test_one_process_resumes_on_two(cache, tmp_path):
    steps, k = 10, 4
    reference = global_batches(cache, steps)
    one = pipeline(cache).iterator(process_index=0, process_count=1)
    list(itertools.islice(one, k))
    halves = [
        save_and_restore(tmp_path / f"one_to_two_{p}", one, pipeline(cache).iterator(process_index=p, process_count=2))
        for p in range(2)
    ]
    for want in reference[k:]:
        local = [next(h) for h in halves]
        assert_batches_equal([{key: np.concatenate([p[key] for p in local]) for key in want}], [want])


def test_restoring_into_a_different_plan_is_refused(cache):
    state = pipeline(cache).iterator(process_index=0, process_count=1).get_state()
    other = pipeline(cache, seed=1).iterator(process_index=0, process_count=1)
    with pytest.raises(ValueError, match="seed: saved 0, now 1"):
        other.set_state(state)


def test_a_global_batch_that_processes_cannot_split_is_refused(cache):
    with pytest.raises(ValueError, match="not divisible by 3 processes"):
        pipeline(cache).iterator(process_index=0, process_count=3)


def test_sharded_iterator_yields_global_jax_arrays(cache):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data", None))
    batches = list(itertools.islice(pipeline(cache).iterator(sharding=sharding), 3))
    for got, want in zip(batches, global_batches(cache, 3)):
        for key, value in got.items():
            assert isinstance(value, jax.Array) and value.sharding == sharding
            np.testing.assert_array_equal(np.asarray(value), want[key])
