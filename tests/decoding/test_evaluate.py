"""`python -m dflash_jax.evaluate`: a workdir checkpoint and its export evaluate identically."""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl import flags
from flax import nnx

from dflash_jax import evaluate
from dflash_jax.decoding.chat import BadRow, ChatTokenizer, load_prompts
from dflash_jax.errors import UserError
from dflash_jax.models.config import DrafterConfig, TransformerConfig
from dflash_jax.models.hf import read_config
from dflash_jax.training.checkpoint import RunCheckpoints
from dflash_jax.training.drafters import export_checkpoint, load_any_drafter
from dflash_jax.training.evaluation import run_evaluation
from dflash_jax.training.mesh import make_mesh
from dflash_jax.training.step import OptimizerConfig, init_train_state, make_optimizer
from dflash_jax.training.workdir import Workdir
from support.chat_data import chat, write_jsonl
from support.decoding_models import CHAT_VOCAB

SETTINGS = dict(num_prompts=3, max_new_tokens=12)


class _IteratorState:
    """The data iterator's checkpointed state; evaluation never reads it."""

    def get_state(self):
        return {"epoch": 0, "step": 0}


@pytest.fixture(scope="module")
def workdir(chat_target, tmp_path_factory):
    """A training workdir with one checkpoint (saved by the training code) and its export."""
    workdir = tmp_path_factory.mktemp("workdir")
    cfg = DrafterConfig.for_target(
        TransformerConfig.from_hf(read_config(chat_target)), num_layers=1, mask_token_id=CHAT_VOCAB - 1, block_size=4
    )
    state = init_train_state(
        cfg, make_optimizer(OptimizerConfig(), 10), seed=0, compute_dtype=jnp.float32, mesh=make_mesh(-1, 1)
    )
    # Larger weights than the 0.02 init, so that bf16 rounding is visible if it were skipped.
    state = state.replace(params=jax.tree.map(lambda p: p * 7.3, state.params))
    checkpoints = RunCheckpoints(Workdir.at(str(workdir)).checkpoints, every_steps=1, keep=None, async_save=False)
    checkpoints.save(5, state, {"drafter_config": cfg.to_hf()}, _IteratorState(), force=True)
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


@pytest.mark.parametrize("module, flag", [("evaluate", "--drafter"), ("regenerate", "--server_url")])
def test_cli_entry_points_start(module, flag):
    # absl exits with status 1 after --help; what matters is that the program defines its flags.
    cli = subprocess.run(
        [sys.executable, "-m", f"dflash_jax.{module}", "--help"], capture_output=True, text=True, timeout=120
    )
    assert flag in cli.stdout, cli.stderr[-2000:]


def test_cli_on_export_reports_the_tau_of_the_workdir(chat_target, workdir, prompts_file, tmp_path, capsys):
    ours = run_evaluation(chat_target, str(workdir), [prompts_file], **SETTINGS)["sets"]["prompts"]
    out_dir = tmp_path / "eval"
    run_cli(
        evaluate,
        [
            f"--target={chat_target}",
            f"--drafter={workdir / 'export'}",
            f"--prompts={prompts_file}",
            f"--out_dir={out_dir}",
            f"--num_prompts={SETTINGS['num_prompts']}",
            f"--max_new_tokens={SETTINGS['max_new_tokens']}",
        ],
    )
    assert "speedup" in capsys.readouterr().out
    exported = json.loads((out_dir / "eval.json").read_text())["sets"]["prompts"]
    assert (out_dir / "eval.png").stat().st_size > 0
    for key in ("tau", "histogram", "slot_acceptance", "num_steps", "num_tokens"):
        assert exported[key] == ours[key], key
    assert ours["num_prompts"] == SETTINGS["num_prompts"]
    assert ours["identical_outputs"] == 1.0
    for mode in ("dflash", "target"):
        assert ours[mode]["tokens"] == ours["num_tokens"] and ours[mode]["tokens_per_s"] > 0
    assert ours["speedup"] == pytest.approx(ours["dflash"]["tokens_per_s"] / ours["target"]["tokens_per_s"])


def test_bad_inputs_are_clear_errors(chat_target, tmp_path):
    tokenizer = ChatTokenizer(chat_target)
    bad = write_jsonl(tmp_path / "bad.jsonl", [chat("fine"), {"messages": [{"role": "robot", "content": "x"}]}])
    with pytest.raises(BadRow, match=r"bad.jsonl:2: turn 0 has role 'robot'"):
        load_prompts(str(bad), tokenizer)
    broken = write_jsonl(tmp_path / "broken.jsonl", ["{not json"])
    with pytest.raises(BadRow, match=r"broken.jsonl:1: not valid JSON"):
        load_prompts(str(broken), tokenizer)
    with pytest.raises(FileNotFoundError, match="bundled: heldout_prompts"):
        load_prompts("no_such_set", tokenizer)
    with pytest.raises(UserError, match="neither a drafter export directory"):
        load_any_drafter(str(tmp_path))
