"""llama.cpp serves our drafters: `llama-server` (found, or built at the pinned b11434: about half
an hour on 2 cores the first time) loads each kind's GGUF beside a tiny GGUF target this test
writes, its greedy text equals the target alone's, and on the prompts where its target agrees
with ours token for token it accepts exactly as many drafts as our decoder does."""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from absl import flags

from dflash_jax.bundled import ASSETS
from dflash_jax.decoding.engines.llama_cpp import build_server, find_server
from dflash_jax.decoding.engines.llama_server import Drafting, LlamaServer
from dflash_jax.decoding.engines.server import engine_figures, forward_cost, run_prompts
from dflash_jax.decoding.generate import TargetDecoder
from dflash_jax.decoding.prompt_sets import ChatTokenizer, load_prompt_set
from dflash_jax.decoding.speculative import SpeculativeDecoder
from dflash_jax.errors import UserError
from dflash_jax.models.formats.gguf_target import write_target_gguf
from dflash_jax.models.formats.hf import export_drafter, load_drafter, load_target
from dflash_jax.models.formats.hub import resolve_model
from support.decoding_models import make_drafter, perturbed
from support.gguf_checkpoint import CORPUS, write_tiny_gguf
from support.hf_reference import with_tiny_qwen3_tokenizer, write_hf_checkpoint
from support.stderr import remove_kept_log

pytestmark = pytest.mark.slow

HEADS = {"dflash": {}, "dflash2": {"selector_top_k": 7, "selector_rank": 32}, "dspark": {"markov_rank": 32}}
MAX_NEW_TOKENS = 16
DRAFT_VOCAB = 48  # of the tiny vocabulary's
# float32 caches (llama.cpp keeps float16 ones by default) and weights: the engine's greedy tokens
# then agree with ours on most prompts, where a near-tie could otherwise flip one.
EXACT = ("-ctk", "f32", "-ctv", "f32", "-ctkd", "f32", "-ctvd", "f32")
# One thread: llama.cpp's threads spin at every barrier, which a loaded 2-core machine punishes.


@pytest.fixture(scope="module")
def server_binary():
    return find_server() or build_server()


@pytest.fixture(scope="module")
def target_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("target") / "target.gguf"
    return write_tiny_gguf(path, layers=4, weight_type="F32", embedding_type="F32")


@pytest.fixture(scope="module")
def target(target_gguf):
    return load_target(resolve_model(str(target_gguf)))


@pytest.fixture(scope="module")
def prompts(target_gguf):
    chat = ChatTokenizer(str(resolve_model(str(target_gguf))))
    return [chat.prompt_ids([{"role": "user", "content": text}]) for text in CORPUS]


@pytest.fixture(scope="module")
def alone(server_binary, target_gguf, prompts):
    with LlamaServer(server_binary, target_gguf, threads=1, extra_args=EXACT) as server:
        return run_prompts(server, prompts, MAX_NEW_TOKENS)


@pytest.mark.parametrize("draft_vocab", [0, DRAFT_VOCAB], ids=["whole vocabulary", "draft vocabulary"])
@pytest.mark.parametrize("kind", sorted(HEADS))
def test_llama_cpp_serves_the_export_as_our_decoder_decodes_it(
    kind, draft_vocab, server_binary, target, target_gguf, prompts, alone, tmp_path
):
    drafter = perturbed(make_drafter(target, kind=kind, block_size=4, mask_id=3, **HEADS[kind]))
    export = export_drafter(drafter, tmp_path / "export")
    # A draft vocabulary holding half of the tokens the target emits: drafting outside it must not happen.
    draft_tokens = _draft_tokens(alone, target.cfg.vocab_size) if draft_vocab else None
    drafting = Drafting.convert(export, target_gguf, tmp_path / "drafter.gguf", draft_tokens)
    with LlamaServer(server_binary, target_gguf, drafting, threads=1, extra_args=EXACT) as server:
        served = run_prompts(server, prompts, MAX_NEW_TOKENS)

    figures = engine_figures(alone, served)
    assert figures["identical_outputs"] == 1.0  # lossless in the engine
    assert figures["drafted"] > 0  # the drafter ran

    ours = SpeculativeDecoder(
        target,
        load_drafter(export),  # the exported (bfloat16) weights the GGUF holds, as our decoder reads them
        max_prompt_len=max(map(len, prompts)),
        max_new_tokens=MAX_NEW_TOKENS,
        stop_tokens=(2,),
        draft_tokens=draft_tokens,
    ).generate([np.asarray(p) for p in prompts])
    same_target = [i for i, (o, a) in enumerate(zip(ours, alone)) if list(o.tokens) == a.tokens]
    assert len(same_target) >= len(prompts) // 2, "the engine's target and ours disagree on most prompts"
    accepted_ours = [int((ours[i].step_lengths - 1).sum()) for i in same_target]
    assert accepted_ours == [served[i].accepted for i in same_target]
    assert [len(ours[i].step_lengths) for i in same_target] == [served[i].steps for i in same_target]
    if kind == "dspark":  # random Markov heads still accept some drafts: the counts compared are not all 0
        assert sum(accepted_ours) > 0


