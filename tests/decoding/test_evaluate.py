"""`python -m dflash_jax.evaluate`: a workdir checkpoint and its export evaluate identically, with
the target read from the run's checkpoint; hub ids and the standard benchmarks (multi-turn ones
turn by turn) on the bundled tiny target; user errors as one-line `UserError`s."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl import flags
from flax import nnx

from dflash_jax import evaluate
from dflash_jax.decoding import report
from dflash_jax.decoding.draft_vocab import FREQUENCIES_FILE, write_frequencies
from dflash_jax.decoding.generate import Generation, TargetDecoder
from dflash_jax.decoding.measurement import evaluate_set, speed, timed_generate
from dflash_jax.decoding.prompt_sets import BadRow, ChatTokenizer, PromptSet, load_prompts
from dflash_jax.decoding.sampling import GREEDY
from dflash_jax.errors import UserError
from dflash_jax.models.drafter_config import DrafterConfig
from dflash_jax.models.families import target_config
from dflash_jax.models.formats.hf import export_drafter, load_drafter, load_target, read_config
from dflash_jax.training.checkpoint import RunCheckpoints
from dflash_jax.training.drafters import export_checkpoint, load_any_drafter
from dflash_jax.training.mesh import make_mesh
from dflash_jax.training.optim.optimizer import OptimizerConfig, make_optimizer
from dflash_jax.training.step import init_train_state
from dflash_jax.training.workdir import Workdir
from support.benchmark_files import HUMANEVAL, MT_BENCH, PUBLISHED, published_bytes, write_published
from support.chat_data import chat, write_jsonl
from support.decoding_models import CHAT_VOCAB, make_drafter
from support.hub_cache import add_to_hub_cache, directory_files, use_hub_cache

TINY_TARGET = Path(__file__).resolve().parents[2] / "assets" / "tiny-qwen3"


class _IteratorState:
    """The data iterator's checkpointed state; evaluation never reads it."""

    def get_state(self):
        return {"epoch": 0, "step": 0}


@pytest.fixture(scope="module")
def workdir(chat_target, tmp_path_factory):
    """A training workdir with one checkpoint (saved by the training code) and its export."""
    workdir = tmp_path_factory.mktemp("workdir")
    cfg = DrafterConfig.for_target(
        target_config(read_config(chat_target)), num_layers=1, mask_token_id=CHAT_VOCAB - 1, block_size=4
    )
    state = init_train_state(
        cfg, make_optimizer(OptimizerConfig(), 10), seed=0, compute_dtype=jnp.float32, mesh=make_mesh(-1, 1)
    )
    # Larger weights than the 0.02 init, so that bf16 rounding is visible if it were skipped.
    state = state.replace(params=jax.tree.map(lambda p: p * 7.3, state.params))
    checkpoints = RunCheckpoints(Workdir.at(str(workdir)).checkpoints, every_steps=1, keep=None, async_save=False)
    # The run's config is saved with each checkpoint, as the training loop does: it names the target.
    meta = {"drafter_config": cfg.to_hf(), "config": {"target": {"path": chat_target}}}
    checkpoints.save(5, state, meta, _IteratorState(), force=True)
    checkpoints.wait()
    checkpoints.close()
    export_checkpoint(Workdir.at(str(workdir)))
    return workdir


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    return str(
        write_jsonl(
            tmp_path_factory.mktemp("prompts") / "prompts.jsonl",
            [
                chat("What is the capital of France?", "Paris."),
                chat("Tell me a joke about cats."),
                chat("How many legs does a spider have?", system="You are a helpful assistant."),
                chat("unused: beyond num_prompts"),
            ],
        )
    )


def test_workdir_and_export_load_identical_weights(workdir):
    from_workdir = nnx.state(load_any_drafter(str(workdir)))
    from_export = nnx.state(load_any_drafter(str(workdir / "export")))
    for a, b in zip(jax.tree.leaves(from_workdir), jax.tree.leaves(from_export)):
        assert a.dtype == b.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def run_cli(module, args: list[str]) -> None:
    """The CLI's main on its own FlagValues, as `python -m` would run it (without a process)."""
    flag_values = flags.FlagValues()
    module.define_flags(flag_values)
    flag_values(["prog", *args])
    module.main([], flag_values)


