"""`data.heldout_rows`: prompts held out of training by a hash of their text, and read back as an
evaluation set; the split does not depend on row order, files or formats."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_jax.data.build import ensure_cache
from dflash_jax.data.heldout import heldout_prompts, heldout_samples, prompt_key
from dflash_jax.data.pipeline import DataPipeline
from dflash_jax.data.settings import DataConfig
from dflash_jax.decoding.prompt_sets import ChatTokenizer, HeldoutPrompts, load_prompt_set
from dflash_jax.errors import DataError
from support.chat_data import chat, data_config, write_jsonl, write_tiny_target

RECORDS = (
    [chat(f"Question {i}?", f"Answer {i}.") for i in range(24)]
    + [chat("Question 11?", "Another answer.")]  # a prompt answered twice; its key is the smallest
    + [chat("Tell me a joke.", "Why?", "More.", "Because.", system="Be brief.")]
    + [{"text": "Plain text has no prompt."}]
    + [{"messages": [{"role": "assistant", "content": "An assistant-first row has none either."}]}]
)
DISTINCT_PROMPTS = 25


def prompt_of(record):
    """The messages before the first assistant turn, as the test data spells them."""
    messages = record.get("messages", [])
    end = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
    prompt = messages[:end]
    return prompt if any(m["role"] == "user" for m in prompt) else None


def sharegpt(record):
    roles = {"system": "system", "user": "human", "assistant": "gpt"}
    return {"conversations": [{"from": roles[m["role"]], "value": m["content"]} for m in record["messages"]]}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return str(write_tiny_target(tmp_path_factory.mktemp("target")))


@pytest.fixture(scope="module")
def data(tmp_path_factory, target):
    tmp = tmp_path_factory.mktemp("data")
    return data_config(write_jsonl(tmp / "train.jsonl", RECORDS), tmp / "cache", seq_len=128)


@pytest.fixture(scope="module")
def cache(data, target):
    return ensure_cache(data, target)


def test_the_smallest_prompt_keys_are_held_out_with_every_conversation_opening_with_them(cache):
    prompts = heldout_prompts(cache, 20)
    assert len(prompts) == 20 and all(prompt is not None for prompt in prompts)
    keys = [prompt_key(p) for p in prompts]
    assert keys == sorted(keys)
    every_key = {prompt_key(p) for p in map(prompt_of, RECORDS) if p}
    assert len(every_key) == DISTINCT_PROMPTS and set(keys) == set(sorted(every_key)[:20])
    # The samples left out are exactly the usable rows opening with a held-out prompt.
    held = heldout_samples(cache, 20)
    rows = cache.samples["row"]
    assert sorted(rows[held]) == [i for i, r in enumerate(RECORDS) if prompt_of(r) in prompts]
    assert len(held) == 21  # "Question 11?" is held out, with both of its answers
    assert heldout_prompts(cache, 5) == prompts[:5]


def test_epochs_never_hold_a_heldout_conversation_and_hold_every_other_once(cache):
    pipeline = DataPipeline(cache, DataConfig(seq_len=128, global_batch_rows=4, read_threads=0, heldout_rows=10))
    held = set(heldout_samples(cache, 10).tolist())
    for epoch in range(2):
        used = pipeline.plan(epoch).doc_ids.tolist()
        assert sorted(used) == [s for s in range(cache.num_samples) if s not in held]
    batch = next(pipeline.iterator(process_index=0, process_count=1))
    assert batch["tokens"].shape == (4, 128)


def test_the_split_ignores_row_order_files_and_formats(tmp_path, cache, target):
    shuffled = list(RECORDS)
    random.Random(0).shuffle(shuffled)
    chats = [r for r in shuffled if "messages" in r and prompt_of(r)]
    others = [r for r in shuffled if r not in chats]
    jsonl = write_jsonl(tmp_path / "a.jsonl", others + chats[: len(chats) // 2])
    table = pa.Table.from_pylist([sharegpt(r) for r in chats[len(chats) // 2 :]])
    pq.write_table(table, tmp_path / "b.parquet", row_group_size=3)  # prompts read back from 5 row groups
    moved = ensure_cache(data_config(f"{jsonl},{tmp_path / 'b.parquet'}", tmp_path / "cache", seq_len=128), target)
    assert heldout_prompts(moved, 12) == heldout_prompts(cache, 12)
    assert len(heldout_samples(moved, 12)) == len(heldout_samples(cache, 12))


def test_resume_refuses_another_split_and_runs_without_one_keep_their_fingerprint(cache):
    def iterator(heldout_rows):
        settings = DataConfig(seq_len=128, global_batch_rows=4, read_threads=0, heldout_rows=heldout_rows)
        pipeline = DataPipeline(cache, settings)
        return pipeline.iterator(process_index=0, process_count=1)

    unsplit, split = iterator(0), iterator(8)
    assert not {"heldout_rows", "heldout_sha256"} & set(unsplit.get_state())
    with pytest.raises(ValueError, match="heldout_rows: saved None, now 8"):
        split.set_state(unsplit.get_state())
    split.set_state(iterator(8).get_state())


def test_more_prompts_than_the_data_holds_is_a_one_line_error(cache):
    with pytest.raises(DataError) as raised:
        heldout_samples(cache, DISTINCT_PROMPTS + 1)
    assert str(raised.value) == (
        f"data.heldout_rows={DISTINCT_PROMPTS + 1}, but the data holds only {DISTINCT_PROMPTS} distinct prompts to "
        "hold out (conversations with a user turn before their first assistant turn)"
    )


def test_the_heldout_prompts_are_an_evaluation_set_named_after_the_data(data, target, cache):
    held = dataclasses.replace(data, heldout_rows=6)
    prompt_set = load_prompt_set(HeldoutPrompts(held, target), ChatTokenizer(target), limit=4)
    assert prompt_set.name == f"heldout:6 of {data.train}"
    assert prompt_set.rows == [[p] for p in heldout_prompts(cache, 4)]
    assert np.all([row[0][-1]["role"] == "user" for row in prompt_set.rows])
