"""Building the tokenized cache from the sources: streamed, tokenized on every core, counted,
published atomically, and rebuilt only when something it depends on changed.

No input row stops a build by crashing it: each bad row is a `BadSample`, skipped and counted
under its reason (`formats.SKIP_REASONS`) with a few examples in the manifest, or, with
`data.on_bad_sample='error'`, the first one stops the build with a one-line `DataError`:

    /data/train.jsonl:12: messages[1].content is null, not a string [bad_content]; set data.on_bad_sample='skip' to skip and count such rows

(Parquet rows read `/data/train.parquet (row 11): ...`, 0-based). Problems with a whole file,
and sources without any usable row, are one-line `DataError`s naming the file.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import hashlib
import json
import logging
import multiprocessing
import os
import shutil
import time
from collections.abc import Callable, Iterable, Iterator

import numpy as np
import tqdm

from dflash_jax.data import cache as cache_lib
from dflash_jax.data.formats import SKIP_REASONS, BadSample, decode_json_line, normalize_record
from dflash_jax.data.heldout import first_prompt, prompt_key
from dflash_jax.data.sample_encoder import SampleEncoder, tokenizer_fingerprint
from dflash_jax.data.settings import DataConfig
from dflash_jax.data.sources import RawChunk, describe_sources, iter_chunks, resolve_sources
from dflash_jax.errors import DataError

# Bump when the cache's contents change meaning (masking rules, layout): old caches go stale.
# 2: control-token text skipped, <think> blocks split out, assistant-first conversations kept.
# 3: samples.npy (each sample's source row and prompt key, for the held-out split).
CACHE_FORMAT_VERSION = 3
ROWS_PER_CHUNK = 256
EXAMPLES_PER_REASON = 5
BYTES_PER_WORKER = 32 << 20


def ensure_cache(data: DataConfig, target_path: str, *, rebuild: bool = False) -> cache_lib.TokenizedCache:
    """The cache for `data` and the tokenizer in `target_path`, built if missing or stale."""
    cache_dir = resolve_cache_dir(data, target_path)
    cache_lib.check_replaceable(cache_dir)
    inputs = cache_inputs(data, target_path)
    manifest = cache_lib.read_manifest(cache_dir)
    if manifest is not None and not rebuild:
        reasons = stale_reasons(manifest["inputs"], inputs)
        if not reasons:
            _check_skips_allowed(manifest, data.on_bad_sample)
            return cache_lib.TokenizedCache(cache_dir)
        logging.warning("rebuilding tokenized cache %s, which is stale: %s", cache_dir, "; ".join(reasons))
    return build_cache(data, target_path, cache_dir, inputs)


def resolve_cache_dir(data: DataConfig, target_path: str) -> str:
    if data.cache_dir:
        return os.path.abspath(os.path.expanduser(data.cache_dir))
    target = os.path.abspath(target_path)
    key = hashlib.sha256(json.dumps([data.train, target]).encode()).hexdigest()[:12]
    parent, name = os.path.split(target)
    if os.path.basename(parent) == "snapshots":  # a hub snapshot, models--org--name/snapshots/<commit>
        name = os.path.basename(os.path.dirname(parent)).removeprefix("models--")
    return os.path.join(os.path.expanduser("~/.cache/dflash_jax/tokenized"), f"{name}-{key}")


def cache_inputs(data: DataConfig, target_path: str) -> dict:
    """Everything the cache contents depend on; any change makes the cache stale."""
    return {
        "format_version": CACHE_FORMAT_VERSION,
        "sources": describe_sources(resolve_sources(data.train)),
        "tokenizer_files": tokenizer_fingerprint(target_path),
        "options": {
            "format": data.format,
            "enable_thinking": data.enable_thinking,
            "seq_len": data.seq_len,
            "overlength": data.overlength,
        },
    }


def stale_reasons(old: dict, new: dict) -> list[str]:
    """Human-readable differences between the inputs a cache was built from and current ones."""
    reasons = []
    if old.get("format_version") != new["format_version"]:
        reasons.append(f"cache format {old.get('format_version')} -> {new['format_version']}")
    old_sources = {s["path"]: s for s in old.get("sources", [])}
    new_sources = {s["path"]: s for s in new["sources"]}
    for path in sorted(old_sources.keys() | new_sources.keys()):
        before, after = old_sources.get(path), new_sources.get(path)
        if before is None:
            reasons.append(f"new source {path}")
        elif after is None:
            reasons.append(f"source {path} no longer selected")
        elif before != after:
            reasons.append(f"source {path} changed (size {before['size']} -> {after['size']}, modified)")
    old_files, new_files = old.get("tokenizer_files", {}), new["tokenizer_files"]
    for name in sorted(old_files.keys() | new_files.keys()):
        if old_files.get(name) != new_files.get(name):
            reasons.append(f"tokenizer file {name} changed")
    old_options, new_options = old.get("options", {}), new["options"]
    for key in sorted(new_options):
        if old_options.get(key) != new_options[key]:
            reasons.append(f"data.{key} {old_options.get(key)!r} -> {new_options[key]!r}")
    return reasons


def build_cache(data: DataConfig, target_path: str, cache_dir: str, inputs: dict) -> cache_lib.TokenizedCache:
    started = time.time()
    encoder = _encoder(target_path, data.enable_thinking)  # fails fast on a bad tokenizer
    paths = [s["path"] for s in inputs["sources"]]
    tokenize = ChunkTokenizer(target_path, data.enable_thinking, data.format, data.seq_len, data.overlength)
    total_bytes = sum(s["size"] for s in inputs["sources"])
    processes = data.tokenize_processes or _default_processes(total_bytes)
    counts = _Counts()
    source_of = {path: i for i, path in enumerate(paths)}
    removed = cache_lib.remove_abandoned_partials(cache_dir)
    if removed:
        logging.warning("removed %d abandoned partial build(s) of %s: %s", len(removed), cache_dir, "; ".join(removed))
    partial = cache_lib.new_partial_dir(cache_dir)
    writer = cache_lib.CacheWriter(partial)
    try:
        with tqdm.tqdm(total=total_bytes, unit="B", unit_scale=True, desc="tokenizing", smoothing=0.1) as bar:
            chunks = iter_chunks(paths, ROWS_PER_CHUNK, data.format)
            for result in _ordered_map(tokenize, chunks, processes):
                if data.on_bad_sample == "error" and result.examples:
                    raise DataError(_bad_sample_message(*result.examples[0]))
                counts.add(result)
                result.samples["source"] = source_of[result.path]
                writer.add(result.tokens, result.loss_mask, result.lengths, result.samples)
                bar.update(result.nbytes)
                bar.set_postfix(samples=counts.samples, skipped=sum(counts.skipped.values()), refresh=False)
        if counts.samples == 0:
            raise DataError(_no_usable_sample_message(data.train, counts))
        manifest = writer.finish(
            {
                "inputs": inputs,
                **counts.as_manifest(),
                **length_statistics(writer.lengths, data.seq_len),
                "tokenizer": {"chat_template_sha256": encoder.chat_template_sha256, "vocab_size": encoder.vocab_size},
                "build_seconds": round(time.time() - started, 1),
            }
        )
        cache_lib.publish(partial, cache_dir)
    except BaseException:
        writer.abort()
        shutil.rmtree(partial, ignore_errors=True)
        raise
    logging.info("tokenized cache %s: %s", cache_dir, summarize(manifest))
    return cache_lib.TokenizedCache(cache_dir)


def length_statistics(lengths: np.ndarray, seq_len: int) -> dict:
    edges = np.linspace(0, seq_len, 17).round().astype(int)
    counts, _ = np.histogram(lengths, bins=edges)
    return {
        "length_histogram": {"edges": edges.tolist(), "counts": counts.tolist()},
        "length_percentiles": {f"p{q}": int(np.percentile(lengths, q)) for q in (10, 50, 90, 99, 100)},
        "mean_length": float(lengths.mean()),
    }


def summarize(manifest: dict) -> str:
    skipped = {k: v for k, v in manifest["skipped"].items() if v}
    return (
        f"{manifest['num_samples']} samples, {manifest['num_tokens']} tokens "
        f"({manifest['num_loss_tokens']} trained on) from {manifest['rows_read']} rows; "
        f"{manifest['truncated']} truncated; skipped {sum(skipped.values())}: {skipped or 'none'}"
    )


@dataclasses.dataclass
class ChunkResult:
    path: str
    tokens: np.ndarray
    loss_mask: np.ndarray
    lengths: np.ndarray
    samples: np.ndarray  # cache.SAMPLE_FIELDS of each sample (`source` is the builder's to set)
    rows: int
    nbytes: int
    truncated: int
    skipped: collections.Counter
    # (reason, "location: detail") of the first bad rows, in row order, a few per reason.
    examples: list[tuple[str, str]]


@dataclasses.dataclass(frozen=True)
class ChunkTokenizer:
    """Turns one raw chunk into cache-ready arrays. Picklable: the tokenizer itself is loaded
    once per process (see `_encoder`)."""

    tokenizer_dir: str
    enable_thinking: bool
    data_format: str
    seq_len: int
    overlength: str

    def __call__(self, chunk: RawChunk) -> ChunkResult:
        encoder = _encoder(self.tokenizer_dir, self.enable_thinking)
        tokens, masks, samples = [], [], []
        rows = truncated = 0
        skipped: collections.Counter = collections.Counter()
        examples: list[tuple[str, str]] = []
        for i, row in enumerate(chunk.rows):
            if isinstance(row, bytes) and not row.strip():
                continue  # blank JSONL line: not a row
            rows += 1
            try:
                record = decode_json_line(row) if isinstance(row, bytes) else row
                sample = normalize_record(record, self.data_format)
                ids, mask = encoder.encode(sample, max_len=self.seq_len)
                if len(ids) > self.seq_len:
                    ids, mask = self._fit(ids, mask)
                    truncated += 1
            except BadSample as e:
                skipped[e.reason] += 1
                if skipped[e.reason] <= EXAMPLES_PER_REASON:
                    examples.append((e.reason, f"{chunk.location(i)}: {_one_line(e.detail)}"))
                continue
            tokens.append(ids)
            masks.append(mask)
            prompt = first_prompt(sample)
            samples.append((0, chunk.first_row + i, prompt_key(prompt) if prompt else 0, prompt is not None))
        return ChunkResult(
            path=chunk.path,
            tokens=np.concatenate(tokens) if tokens else np.zeros(0, np.int32),
            loss_mask=np.concatenate(masks) if masks else np.zeros(0, np.uint8),
            lengths=np.array([len(t) for t in tokens], np.int64),
            samples=np.array(samples, cache_lib.SAMPLE_FIELDS),
            rows=rows,
            nbytes=chunk.nbytes,
            truncated=truncated,
            skipped=skipped,
            examples=examples,
        )

    def _fit(self, ids: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if self.overlength == "drop":
            raise BadSample("overlength", f"{len(ids)} tokens > seq_len {self.seq_len}")
        if not mask[: self.seq_len].any():
            raise BadSample(
                "no_loss_after_truncation", f"{len(ids)} tokens, none trained on in the first {self.seq_len}"
            )
        return ids[: self.seq_len], mask[: self.seq_len]


class _Counts:
    """Running totals of a build, for the manifest."""

    def __init__(self):
        self.samples = self.rows = self.tokens = self.loss_tokens = self.truncated = 0
        self.skipped: collections.Counter = collections.Counter()
        self.examples: dict[str, list[str]] = {}
        self.first: tuple[str, str] | None = None  # (reason, example) of the first bad row

    def add(self, result: ChunkResult) -> None:
        self.samples += len(result.lengths)
        self.rows += result.rows
        self.tokens += len(result.tokens)
        self.loss_tokens += int(result.loss_mask.sum())
        self.truncated += result.truncated
        self.skipped.update(result.skipped)
        for reason, example in result.examples:
            kept = self.examples.setdefault(reason, [])
            if len(kept) < EXAMPLES_PER_REASON:
                kept.append(example)
            if self.first is None:
                self.first = (reason, example)

    def as_manifest(self) -> dict:
        return {
            "num_samples": self.samples,
            "num_tokens": self.tokens,
            "num_loss_tokens": self.loss_tokens,
            "rows_read": self.rows,
            "truncated": self.truncated,
            "skipped": {reason: self.skipped.get(reason, 0) for reason in SKIP_REASONS},
            "skipped_examples": self.examples,
            "first_skipped": dict(zip(("reason", "example"), self.first)) if self.first else None,
        }


@functools.cache
def _encoder(tokenizer_dir: str, enable_thinking: bool) -> SampleEncoder:
    return SampleEncoder(tokenizer_dir, enable_thinking)


def _default_processes(total_bytes: int) -> int:
    """One per core, but fewer for small sources: a worker takes seconds to start (it imports
    transformers and loads the tokenizer), about what it tokenizes from 32 MB of JSONL."""
    return max(1, min(os.cpu_count() or 1, total_bytes // BYTES_PER_WORKER))


def _ordered_map(fn: Callable, items: Iterable, processes: int) -> Iterator:
    """`map(fn, items)` over worker processes, in order, with a bounded number of items in
    flight (Pool.imap would read the whole input ahead; a dead worker raises, never hangs)."""
    if processes == 1:
        yield from map(fn, items)
        return
    # spawn, not fork: the caller may be a training process with JAX threads running.
    executor = concurrent.futures.ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn"))
    try:
        pending: collections.deque = collections.deque()
        for item in items:
            pending.append(executor.submit(fn, item))
            if len(pending) >= 2 * processes:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    except concurrent.futures.process.BrokenProcessPool as e:
        raise RuntimeError(
            "a tokenizer process died (out of memory, or spawned processes cannot re-import the main "
            "module, e.g. code read from stdin); data.tokenize_processes=1 tokenizes in this process"
        ) from e
    finally:
        executor.shutdown(wait=False, cancel_futures=True)


def _check_skips_allowed(manifest: dict, on_bad_sample: str) -> None:
    """A cache built with skips must not be used silently when bad samples are errors."""
    skipped = {k: v for k, v in manifest["skipped"].items() if v}
    if on_bad_sample == "error" and skipped:
        # The first bad row of the sources: where a build in strict mode would have stopped.
        first = manifest.get("first_skipped") or {}
        reason = first.get("reason") or next(iter(skipped))
        raise DataError(_bad_sample_message(reason, first.get("example") or manifest["skipped_examples"][reason][0]))


def _bad_sample_message(reason: str, example: str) -> str:
    """One line: `file:line: what is wrong [reason]; how to skip such rows`."""
    return f"{_one_line(example)} [{reason}]; set data.on_bad_sample='skip' to skip and count such rows"


def _no_usable_sample_message(spec: str, counts: _Counts) -> str:
    if counts.rows == 0:
        return f"no usable sample in {spec}: the source files hold no rows"
    skipped = ", ".join(f"{n} {reason} ({SKIP_REASONS[reason]})" for reason, n in counts.skipped.most_common())
    return f"no usable sample in {spec}: {counts.rows} rows read, all skipped: {skipped}; the first: {_one_line(counts.first[1])}"


def _one_line(text: str, limit: int = 400) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