def test_a_kind_llama_cpp_does_not_serve_is_refused_before_a_gguf_is_written(
    chat_target, prompts_file, tmp_path, monkeypatch
):
    target = load_target(chat_target)
    export = export_drafter(make_drafter(target, kind="domino", block_size=4, mask_id=3), tmp_path / "export")
    monkeypatch.setenv("DFLASH_JAX_LLAMA_SERVER", str(tmp_path / "no-such-llama-server"))  # never looked for
    out = tmp_path / "out"
    args = [f"--drafter={export}", f"--target={chat_target}", f"--prompts={prompts_file}", f"--output={out}"]
    with pytest.raises(UserError, match=r"^--engine=llama.cpp cannot serve .*export: .*not drafter kind 'domino'$"):
        run_cli(evaluate, [*args, "--engine=llama.cpp"])
    assert not out.exists()  # no target GGUF converted for a drafter the engine cannot load


@pytest.mark.slow
def test_workdir_and_its_export_report_the_same_tau_and_name_their_target(
    chat_target, workdir, prompts_file, tmp_path, capsys
):
    settings = [f"--prompts={prompts_file}", "--limit=3", "--max_new_tokens=12"]
    # No --target: the checkpoint of the workdir (and of the run an export belongs to) names it.
    run_cli(evaluate, [f"--drafter={workdir}", "--step=5", f"--output={tmp_path / 'workdir'}", *settings])
    run_cli(evaluate, [f"--drafter={workdir / 'export'}", f"--output={tmp_path / 'export'}", *settings])
    assert "speedup" in capsys.readouterr().out
    ours, exported = (json.loads((tmp_path / d / "eval.json").read_text()) for d in ("workdir", "export"))
    assert ours["run"]["target"] == exported["run"]["target"] == chat_target
    assert ours["run"]["drafter_step"] == 5
    ours, exported = ours["sets"]["prompts"], exported["sets"]["prompts"]
    assert (tmp_path / "export" / "eval.png").stat().st_size > 0
    for key in ("tau", "histogram", "slot_acceptance", "num_steps", "num_tokens"):
        assert exported[key] == ours[key], key
    assert ours["num_prompts"] == 3
    assert ours["identical_outputs"] == 1.0
    for mode in ("dflash", "target"):
        assert ours[mode]["tokens"] == ours["num_tokens"] and ours[mode]["tokens_per_s"] > 0
    assert ours["speedup"] == pytest.approx(ours["dflash"]["tokens_per_s"] / ours["target"]["tokens_per_s"])
    for mode in ("dflash", "target"):  # the prefill took some of the time, not all of it
        assert 0 < ours[mode]["first_token_ms"] < 1000 * ours[mode]["seconds"]
    decode = [ours[mode]["decode_tokens_per_s"] for mode in ("dflash", "target")]
    assert ours["decode_speedup"] == pytest.approx(decode[0] / decode[1])


@pytest.mark.parametrize(
    "args, message",
    [
        (["--target=/missing", "--drafter={workdir}"], "--target=/missing: no such directory"),
        (["--drafter={standalone}"], "--target is required: --drafter={standalone} is not a training workdir"),
        (["--drafter={workdir}", "--step=7"], "--drafter={workdir}: no checkpoint of step 7 in "),
        (["--drafter={workdir}", "--temperature=0.5", "--top_p=2"], "top_p must be in (0, 1]"),
    ],
)
def test_user_errors_are_caught_before_any_model_loads(workdir, tmp_path, args, message):
    standalone = shutil.copytree(workdir / "export", tmp_path / "standalone")  # an export of no workdir
    paths = dict(workdir=workdir, standalone=standalone)
    with pytest.raises(UserError) as raised:
        run_cli(evaluate, [a.format(**paths) for a in args])
    assert message.format(**paths) in str(raised.value) and "\n" not in str(raised.value)