def _draft_tokens(completions, vocab_size: int) -> np.ndarray:
    """DRAFT_VOCAB token ids: every other token the target emitted, then the lowest never emitted."""
    emitted = list(dict.fromkeys(t for c in completions for t in c.tokens))
    rest = [t for t in range(vocab_size) if t not in set(emitted)]
    return np.asarray((emitted[::2] + rest)[:DRAFT_VOCAB], np.int32)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_a_hugging_face_target_written_as_gguf_decodes_as_ours(arch, server_binary, tmp_path):
    """models/formats/gguf_target.py: the default run's tiny-qwen3, which llama.cpp's converter refuses
    (its tokenizer is not a published one), and a tiny Llama transformers writes (its q/k rows
    interleaved for llama.cpp's RoPE), served with our tokenizer's ids and greedy tokens."""
    if arch == "qwen3":
        model_dir = os.path.join(ASSETS, "tiny-qwen3")
    else:
        plain_rope = {"rope_type": "default", "rope_theta": 10000.0}
        checkpoint = write_hf_checkpoint(tmp_path / "llama", arch="llama", vocab_size=4096, rope_parameters=plain_rope)
        model_dir = with_tiny_qwen3_tokenizer(checkpoint)
    chat = ChatTokenizer(model_dir)
    prompts = [chat.prompt_ids(row[0]) for row in load_prompt_set("heldout_prompts", chat, limit=4).rows]
    target_gguf = write_target_gguf(model_dir, tmp_path / f"{arch}.gguf")
    with LlamaServer(server_binary, target_gguf, threads=1, extra_args=EXACT) as server:
        served = run_prompts(server, prompts, 2 * MAX_NEW_TOKENS)
    ours = TargetDecoder(
        load_target(model_dir, param_dtype=jnp.float32, compute_dtype=jnp.float32),  # as the GGUF holds it
        max_prompt_len=max(map(len, prompts)),
        max_new_tokens=2 * MAX_NEW_TOKENS,
        stop_tokens=chat.stop_tokens,
    ).generate([np.asarray(p) for p in prompts])
    assert [list(o.tokens) for o in ours] == [c.tokens for c in served]


def test_evaluate_serves_the_prompts_in_the_engine_beside_ours(target, target_gguf, tmp_path, capsys):
    """`dflash-jax evaluate --engine=llama.cpp`, end to end: the GGUF target as it is and widened to
    float32, a draft vocabulary, our τ and the engine's side by side in eval.json and the table."""
    from dflash_jax import evaluate
    from dflash_jax.decoding.draft_vocab import FREQUENCIES_FILE, write_frequencies
    from support.chat_data import chat, write_jsonl

    export = export_drafter(perturbed(make_drafter(target, kind="dflash", block_size=4, mask_id=3)), tmp_path / "e")
    counts = np.arange(target.cfg.vocab_size, dtype=np.int64)[::-1] % 7  # every token seen but a few
    write_frequencies(str(export / FREQUENCIES_FILE), counts, source="test")
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [chat(text) for text in CORPUS[:3]])
    args = [f"--drafter={export}", f"--target={target_gguf}", f"--prompts={prompts}", "--max_new_tokens=12"]
    args += ["--engine=llama.cpp", "--engine_threads=1", "--engine_weights=file,float32", "--draft_vocab=300"]
    args += ["--dtype=float32", f"--output={tmp_path / 'out'}"]
    flag_values = flags.FlagValues()
    evaluate.define_flags(flag_values)
    flag_values(["evaluate", *args])
    evaluate.main([], flag_values)

    result = json.loads((tmp_path / "out" / "eval.json").read_text())
    (ours,) = result["sets"].values()
    assert result["engine"]["name"] == "llama.cpp"
    assert set(result["engine"]["served"]) == {"file", "float32"}
    for weights, sets in result["engine"]["served"].items():
        (engine,) = sets.values()
        assert engine["identical_outputs"] == 1.0, weights
        assert engine["drafted"] > 0 and engine["step_costs"]["verify_tokens"] == 4, weights
        assert engine["tau"] == pytest.approx(ours["tau"], rel=0.1), weights
    table = capsys.readouterr().out
    assert "llama.cpp, greedy" in table and " float32 " in table and "break-even tau" in table
    with pytest.raises(UserError, match="--engine_weights=int8: choose among file, float32"):
        flag_values(["evaluate", *args, "--engine_weights=int8"])
        evaluate.main([], flag_values)


def test_the_verify_forward_is_timed_on_as_many_tokens_as_asked(server_binary, target_gguf, prompts, alone):
    """forward_cost times the engine's batched forward of exactly the verify's tokens after a cached
    prompt; engine_figures splits a drafted step's time into that forward and the rest."""
    with LlamaServer(server_binary, target_gguf, threads=1, extra_args=EXACT) as server:
        forward = forward_cost(server, prompts[:3], [c.tokens for c in alone[:3]], num_tokens=5)
    assert forward["prompts"] == 3 and forward["tokens"] == 5 and forward["ms"] > 0
    figures = engine_figures(alone, alone, forward)  # the target alone as its own "drafted" run: 1 token a step
    costs = figures["step_costs"]
    assert costs["step_ms"] == pytest.approx(sum(c.decode_ms for c in alone) / sum(len(c.tokens) - 1 for c in alone))
    assert costs["verify_ms"] + costs["drafter_ms"] == pytest.approx(costs["step_ms"])


def test_a_drafter_the_engine_cannot_load_is_one_line(server_binary, target_gguf, tmp_path):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF not really")
    with pytest.raises(UserError, match="llama-server exited") as raised:
        LlamaServer(server_binary, target_gguf, Drafting(broken, "draft-dflash", 3), start_timeout=120)
    remove_kept_log(str(raised.value), holding="broken.gguf")  # its whole log, kept


def test_a_missing_engine_is_one_line(monkeypatch, tmp_path):
    from dflash_jax.decoding.engines import llama_cpp

    monkeypatch.setenv(llama_cpp.ENV_SERVER, str(tmp_path / "no-such-llama-server"))
    with pytest.raises(UserError, match="not an executable llama-server"):
        llama_cpp.require_server()
