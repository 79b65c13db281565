"""Packed, globally shuffled training batches as global jax arrays, with exact resume.

How training uses it::

    from dflash_jax.data import pipeline as data_lib

    # Builds the tokenized cache if missing or stale (same as `python -m dflash_jax.prepare`).
    data = data_lib.DataPipeline.from_config(setup.data, setup.target_path)  # a checked DataConfig
    total_steps = data.total_steps(setup.run.num_epochs)  # exact: every epoch is planned up front
    data.steps_in_epoch(epoch)                             # varies by epoch; for progress and ETA

    # Batch rows split over the data axes; each process loads only its own rows.
    sharding = jax.sharding.NamedSharding(mesh, P(("data", "fsdp"), None))
    it = data.iterator(sharding=sharding)                  # or iterator(epoch=e, step=s, sharding=...)
    batch = next(it)   # {"tokens", "segment_ids", "positions", "loss_mask"}: int32 jax.Arrays of
                       # shape data.batch_shape [global_batch_rows, seq_len] placed with `sharding`
    it.epoch, it.step  # position of the next batch (step within the epoch)

    # Orbax: the iterator state is one JSON file, written by the primary process and readable
    # by any number of processes (same global batch), so resume may change the process count.
    mngr.save(step, args=ocp.args.Composite(state=..., data=data_lib.DataIteratorSave(it)))
    restored = mngr.restore(step, args=ocp.args.Composite(state=..., data=data_lib.DataIteratorRestore(it)))
    it = restored.data   # the same iterator, now positioned after the checkpointed step

Batch layout per row: documents packed back to back; `segment_ids` 1, 2, ... per document and
0 on padding; `positions` restart at 0 in every document (0 on padding); `loss_mask` 1 on
assistant tokens (all tokens of plain-text documents). Attention and labels must never cross a
segment boundary. The last batch of an epoch is completed with documents moved out of fuller
rows, so every sample is used exactly once per epoch, except the samples the held-out split keeps
out of training (`heldout_rows`, see `data.heldout`), which are never used.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from typing import Any

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp

from dflash_jax.data.build import ensure_cache
from dflash_jax.data.cache import TokenizedCache
from dflash_jax.data.heldout import heldout_samples
from dflash_jax.data.packing import FIELDS, EpochPlan, plan_epoch
from dflash_jax.data.same_cache import check_same_cache
from dflash_jax.data.settings import DataConfig


class DataPipeline:
    """Plans epochs over a tokenized cache and makes iterators over them."""

    def __init__(self, cache: TokenizedCache, settings: DataConfig):
        """Batches of `cache` as `settings` packs, shuffles, holds out and loads them (its
        fields seq_len, global_batch_rows, seed, pack_window, docs_per_row, heldout_rows,
        read_threads and prefetch_batches; the cache was built from the others)."""
        self.cache, self.settings = cache, settings
        self.heldout = heldout_samples(cache, settings.heldout_rows)
        # The samples epochs are planned over; a plan's document d is sample train_samples[d].
        self.train_samples = np.setdiff1d(np.arange(cache.num_samples), self.heldout)
        self.read_options = grain.ReadOptions(
            num_threads=settings.read_threads, prefetch_buffer_size=settings.prefetch_batches
        )
        self._steps_in_epoch: dict[int, int] = {}
        # The iterator needs the current epoch's plan, and at an epoch boundary the next one.
        self.plan = functools.lru_cache(maxsize=2)(self._plan)

    @classmethod
    def from_config(cls, data: DataConfig, target_path: str, *, rebuild: bool = False) -> DataPipeline:
        """Over the cache of `data` (built first if missing, stale, or `rebuild`), the same on
        every host."""
        cache = ensure_cache(data, target_path, rebuild=rebuild)
        check_same_cache(cache)
        return cls(cache, data)

    @property
    def batch_shape(self) -> tuple[int, int]:
        """[global_batch_rows, seq_len]: the shape of every global batch."""
        return self.settings.global_batch_rows, self.settings.seq_len

    def trained_token_counts(self, vocab_size: int) -> np.ndarray:
        """How often each token id is trained on [vocab_size], the held-out prompts left out."""
        return self.cache.trained_token_counts(vocab_size, leave_out=self.heldout)

    def steps_in_epoch(self, epoch: int) -> int:
        if epoch not in self._steps_in_epoch:
            self.plan(epoch)
        return self._steps_in_epoch[epoch]

    def total_steps(self, num_epochs: int) -> int:
        return sum(self.steps_in_epoch(e) for e in range(num_epochs))

    def iterator(
        self,
        *,
        epoch: int = 0,
        step: int = 0,
        sharding: jax.sharding.Sharding | None = None,
        process_index: int | None = None,
        process_count: int | None = None,
    ) -> DataIterator:
        """Batches from (epoch, step) on, endlessly. With `sharding`, global jax arrays of this
        process's rows; without, this process's rows as numpy ([global_batch_rows /
        process_count, seq_len]; process index and count default to jax's)."""
        if sharding is not None:
            rows = sharding_rows(sharding, self.batch_shape)
        else:
            rows = process_rows(
                self.settings.global_batch_rows,
                jax.process_index() if process_index is None else process_index,
                jax.process_count() if process_count is None else process_count,
            )
        return DataIterator(self, rows, epoch, step, sharding)

    @property
    def fingerprint(self) -> dict[str, Any]:
        """What must be unchanged for a saved iterator state to mean the same batches."""
        fingerprint = {
            "data_sha256": self.cache.manifest["content_sha256"],
            "seq_len": self.settings.seq_len,
            "global_batch_rows": self.settings.global_batch_rows,
            "seed": self.settings.seed,
            "pack_window": self.settings.pack_window,
        }
        if self.settings.docs_per_row:  # absent otherwise, so runs saved before the cap still resume
            fingerprint["docs_per_row"] = self.settings.docs_per_row
        if self.settings.heldout_rows:  # absent otherwise, so runs saved before the split still resume
            fingerprint["heldout_rows"] = self.settings.heldout_rows
            fingerprint["heldout_sha256"] = hashlib.sha256(self.heldout.astype(np.int64).tobytes()).hexdigest()
        return fingerprint

    def epoch_batches(self, epoch: int, rows: range) -> grain.MapDataset:
        """Batch b of the epoch → rows `rows` of global batch b, materialized from the cache."""
        plan = self.plan(epoch)
        loader = _RowLoader(self.cache, plan, self.settings.seq_len, rows)
        return grain.MapDataset.range(plan.num_batches * len(rows)).map(loader).batch(len(rows))

    def _plan(self, epoch: int) -> EpochPlan:
        lengths = self.cache.lengths[self.train_samples]
        s = self.settings
        plan = plan_epoch(lengths, s.seq_len, s.global_batch_rows, s.seed, epoch, s.pack_window, s.docs_per_row)
        self._steps_in_epoch[epoch] = plan.num_batches
        return dataclasses.replace(plan, doc_ids=self.train_samples[plan.doc_ids])


class DataIterator:
    """Endless iterator over epochs; its state is (epoch, step within epoch)."""

    def __init__(self, pipeline: DataPipeline, rows: range, epoch: int, step: int, sharding=None):
        self._pipeline = pipeline
        self._rows = rows
        self._sharding = sharding
        self._epoch, self._step = epoch, step
        self._batches = None  # grain iterator of the current epoch, from self._step on

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def step(self) -> int:
        return self._step

    def __iter__(self) -> DataIterator:
        return self

    def __next__(self) -> dict[str, Any]:
        if self._step >= self._pipeline.steps_in_epoch(self._epoch):
            self._epoch, self._step, self._batches = self._epoch + 1, 0, None
        if self._batches is None:
            batches = self._pipeline.epoch_batches(self._epoch, self._rows)[self._step :]
            self._batches = iter(batches.to_iter_dataset(self._pipeline.read_options))
        batch = next(self._batches)
        self._step += 1
        if self._sharding is None:
            return batch
        shape = self._pipeline.batch_shape
        return {k: jax.make_array_from_process_local_data(self._sharding, v, shape) for k, v in batch.items()}

    def get_state(self) -> dict[str, Any]:
        return {"epoch": self._epoch, "step": self._step, **self._pipeline.fingerprint}

    def set_state(self, state: dict[str, Any]) -> None:
        expected = self._pipeline.fingerprint
        changed = {k: (state.get(k), v) for k, v in expected.items() if state.get(k) != v}
        if changed:
            details = ", ".join(f"{k}: saved {old!r}, now {new!r}" for k, (old, new) in changed.items())
            raise ValueError(f"cannot resume the data iterator: the data or batching changed ({details})")
        self._epoch, self._step, self._batches = state["epoch"], state["step"], None


def process_rows(global_batch_rows: int, process_index: int, process_count: int) -> range:
    """The rows of every global batch that process `process_index` loads."""
    if global_batch_rows % process_count:
        raise ValueError(f"data.global_batch_rows={global_batch_rows} is not divisible by {process_count} processes")
    per_process = global_batch_rows // process_count
    return range(process_index * per_process, (process_index + 1) * per_process)


def sharding_rows(sharding: jax.sharding.Sharding, global_shape: tuple[int, int]) -> range:
    """The contiguous rows of a global batch this process's devices hold under `sharding`."""
    slices = {
        idx[0].indices(global_shape[0])[:2] for idx in sharding.addressable_devices_indices_map(global_shape).values()
    }
    starts, stops = zip(*sorted(slices))
    if any(stop != start for stop, start in zip(stops[:-1], starts[1:])):
        raise ValueError(f"this process's batch rows {sorted(slices)} are not contiguous under {sharding}")
    return range(starts[0], stops[-1])


class _RowLoader:
    """Local row index → one packed row of `seq_len` (a grain map function)."""

    def __init__(self, cache: TokenizedCache, plan: EpochPlan, seq_len: int, rows: range):
        self._cache, self._plan, self._seq_len, self._rows = cache, plan, seq_len, rows
        self._positions = np.arange(seq_len, dtype=np.int32)

    def __call__(self, i: int) -> dict[str, np.ndarray]:
        batch, r = divmod(i, len(self._rows))
        docs = self._plan.row(batch * self._plan.rows_per_batch + self._rows[r])
        row = {k: np.zeros(self._seq_len, np.int32) for k in FIELDS}
        at = 0
        for segment, doc in enumerate(docs, start=1):
            start, end = self._cache.offsets[doc], self._cache.offsets[doc + 1]
            n = end - start
            row["tokens"][at : at + n] = self._cache.tokens[start:end]
            row["loss_mask"][at : at + n] = self._cache.loss_mask[start:end]
            row["segment_ids"][at : at + n] = segment
            row["positions"][at : at + n] = self._positions[:n]
            at += n
        return row


class DataIteratorHandler(ocp.handlers.JsonCheckpointHandler):
    """Orbax handler for a `DataIterator`: its global state as JSON, process-count independent."""

    def __init__(self):
        super().__init__(filename="data_iterator.json")

    async def async_save(self, directory, item=None, args: DataIteratorSave | None = None):
        return await super().async_save(directory, args=ocp.args.JsonSave(args.iterator.get_state()))

    def restore(self, directory, item=None, args: DataIteratorRestore | None = None) -> DataIterator:
        args.iterator.set_state(super().restore(directory))
        return args.iterator


@ocp.args.register_with_handler(DataIteratorHandler, for_save=True)
@dataclasses.dataclass
class DataIteratorSave(ocp.args.CheckpointArgs):
    iterator: DataIterator


@ocp.args.register_with_handler(DataIteratorHandler, for_restore=True)
@dataclasses.dataclass
class DataIteratorRestore(ocp.args.CheckpointArgs):
    iterator: DataIterator
