"""The adversarial corpus (tests/data/adversarial/): every case of manifest.json builds the tokenized
cache from its source and must end as the manifest says: so many samples used, so many rows
skipped by reason (and truncated), or a one-line `DataError` holding the expected text (which
names the file, and for a row its line)."""

import importlib.util
import json
import os
import pathlib
import re

import numpy as np
import pytest

from dflash_jax.data.build import ensure_cache
from dflash_jax.data.formats import SKIP_REASONS
from dflash_jax.data.sample_encoder import MASK_TOKEN
from dflash_jax.errors import DataError
from support.chat_data import TEMPLATES, data_config, write_tiny_target

CORPUS = pathlib.Path(__file__).parent / "adversarial"
CASES = json.loads((CORPUS / "manifest.json").read_text())["cases"]


def _load_builder():
    spec = importlib.util.spec_from_file_location("build_corpus", CORPUS / "build_corpus.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build_corpus = _load_builder()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return build_corpus.build(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    """Tiny target tokenizers, one per template a case names (made on first use)."""
    made = {}

    def target(name: str) -> str:
        if name not in made:
            made[name] = str(write_tiny_target(tmp_path_factory.mktemp(f"target-{name}"), TEMPLATES[name]))
        return made[name]

    return target


def loss_spans(tokenizer, tokens, mask):
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return [tokenizer.decode(tokens[a:b]) for a, b in zip(edges[::2], edges[1::2])]


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_case(case, corpus, targets, tmp_path):
    source = ",".join(str(corpus / part.strip()) for part in case["source"].split(","))
    data = data_config(source, tmp_path / "cache", **case.get("data", {}))
    target = targets(case.get("template", "qwen3"))
    expect = case["expect"]
    if "error" in expect:
        with pytest.raises(DataError) as raised:
            ensure_cache(data, target)
        message = str(raised.value)
        assert expect["error"].replace("{root}", str(corpus)) in message
        assert "\n" not in message and "{}" not in message and "Traceback" not in message
        assert os.listdir(tmp_path) == []  # neither a cache nor a partial build left behind
        return
    cache = ensure_cache(data, target)
    m = cache.manifest
    assert m["num_samples"] == expect["used"]
    assert {k: v for k, v in m["skipped"].items() if v} == expect.get("skipped", {})
    assert m["truncated"] == expect.get("truncated", 0)
    assert m["rows_read"] == expect["used"] + sum(expect.get("skipped", {}).values())
    # Every skipped row is shown with its file and line (or Parquet row), and a reason in words.
    location = re.compile(rf"^{re.escape(str(corpus))}/\S+(:\d+| \(row \d+\)): \S")
    for reason, examples in m["skipped_examples"].items():
        assert reason in SKIP_REASONS
        assert all(location.match(e) and "\n" not in e for e in examples), examples
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(target)
    mask_id = tokenizer.convert_tokens_to_ids(MASK_TOKEN)
    for i in range(cache.num_samples):
        tokens, mask = cache.sample(i)
        assert mask_id not in tokens
        assert mask.any() and len(tokens) <= data.seq_len
    if "loss" in expect:
        assert loss_spans(tokenizer, *cache.sample(0)) == expect["loss"]


def test_the_corpus_is_adversarial_enough():
    assert len(CASES) >= 40
    names = [c["name"] for c in CASES]
    assert len(set(names)) == len(names)
    used = {part.strip() for c in CASES for part in c["source"].split(",")}
    # Every generated file (or its directory) is the source of some case.
    for relative in build_corpus.FILES:
        parents = [str(p) for p in pathlib.PurePath(relative).parents]
        assert relative in used or any(p in used for p in parents), relative
    kinds = {c["source"].split("/")[0] for c in CASES}
    assert kinds == {"encodings", "json", "schema", "template", "lengths", "parquet", "dirs"}