def test_bad_inputs_are_clear_errors(chat_target, tmp_path):
    tokenizer = ChatTokenizer(chat_target)
    bad = write_jsonl(tmp_path / "bad.jsonl", [chat("fine"), {"messages": [{"role": "robot", "content": "x"}]}])
    with pytest.raises(BadRow, match=r"bad.jsonl:2: messages\[0\].role is 'robot' \(known: "):
        load_prompts(str(bad), tokenizer)
    broken = write_jsonl(tmp_path / "broken.jsonl", ["{not json"])
    with pytest.raises(BadRow, match=r"broken.jsonl:1: not valid JSON"):
        load_prompts(str(broken), tokenizer)
    with pytest.raises(FileNotFoundError, match="bundled: heldout_prompts"):
        load_prompts("no_such_set", tokenizer)
    with pytest.raises(UserError, match="neither a drafter export directory"):
        load_any_drafter(str(tmp_path))


@pytest.fixture(scope="module")
def tiny_hub(tmp_path_factory):
    """A hub cache holding the bundled tiny target, a one-layer drafter for it and two benchmarks.
    (Their prompts are 33-64 tokens long, so every set and turn below runs the same compiled steps.)"""
    cache = tmp_path_factory.mktemp("hub")
    add_to_hub_cache(cache, "tiny/qwen3", directory_files(TINY_TARGET))
    target = load_target(TINY_TARGET, param_dtype=jnp.float32, compute_dtype=jnp.float32)
    export = export_drafter(
        make_drafter(target, seed=3), tmp_path_factory.mktemp("drafter") / "export", dtype=jnp.float32
    )
    add_to_hub_cache(cache, "tiny/drafter", directory_files(export))
    for name in ("gsm8k", "mt-bench"):
        add_to_hub_cache(cache, PUBLISHED[name][0], published_bytes(name), repo_type="dataset")
    return cache


@pytest.mark.slow
def test_benchmarks_from_the_hub_cache_report_tau_per_benchmark(tiny_hub, tmp_path, monkeypatch, capsys):
    use_hub_cache(monkeypatch, tiny_hub)
    humaneval = write_published(HUMANEVAL, tmp_path / "humaneval.parquet")
    out_dir = tmp_path / "eval"
    run_cli(
        evaluate,
        [
            "--target=tiny/qwen3",
            "--drafter=tiny/drafter",
            f"--prompts=gsm8k,mt-bench,humaneval={humaneval}",
            "--limit=2",
            "--max_new_tokens=4",
            "--dtype=float32",
            f"--output={out_dir}",
        ],
    )
    sets = json.loads((out_dir / "eval.json").read_text())["sets"]
    assert list(sets) == ["gsm8k", "mt-bench", "humaneval"]
    assert [(r["num_prompts"], r["num_turns"]) for r in sets.values()] == [(2, 2), (2, 4), (2, 2)]
    for result in sets.values():
        assert result["identical_outputs"] == 1.0 and 1 <= result["tau"] <= 4
    table = capsys.readouterr().out
    for name, result in sets.items():
        assert any(line.split()[:3] == [name, "2", f"{result['tau']:.2f}"] for line in table.splitlines()), table
    assert (out_dir / "eval.png").stat().st_size > 0


def test_each_later_turn_follows_the_targets_own_answer(tiny_hub, monkeypatch):
    use_hub_cache(monkeypatch, tiny_hub)
    chat = ChatTokenizer(str(TINY_TARGET))
    target = load_target(TINY_TARGET, param_dtype=jnp.float32, compute_dtype=jnp.float32)
    drafter = load_drafter(next((tiny_hub / "models--tiny--drafter" / "snapshots").iterdir()))
    first, second = ([{"role": "user", "content": turn}] for turn in MT_BENCH["prompt"][0].as_py())
    rendered = []
    monkeypatch.setattr(
        chat, "prompt_ids", lambda messages: rendered.append(messages) or ChatTokenizer.prompt_ids(chat, messages)
    )
    result = evaluate_set(
        target,
        drafter,
        chat,
        PromptSet("mt", [[first, second]]),
        max_new_tokens=4,
        batch_size=1,
        sampling=GREEDY,
        seed=0,
    )
    alone = TargetDecoder(target, max_prompt_len=64, max_new_tokens=4, stop_tokens=chat.stop_tokens)
    [answer] = alone.generate([ChatTokenizer.prompt_ids(chat, first)])
    assert rendered == [first, first + [{"role": "assistant", "content": chat.response_text(answer.tokens)}] + second]
    assert (result["num_prompts"], result["num_turns"], result["identical_outputs"]) == (1, 2, 1.0)


