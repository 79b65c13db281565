"""The bundled demo assets: the stdlib corpus, the tiny Qwen3 target, and their build scripts."""

import importlib.util
import json
import pathlib

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
ASSETS = ROOT / "assets"
TARGET = ASSETS / "tiny-qwen3"
DATA = ASSETS / "data"


def _load(name):
    """assets/build/ is not a package: import its scripts by path."""
    spec = importlib.util.spec_from_file_location(name, ASSETS / "build" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build_corpus = _load("build_corpus")
train_tiny_target = _load("train_tiny_target")
completion_prompts = _load("completion_prompts")

# A few packages keep the stdlib walk short; a large held-out fraction makes both sides non-empty.
SMALL = dict(
    seed=0,
    max_functions=50,
    heldout_frac=0.3,
    num_prompts=4,
    only=("json", "email", "logging", "concurrent", "importlib"),
)


def _read_jsonl(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _check_split(train, heldout, prompts):
    assert train and heldout and prompts
    assert not {r["source"] for r in train} & {r["source"] for r in heldout}
    heldout_ids = {r["id"]: r for r in heldout}
    for p in prompts:
        assert [m["role"] for m in p["messages"]] == ["user"]
        assert heldout_ids[p["id"]]["messages"][0] == p["messages"][0]
    for r in train + heldout:
        assert [m["role"] for m in r["messages"]] == ["user", "assistant"]
        assert r["messages"][1]["content"].startswith("```python\n")
        assert "<|MASK|>" not in json.dumps(r)


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
    out = tmp_path_factory.mktemp("corpus")
    root = build_corpus.stdlib_dir()
    build_corpus.write_corpus(out, build_corpus.build_corpus(root, **SMALL), root)
    return out


def test_corpus_build_is_deterministic(small_corpus, tmp_path):
    root = build_corpus.stdlib_dir()
    build_corpus.write_corpus(tmp_path, build_corpus.build_corpus(root, **SMALL), root)
    names = sorted(p.name for p in small_corpus.iterdir())
    assert names == sorted(p.name for p in tmp_path.iterdir())
    assert {"stdlib_train.jsonl", "stdlib_heldout.jsonl", "heldout_prompts.jsonl"} <= set(names)
    for name in names:
        assert (small_corpus / name).read_bytes() == (tmp_path / name).read_bytes(), name


def test_corpus_split_is_by_source_file(small_corpus):
    train = _read_jsonl(small_corpus / "stdlib_train.jsonl")
    heldout = _read_jsonl(small_corpus / "stdlib_heldout.jsonl")
    assert len(train) + len(heldout) == SMALL["max_functions"]
    _check_split(train, heldout, _read_jsonl(small_corpus / "heldout_prompts.jsonl"))


def _build_tiny(data, out):
    return train_tiny_target.main(
        [
            "--data",
            str(data),
            "--out",
            str(out),
            "--steps",
            "3",
            "--batch-size",
            "4",
            "--vocab-size",
            "320",
            "--hidden-size",
            "32",
            "--intermediate-size",
            "64",
            "--num-layers",
            "2",
            "--num-heads",
            "2",
            "--num-kv-heads",
            "1",
            "--head-dim",
            "16",
            "--eval-docs",
            "4",
            "--eval-every",
            "0",
            "--log-every",
            "1",
        ]
    )


@pytest.mark.slow
def test_tiny_target_trains_deterministically_and_loads(small_corpus, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    metrics = _build_tiny(small_corpus, tmp_path / "a")
    _build_tiny(small_corpus, tmp_path / "b")
    for name in ("model.safetensors", "tokenizer.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    assert metrics["vocab_size"] == 320 and len(metrics["log"]) == 3

    tok = AutoTokenizer.from_pretrained(tmp_path / "a")
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "a")
    ids = tok(text, return_tensors="pt")["input_ids"]
    assert model(input_ids=ids).logits.shape == (1, ids.shape[1], 320)


def test_committed_corpus():
    train = _read_jsonl(DATA / "stdlib_train.jsonl")
    heldout = _read_jsonl(DATA / "stdlib_heldout.jsonl")
    prompts = _read_jsonl(DATA / "heldout_prompts.jsonl")
    _check_split(train, heldout, prompts)
    assert len(train) > 1000 and len(prompts) == 32
    assert "PYTHON SOFTWARE FOUNDATION LICENSE" in (DATA / "LICENSE-PSF.txt").read_text()


def test_completion_prompts_cut_each_function_after_its_docstring(tmp_path):
    """The committed corpus's first conversations, turned into code to complete: the prompt holds
    the answer's lines up to the end of its docstring, and nothing of the body."""
    lines = (DATA / "stdlib_train.jsonl").read_text(encoding="utf-8").splitlines()[:40]
    source = tmp_path / "train.jsonl"
    source.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / "completion.jsonl"
    completion_prompts.main(["--input", str(source), "--output", str(out), "--first", "3", "--last", "30"])
    records = _read_jsonl(out)
    assert [r["id"] for r in records] == [json.loads(line)["id"] + ":complete" for line in lines[2:30]]
    for record in records:
        user, assistant = (m["content"] for m in record["messages"])
        code = assistant.removeprefix("```python\n").removesuffix("\n```")
        header = user.removeprefix("Complete the following Python function:\n```python\n").removesuffix("\n```")
        assert code.startswith(header + "\n") and header.endswith(('"', "'"))  # cut after the docstring
        assert len(header.splitlines()) < len(code.splitlines())  # some body is left to write
    assert completion_prompts.header("x = 1") is None
    assert completion_prompts.header("def f():\n    return 1") is None  # no docstring to cut at
    assert completion_prompts.header('@d\ndef f():\n    """Doc."""\n    return 1') == '@d\ndef f():\n    """Doc."""'


def test_committed_smollm2_data_is_made_of_training_prompts():
    """configs/smollm2.py's regenerated files: prose prompts of stdlib_train.jsonl as they are, and
    the completion prompts `completion_prompts.py` makes of its rows; no held-out source file."""
    train = {r["id"]: r for r in _read_jsonl(DATA / "stdlib_train.jsonl")}
    heldout_sources = {r["source"] for r in _read_jsonl(DATA / "stdlib_heldout.jsonl")}
    prose = _read_jsonl(DATA / "smollm2_train_regen.jsonl")
    completion = _read_jsonl(DATA / "smollm2_completion_regen.jsonl")
    assert len(prose) > 600 and len(completion) > 800
    for record in prose:
        assert record["messages"][0] == train[record["id"]]["messages"][0]
    for record in completion:
        made = completion_prompts.completion_record(train[record["id"].removesuffix(":complete")])
        assert record["messages"][0] == made["messages"][0]
    for record in prose + completion:
        assert record["source"] not in heldout_sources
        assert [m["role"] for m in record["messages"]] == ["user", "assistant"] and "regenerated" in record


def test_committed_target_loads_in_transformers():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = json.loads((TARGET / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["model_type"] == "qwen3"
    tok = AutoTokenizer.from_pretrained(TARGET)
    mask_id = tok.convert_tokens_to_ids("<|MASK|>")
    assert tok.mask_token_id == mask_id and 0 <= mask_id < config["vocab_size"]
    for special in train_tiny_target.SPECIAL_TOKENS:  # each is one token, not split by BPE
        assert tok(special, add_special_tokens=False)["input_ids"] == [tok.convert_tokens_to_ids(special)]

    prompt = _read_jsonl(DATA / "heldout_prompts.jsonl")[0]["messages"]
    text = tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert text.startswith("<|im_start|>user\n") and text.endswith("<|im_start|>assistant\n")
    model = AutoModelForCausalLM.from_pretrained(TARGET)
    ids = tok(text, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], config["vocab_size"])
    assert torch.isfinite(logits).all()


def _jax_logits(path, ids):
    import jax
    import jax.numpy as jnp

    from dflash_jax.models.formats.hf import load_target

    model = load_target(path, param_dtype=jnp.float32, compute_dtype=jnp.float32)
    tokens = jnp.asarray(ids)
    with jax.default_matmul_precision("highest"):
        logits, _ = model(tokens, jnp.ones_like(tokens), jnp.arange(tokens.shape[1])[None])
    return np.asarray(logits)


@pytest.mark.slow
def test_built_and_committed_targets_match_transformers_in_jax(small_corpus, tmp_path):
    """Both the freshly built small target and the committed one load in dflash_jax with the
    same logits as transformers."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _build_tiny(small_corpus, tmp_path / "small")
    for path in (tmp_path / "small", TARGET):
        tok = AutoTokenizer.from_pretrained(path)
        text = tok.apply_chat_template(
            [{"role": "user", "content": "Implement `f(x)`."}], tokenize=False, add_generation_prompt=True
        )
        ids = tok(text, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            ref = AutoModelForCausalLM.from_pretrained(path).eval()(input_ids=ids).logits.numpy()
        ours = _jax_logits(path, ids.numpy())
        np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=1e-4, err_msg=str(path))
