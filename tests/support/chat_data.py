"""Test support: a tiny target tokenizer with a Qwen3-style chat template (built offline with
`tokenizers`), and small helpers to write data and configs for it."""

import json
import pathlib

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
# The drafter's mask token, added after training so that every other id stays as it was (id 400).
MASK_TOKEN = "<|MASK|>"

# Same structure as Qwen3's template: a leading system turn, assistant turns after the last user
# query rendered with a <think> block, earlier ones with their reasoning stripped, and an empty
# think block in the generation prompt when thinking is disabled.
QWEN3_STYLE_TEMPLATE = """\
{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(searching=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- if ns.searching and message.role == 'user' %}
        {%- set ns.searching = false %}
        {%- set ns.last_query_index = messages|length - 1 - loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

# The bundled tiny target's template: every message as <|im_start|>role\ncontent<|im_end|>.
SIMPLE_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# The simple template, refusing conversations whose roles do not alternate user/assistant after
# an optional system turn (as Llama 2 and Mistral templates do), so also assistant-first ones.
ALTERNATING_TEMPLATE = (
    "{%- set first = 1 if messages[0].role == 'system' else 0 %}"
    "{%- for m in messages[first:] %}{%- if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif %}{%- endfor %}" + SIMPLE_TEMPLATE
)
# The Qwen3-style template, refusing tool messages the way real templates raise on bad input.
TOOL_REFUSING_TEMPLATE = (
    "{%- for m in messages %}{%- if m.role == 'tool' %}"
    "{{ raise_exception('tool messages need tool calls') }}{%- endif %}{%- endfor %}" + QWEN3_STYLE_TEMPLATE
)
# A (broken) template that itself renders the drafter's mask token into every conversation.
MASK_RENDERING_TEMPLATE = "{{- '<|MASK|>' }}" + SIMPLE_TEMPLATE
TEMPLATES = {
    "qwen3": QWEN3_STYLE_TEMPLATE,
    "simple": SIMPLE_TEMPLATE,
    "alternating": ALTERNATING_TEMPLATE,
    "tool_refusing": TOOL_REFUSING_TEMPLATE,
    "mask_rendering": MASK_RENDERING_TEMPLATE,
}

_CORPUS = [
    "You are a helpful assistant.",
    "What is the capital of France? The capital of France is Paris.",
    "Tell me a joke about cats. Why did the cat sit on the computer? To keep an eye on the mouse.",
    "How many legs does a spider have? A spider has eight legs.",
    "Let me think step by step about the question before answering it.",
    "system user assistant",
]


def write_tiny_target(directory: pathlib.Path, chat_template: str = QWEN3_STYLE_TEMPLATE) -> pathlib.Path:
    """Writes tokenizer.json and tokenizer_config.json (with `chat_template`) into `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(_CORPUS, trainer=trainer)
    tokenizer.add_special_tokens([MASK_TOKEN])
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 4096,
        "chat_template": chat_template,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return directory


def data_config(train, cache_dir, **overrides):
    """`config.data` for tests: in-process tokenization and loading, small rows."""
    from dflash_jax.data.settings import DataConfig

    settings = {"tokenize_processes": 1, "read_threads": 0, "seq_len": 64, "global_batch_rows": 4, **overrides}
    return DataConfig(train=str(train), cache_dir=str(cache_dir), **settings)


def write_jsonl(path: pathlib.Path, records) -> pathlib.Path:
    """Writes records (dicts as JSON, bytes/str verbatim) one per line."""
    with open(path, "wb") as f:
        for r in records:
            line = r if isinstance(r, bytes) else (r if isinstance(r, str) else json.dumps(r)).encode()
            f.write(line + b"\n")
    return path


def chat(*turns, system=None):
    """OpenAI-style record from alternating user/assistant texts."""
    messages = [{"role": "system", "content": system}] if system else []
    roles = ("user", "assistant")
    messages += [{"role": roles[i % 2], "content": t} for i, t in enumerate(turns)]
    return {"messages": messages}