def test_hub_ids_that_are_not_cached_are_one_line_errors(tiny_hub, monkeypatch):
    use_hub_cache(monkeypatch, tiny_hub)
    with pytest.raises(UserError) as raised:
        run_cli(evaluate, ["--target=tiny/other", "--drafter=tiny/drafter"])
    assert str(raised.value).startswith("--target=tiny/other: no such directory, and not in the Hugging Face cache")
    assert str(raised.value).endswith("hf download tiny/other")


@pytest.mark.parametrize(
    "kind, threshold",
    [("dflash2", 0.0), *(pytest.param(k, t, marks=pytest.mark.slow) for k, t in (("dspark", 0.3), ("xpress", 0.0)))],
)
def test_evaluate_reports_per_slot_acceptance_for_every_kind(chat_target, prompts_file, tmp_path, kind, threshold):
    """A DFlash2, DSpark or XPress export evaluates like a DFlash one: per-slot acceptance for each
    of its drafts (DSpark: every slot of its block of 4 drafts, so 5 tokens are verified a step)."""
    target = load_target(chat_target, param_dtype=jnp.float32, compute_dtype=jnp.float32)
    heads = {
        "dflash2": dict(selector_rank=16),
        "dspark": dict(markov_rank=16),
        "xpress": dict(xpress_rank=16, xpress_mlp_hidden=32),
    }[kind]
    drafter = make_drafter(target, seed=3, mask_id=CHAT_VOCAB - 1, kind=kind, **heads)
    export = export_drafter(drafter, tmp_path / "export", dtype=jnp.float32)
    settings = [f"--drafter={export}", f"--target={chat_target}", f"--prompts={prompts_file}", "--limit=2"]
    settings += ["--max_new_tokens=12", "--dtype=float32", f"--output={tmp_path / 'eval'}"]
    run_cli(evaluate, [*settings, f"--confidence_threshold={threshold}"])
    result = json.loads((tmp_path / "eval" / "eval.json").read_text())
    run, stats = result["run"], result["sets"]["prompts"]
    drafts = 4 if kind == "dspark" else 3
    assert (run["drafter_kind"], run["verify_size"], run["confidence_threshold"]) == (kind, drafts + 1, threshold)
    assert len(stats["slot_acceptance"]) == drafts and len(stats["histogram"]) == drafts + 1
    assert stats["identical_outputs"] == 1.0  # greedy is lossless for every kind
    if kind != "dspark":  # the threshold truncates DSpark's blocks only: anything else is a user error
        with pytest.raises(UserError, match="a confidence threshold applies to drafter.kind='dspark' only"):
            run_cli(evaluate, [*settings, "--confidence_threshold=0.5"])
        # A draft vocabulary needs the drafter's token frequencies (training writes them).
        with pytest.raises(UserError, match="token_frequencies.json"):
            run_cli(evaluate, [*settings, "--draft_vocab=64"])
        counts = np.random.default_rng(0).integers(0, 50, CHAT_VOCAB)
        write_frequencies(str(export / FREQUENCIES_FILE), counts, source="test")
        run_cli(evaluate, [*settings, "--draft_vocab=64"])
        result = json.loads((tmp_path / "eval" / "eval.json").read_text())
        assert result["run"]["draft_vocab"] == 64 and result["sets"]["prompts"]["identical_outputs"] == 1.0


