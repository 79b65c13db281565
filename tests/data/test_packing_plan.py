"""The epoch packing plan: a fresh global shuffle every epoch, every sample once, full rows."""

import collections

import numpy as np
import pytest

from dflash_jax.data.packing import plan_epoch


def chat_lengths(n, seq_len=3072, seed=0):
    """Lognormal lengths shaped like regenerated chat data (median ~600 tokens)."""
    lengths = np.random.default_rng(seed).lognormal(np.log(600), 0.9, n).round()
    return np.clip(lengths, 8, seq_len).astype(np.int64)


def batch_sets(plan):
    rows = [frozenset(plan.row(r).tolist()) for r in range(plan.num_rows)]
    g = plan.rows_per_batch
    return [frozenset().union(*rows[b * g : (b + 1) * g]) for b in range(plan.num_batches)]


def test_every_sample_exactly_once_in_rows_that_fit():
    lengths = chat_lengths(5000)
    plan = plan_epoch(lengths, 3072, rows_per_batch=16, seed=0, epoch=0)
    assert sorted(plan.doc_ids.tolist()) == list(range(len(lengths)))
    assert plan.num_rows == plan.num_batches * 16
    for r in range(plan.num_rows):
        assert lengths[plan.row(r)].sum() <= 3072


def test_rows_are_at_least_98_percent_full_on_chat_lengths():
    lengths = chat_lengths(20000)
    plan = plan_epoch(lengths, 3072, rows_per_batch=16, seed=0, epoch=0)
    assert lengths.sum() / (plan.num_rows * 3072) >= 0.98


def test_batch_composition_changes_every_epoch_and_plans_are_reproducible():
    lengths = chat_lengths(3000)
    epochs = [plan_epoch(lengths, 3072, 8, seed=0, epoch=e) for e in range(3)]
    for a in range(3):
        for b in range(a + 1, 3):
            assert not set(batch_sets(epochs[a])) & set(batch_sets(epochs[b]))
    again = plan_epoch(lengths, 3072, 8, seed=0, epoch=1)
    np.testing.assert_array_equal(again.doc_ids, epochs[1].doc_ids)
    np.testing.assert_array_equal(again.row_starts, epochs[1].row_starts)
    other_seed = plan_epoch(lengths, 3072, 8, seed=1, epoch=1)
    assert not np.array_equal(other_seed.doc_ids, epochs[1].doc_ids)


def test_no_length_sorting_short_and_long_samples_share_batches():
    lengths = chat_lengths(3000)
    plan = plan_epoch(lengths, 3072, 8, seed=0, epoch=0)
    batch_medians = [np.median(lengths[list(docs)]) for docs in batch_sets(plan)]
    # Sorted packing would spread batch medians over the whole length range.
    spread = np.percentile(batch_medians, 90) / np.percentile(batch_medians, 10)
    assert spread < 3


def test_last_batch_is_completed_without_empty_rows_or_repeats():
    lengths = np.full(37, 10)  # 6 docs per row of 64: 7 rows, completed to 2 batches of 5
    plan = plan_epoch(lengths, 64, rows_per_batch=5, seed=0, epoch=0)
    assert plan.num_rows == 10 and plan.num_batches == 2
    assert all(len(plan.row(r)) > 0 for r in range(plan.num_rows))
    assert collections.Counter(plan.doc_ids.tolist()) == collections.Counter(range(37))


def test_fewer_documents_than_rows_leaves_empty_rows():
    plan = plan_epoch(np.array([5, 6]), 64, rows_per_batch=4, seed=0, epoch=0)
    assert plan.num_batches == 1
    assert sorted(len(plan.row(r)) for r in range(4)) == [0, 0, 1, 1]


def test_a_sample_longer_than_a_row_is_refused():
    with pytest.raises(ValueError, match="exceeds seq_len 64"):
        plan_epoch(np.array([10, 65]), 64, rows_per_batch=2, seed=0, epoch=0)


@pytest.mark.parametrize("docs_per_row", [1, 3])
def test_docs_per_row_caps_every_row_and_still_uses_every_sample_once(docs_per_row):
    lengths = np.full(40, 10)  # 6 would fit in a row of 64
    plan = plan_epoch(lengths, 64, rows_per_batch=4, seed=0, epoch=0, docs_per_row=docs_per_row)
    sizes = [len(plan.row(r)) for r in range(plan.num_rows)]
    assert max(sizes) == docs_per_row
    assert collections.Counter(plan.doc_ids.tolist()) == collections.Counter(range(40))
    if docs_per_row == 1:  # one conversation per row, in an order of this seed and epoch alone
        assert plan.num_rows == 40
        again = plan_epoch(lengths, 64, rows_per_batch=4, seed=0, epoch=0, docs_per_row=1)
        next_epoch = plan_epoch(lengths, 64, rows_per_batch=4, seed=0, epoch=1, docs_per_row=1)
        np.testing.assert_array_equal(plan.doc_ids, again.doc_ids)
        assert not np.array_equal(plan.doc_ids, next_epoch.doc_ids)
        # Shuffled, not kept in file order: correlation with the file's order near 0.
        assert abs(np.corrcoef(plan.doc_ids, np.arange(40))[0, 1]) < 0.5
