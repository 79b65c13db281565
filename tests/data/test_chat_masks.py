"""Loss masks from a Qwen3-style chat template: assistant tokens only, serving-faithful."""

import numpy as np
import pytest

from dflash_jax.data.formats import BadSample, normalize_record
from dflash_jax.data.sample_encoder import SampleEncoder, control_tokens
from support.chat_data import chat, write_tiny_target


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return str(write_tiny_target(tmp_path_factory.mktemp("target")))


@pytest.fixture(scope="module")
def encoders(target_dir):
    return {thinking: SampleEncoder(target_dir, enable_thinking=thinking) for thinking in (False, True)}


def encode(encoder, record):
    return encoder.encode(normalize_record(record, "auto"))


def loss_spans(encoder, ids, mask):
    """Decoded runs of trained-on tokens."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
    return [encoder.tokenizer.decode(ids[a:b]) for a, b in zip(edges[::2], edges[1::2])]


def rendered(encoder, record, thinking):
    text = encoder.tokenizer.apply_chat_template(record["messages"], tokenize=False, enable_thinking=thinking)
    return encoder.tokenizer.decode(encoder.tokenizer.encode(text, add_special_tokens=False))


def test_single_turn_thinking_off_trains_on_the_answer_not_the_empty_think_block(encoders):
    record = chat("What is the capital of France?", "The capital of France is Paris.")
    ids, mask = encode(encoders[False], record)
    assert loss_spans(encoders[False], ids, mask) == ["The capital of France is Paris.<|im_end|>"]
    text = encoders[False].tokenizer.decode(ids)
    # The sample is the template's own rendering (its trailing newline is not generated).
    assert text + "\n" == rendered(encoders[False], record, False)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nThe capital of France is Paris.<|im_end|>")


def test_single_turn_thinking_on_trains_on_the_think_block_too(encoders):
    record = chat("What is the capital of France?", "The capital of France is Paris.")
    record["messages"][-1]["reasoning_content"] = "Let me think."
    ids, mask = encode(encoders[True], record)
    assert loss_spans(encoders[True], ids, mask) == [
        "<think>\nLet me think.\n</think>\n\nThe capital of France is Paris.<|im_end|>"
    ]


def test_system_prompt_is_context_not_loss(encoders):
    record = chat(
        "How many legs does a spider have?", "A spider has eight legs.", system="You are a helpful assistant."
    )
    ids, mask = encode(encoders[False], record)
    text = encoders[False].tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")
    assert loss_spans(encoders[False], ids, mask) == ["A spider has eight legs.<|im_end|>"]


@pytest.mark.parametrize("thinking", [False, True])
def test_multi_turn_masks_every_assistant_turn_in_its_history_form(encoders, thinking):
    record = chat(
        "What is the capital of France?",
        "<think>\nEasy.\n</think>\n\nParis." if thinking else "Paris.",
        "Tell me a joke about cats.",
        "Why did the cat sit on the computer?",
        system="You are a helpful assistant.",
    )
    ids, mask = encode(encoders[thinking], record)
    last = "Why did the cat sit on the computer?<|im_end|>"
    # Qwen3 drops an earlier turn's reasoning from the history; the last turn carries a think
    # block, which is trained on only when the model would generate it (thinking on).
    assert loss_spans(encoders[thinking], ids, mask) == [
        "Paris.<|im_end|>",
        "<think>\n\n</think>\n\n" + last if thinking else last,
    ]
    assert encoders[thinking].tokenizer.decode(ids) + "\n" == rendered(encoders[thinking], record, thinking)


def test_sharegpt_conversations_match_openai_messages(encoders):
    messages = chat("What is the capital?", "Paris.", "Tell me a joke.", "Why did the cat sit?", system="Be brief.")
    speakers = {"system": "system", "user": "human", "assistant": "gpt"}
    sharegpt = {"conversations": [{"from": speakers[m["role"]], "value": m["content"]} for m in messages["messages"]]}
    for got, want in zip(encode(encoders[False], sharegpt), encode(encoders[False], messages)):
        np.testing.assert_array_equal(got, want)


def test_plain_text_trains_on_every_token(encoders):
    ids, mask = encode(encoders[False], {"text": "A spider has eight legs."})
    assert encoders[False].tokenizer.decode(ids) == "A spider has eight legs."
    assert mask.all()


def test_reasoning_in_the_data_with_thinking_off_is_a_mismatch_not_a_guess(encoders):
    record = chat("What is the capital?", "Paris.")
    record["messages"][-1]["reasoning_content"] = "Let me think."
    with pytest.raises(BadSample, match="enable_thinking=False") as e:
        encode(encoders[False], record)
    assert e.value.reason == "template_mismatch"


def test_a_template_whose_prefixes_are_not_prefixes_is_rejected(tmp_path):
    # Numbers every message with the conversation's length, so no rendered prefix is a prefix.
    template = (
        "{%- for m in messages %}{{ '<|im_start|>' + m.role + ' ' + messages|length|string + '\\n' "
        "+ m.content + '<|im_end|>\\n' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
    )
    encoder = SampleEncoder(str(write_tiny_target(tmp_path, template)), enable_thinking=False)
    with pytest.raises(BadSample) as e:
        encode(encoder, chat("What is the capital?", "Paris.", "Tell me a joke.", "Why did the cat sit?"))
    assert e.value.reason == "template_mismatch"


def test_control_tokens_are_the_special_and_markup_added_tokens(tmp_path):
    import tokenizers
    import transformers

    directory = write_tiny_target(tmp_path)
    tokenizer = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    # Some tokenizers add whitespace runs or words as (non-special) added tokens: vocabulary.
    tokenizer.add_tokens(["    ", "\n\n", "hello", "<tool_call>", "[INST]"])
    tokenizer.save(str(directory / "tokenizer.json"))
    tokens = control_tokens(transformers.AutoTokenizer.from_pretrained(str(directory)))
    assert set(tokens) == {
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
        "<think>",
        "</think>",
        "<|MASK|>",
        "<tool_call>",
        "[INST]",
    }


def test_a_think_block_opening_an_answer_is_its_reasoning(encoders):
    as_text = chat(
        "What is the capital of France?", "<think>\nLet me think.\n</think>\n\nThe capital of France is Paris."
    )
    as_field = chat("What is the capital of France?", "The capital of France is Paris.")
    as_field["messages"][-1]["reasoning_content"] = "Let me think."
    for got, want in zip(encode(encoders[True], as_text), encode(encoders[True], as_field)):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("thinking", [False, True])
def test_an_opening_assistant_turn_is_trained_on(encoders, thinking):
    record = {
        "messages": [{"role": "assistant", "content": "Hello! How can I help?"}]
        + chat("Capital?", "Paris.")["messages"]
    }
    ids, mask = encode(encoders[thinking], record)
    last = "<think>\n\n</think>\n\nParis.<|im_end|>" if thinking else "Paris.<|im_end|>"
    assert loss_spans(encoders[thinking], ids, mask) == ["Hello! How can I help?<|im_end|>", last]
    assert encoders[thinking].tokenizer.decode(ids) + "\n" == rendered(encoders[thinking], record, thinking)


@pytest.mark.parametrize("thinking", [False, True])
def test_a_length_limit_changes_nothing_within_it(encoders, thinking):
    record = chat(
        *["What is the capital of France?", "<think>\nEasy.\n</think>\n\nParis." if thinking else "Paris."] * 12
    )
    sample = normalize_record(record, "auto")
    want_ids, want_mask = encoders[thinking].encode(sample)
    for limit in (8, 30, 64, 100, 200, len(want_ids)):
        ids, mask = encoders[thinking].encode(sample, max_len=limit)
        np.testing.assert_array_equal(ids[:limit], want_ids[:limit])
        np.testing.assert_array_equal(mask[:limit], want_mask[:limit])
        assert len(ids) >= min(limit + 1, len(want_ids))