def test_speed_is_timed_batch_by_batch_with_the_decoders_in_turn():
    """A slow spell of a shared machine must weigh on DFlash and on the target alone alike: each
    batch is decoded by one and then the other, not all of one's batches before the other's."""
    calls = []

    class Recording:
        batch_size = 2

        def __init__(self, name):
            self.name = name

        def generate(self, prompts, *, seed):
            calls.append((self.name, list(prompts), seed))
            return [self.name] * len(prompts)

    batches = timed_generate({"a": Recording("a"), "b": Recording("b")}, [1, 2, 3, 4, 5], seed=10, desc="test")
    assert [(name, prompts) for name, prompts, _ in calls] == [
        ("a", [1, 2]),
        ("b", [1, 2]),
        ("a", [3, 4]),
        ("b", [3, 4]),
        ("a", [5]),
        ("b", [5]),
    ]
    assert [seed for _, _, seed in calls] == [10, 10, 11, 11, 12, 12]  # the same seed for both
    assert [gens for _, gens in batches["b"]] == [["b", "b"], ["b", "b"], ["b"]]


def test_speed_after_the_first_token_leaves_each_batch_prefill_out():
    def gen(num_tokens, first_token_s):
        return Generation(np.zeros(num_tokens, np.int32), np.ones(num_tokens - 1, np.int32), first_token_s)

    # Two batches: 2 s with a 0.5 s prefill (rows of 11 and 6 tokens), 1 s with a 0.2 s prefill (5 tokens).
    result = speed([(2.0, [gen(11, 0.5), gen(6, 0.5)]), (1.0, [gen(5, 0.2)])])
    assert result["tokens"] == 22 and result["tokens_per_s"] == pytest.approx(22 / 3)
    assert result["first_token_ms"] == pytest.approx(350)
    assert result["decode_tokens_per_s"] == pytest.approx((22 - 3) / (3 - 0.7))
    assert result["decode_ms_per_token"] == pytest.approx(1000 * np.mean([1.5 / 10, 1.5 / 5, 0.8 / 4]))
    # A one-token answer has no decoding after its first token to time.
    assert speed([(1.0, [gen(1, 1.0)])])["decode_ms_per_token"] == 0.0


def test_the_table_shows_both_speedups_and_reads_results_saved_before_the_second():
    result = {
        "num_prompts": 4,
        "tau": 2.5,
        "dflash": {"tokens_per_s": 30.0, "ms_per_token": 33.3},
        "target": {"tokens_per_s": 20.0, "ms_per_token": 50.0},
        "speedup": 1.5,
        "decode_speedup": 1.62,
        "histogram": [1, 1],
    }
    old = {k: v for k, v in result.items() if k != "decode_speedup"}  # an eval.json of an earlier version
    header, _, new_row, old_row, *_ = report.table({"new": result, "old": old}).splitlines()
    assert header.split()[-3:] == ["after", "1st", "token"]
    assert new_row.split()[-2:] == ["1.50", "1.62"] and old_row.split()[-2:] == ["1.50", "-"]


def test_the_engine_table_puts_each_served_set_under_its_columns():
    figures = {"drafter": {"tokens_per_s": 12.0, "ms_per_token": 80.0}, "target": {"tokens_per_s": 10.0}}
    figures["target"]["ms_per_token"] = 100.0
    e = dict(figures, tau=2.25, steps=40, drafted=280, accepted=50, speedup=1.2, identical_outputs=1.0)
    engine = {"name": "vLLM", "served": {"float32": {"heldout": e, "a-longer-set-name": e}}}
    title, header, rule, ours, theirs = report.engine_table({"heldout": {"tau": 2.25}}, engine).splitlines()
    assert title.startswith("vLLM") and set(rule) == {"-"} and len(rule) == len(header)
    # Every line as wide as the header: the set column as wide as its longest name.
    assert len(ours) == len(theirs) == len(header) and header.startswith("set" + " " * 16)
    assert (
        ours.split()
        == ["heldout", "float32", "2.25", "2.25", "40", "280", "50"] + "12.0 10.0 80.00 100.00 1.20 1.00".split()
    )
    assert theirs.split()[:3] == ["a-longer-set-name", "float32", "-"]  # a set our decoder did not run
