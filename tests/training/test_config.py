"""Config errors are caught before anything compiles, each with one clear message."""

from __future__ import annotations

import ast
import dataclasses
import re
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from dflash_jax.errors import ConfigError
from dflash_jax.models import kinds
from dflash_jax.models.drafter_config import section_fields
from dflash_jax.models.formats.gguf_export import llama_cpp_problems
from dflash_jax.training.checkpoint import changed_settings
from dflash_jax.training.config import sections
from dflash_jax.training.config.presets import load_config_file
from dflash_jax.training.config.run_config import resolve
from dflash_jax.training.config.schema import FIELDS_DOCUMENTED, base_config, check_field_path, field_paths
from dflash_jax.training.config.targets import target_for_plan
from dflash_jax.training.objective import ObjectiveConfig, ObjectiveSettings
from dflash_jax.training.optim.optimizer import PAPER_WARMUP_FRACTION, OptimizerConfig, learning_rate_schedule
from support import training_runs as testing
from support.stderr import user_lines

ALL_SECTIONS = {"": sections.TopLevelSettings, **sections.SECTIONS}


def config_file(name: str) -> str:
    return str(testing.REPO / "configs" / f"{name}.py")


def tiny_config(tiny_run, tmp_path, **fields):
    config = load_config_file(config_file("default"))
    config.update_from_flattened_dict({**testing.overrides(tiny_run, tmp_path / "run"), **fields})
    return config


def test_default_config_resolves_on_the_bundled_assets():
    setup = resolve(load_config_file(config_file("default")), num_devices=1)
    assert setup.drafter.mask_token_id == 5  # <|MASK|> of the bundled tokenizer
    assert setup.drafter.target_layer_ids == (0, 1, 2)  # every layer of the 4-layer target engines capture
    assert not llama_cpp_problems(setup.drafter.to_hf(), setup.target.num_layers)  # servable as it comes out


def test_tiny_config_resolves(tiny_run, tmp_path):
    setup = resolve(tiny_config(tiny_run, tmp_path), num_devices=1)
    assert setup.drafter.mask_token_id == testing.MASK_TOKEN_ID
    assert setup.drafter.target_layer_ids == (1,)  # one drafter layer reads the middle layer
    assert setup.objective.loss_decay_gamma == 4.0  # the paper's value for block size 8


@pytest.mark.parametrize(
    "fields, num_devices, message",
    [
        ({"drafter.block_size": 128}, 1, "drafter.block_size=128 must be below data.seq_len=128"),
        ({"drafter.block_size": 1}, 1, "drafter.block_size=1 must be at least 2"),
        (
            {"drafter.target_layer_ids": (0, 2)},
            1,
            r"drafter.target_layer_ids \[0, 2\]: \[2\] out of range, the target has 2 layers",
        ),
        ({"mesh.data": 2}, 1, "mesh: mesh shape data=2 x fsdp=1 x tensor=1 = 2 devices, but 1 are available"),
        ({"mesh.fsdp": 3}, 4, "mesh: mesh fsdp=3 x tensor=1 does not divide the 4 available devices"),
        ({"mesh.tensor": 0}, 1, "mesh: mesh shape data=-1, fsdp=1, tensor=0 is invalid"),
        ({"mesh.tensor": 4}, 4, "mesh.tensor=4 must divide the target's num_key_value_heads=2"),
        ({"data.global_batch_rows": 6}, 4, r"data.global_batch_rows=6 must be divisible by mesh data x fsdp \(4\)"),
        (
            {"mesh.tensor": 2, "data.global_batch_rows": 2},
            8,
            r"data.global_batch_rows=2 must be divisible by mesh data x fsdp \(4\) x train.grad_accum_steps",
        ),
        ({"train.grad_accum_steps": 8}, 1, r"train.grad_accum_steps \(8\) = 8"),
        ({"target.path": "/nonexistent/model"}, 1, "target.path=/nonexistent/model: no such directory"),
        ({"target.path": ""}, 1, "target.path is empty"),
        (
            {"data.train": "/nonexistent/train.jsonl"},
            1,
            "data.train: data source '/nonexistent/train.jsonl' does not exist",
        ),
        ({"data.train": ""}, 1, "data.train is empty"),
        ({"workdir": ""}, 1, "workdir is empty"),
        ({"eval.prompts": "/nonexistent/prompts.jsonl"}, 1, "eval.prompts='/nonexistent/prompts.jsonl' does not exist"),
        ({"drafter.mask_token_id": 512}, 1, "drafter.mask_token_id=512 is outside the target vocabulary"),
        ({"drafter.block_size": 12}, 1, r"block_size=12 has no paper loss decay gamma .* set train.loss_decay_gamma"),
        ({"train.num_anchors": 129}, 1, "train.num_anchors=129 must be at most data.seq_len=128"),
        ({"train.compute_dtype": "float16"}, 1, "train.compute_dtype='float16' is not one of"),
        ({"checkpoint.every_steps": 0}, 1, "checkpoint.every_steps=0 must be at least 1"),
        ({"train.max_steps": -1}, 1, "train.max_steps=-1 must be at least 0"),
        ({"data.format": "foo"}, 1, "data.format='foo' is not one of auto, messages, conversations, text"),
        ({"data.on_bad_sample": "ignore"}, 1, "data.on_bad_sample='ignore' is not one of skip, error"),
        ({"data.seq_len": 0}, 1, "data.seq_len=0 must be at least 2"),
        ({"data.seed": -3}, 1, "data.seed=-3 must be at least 0"),
        ({"train.learning_rate": -1e-3}, 1, "train.learning_rate=-0.001 must be > 0"),
        ({"train.warmup_fraction": 1.5}, 1, r"train.warmup_fraction=1.5 must be in \[0, 1\)"),
        ({"train.grad_accum_steps": 0}, 1, "train.grad_accum_steps=0 must be at least 1"),
        ({"drafter.num_layers": 0}, 1, "drafter.num_layers=0 must be at least 1"),
        ({"drafter.mask_token_id": -5}, 1, "drafter.mask_token_id=-5 must be at least -1"),
        ({"eval.max_new_tokens": 0}, 1, "eval.max_new_tokens=0 must be at least 1"),
        ({"eval.num_prompts": -1}, 1, "eval.num_prompts=-1 must be at least 0"),
        ({"seed": -1}, 1, "seed=-1 must be at least 0"),
        ({"distributed.process_id": -2}, 1, "distributed.process_id=-2 must be at least -1"),
        ({"train.loss": "focal"}, 1, "train.loss='focal' is not one of dflash, dpace"),
        ({"train.dpace_alpha": 1.5}, 1, r"train.dpace_alpha=1.5 must be in \[0, 1\] \(or -1, the drafter kind.s\)"),
        ({"train.optimizer": "sgd"}, 1, "train.optimizer='sgd' is not one of adamw, muon"),
        ({"train.ema_decay": 1.0}, 1, r"train.ema_decay=1.0 must be in \[0, 1\)"),
        ({"train.num_epochs": "six"}, 1, "train.num_epochs='six' must be an integer"),
        ({"train.remat": 1}, 1, "train.remat=1 must be True or False"),
        (
            {"train.remat_policy": "minimal"},
            1,
            "^train.remat_policy='minimal' is not one of full, dots_saveable, dots_with_no_batch_dims_saveable$",
        ),
        ({"train.max_steps": True}, 1, "train.max_steps=True must be an integer"),
        ({"drafter.target_layer_ids": (0, "1")}, 1, r"drafter.target_layer_ids=\(0, '1'\) must be a tuple of integers"),
        # Drafter kinds: a bad value, a bad size, a bad combination.
        ({"drafter.kind": "eagle"}, 1, "^drafter.kind='eagle' is not one of dflash, dflash2, dspark, domino, xpress$"),
        (
            {"drafter.kind": "dflash2", "drafter.conv_group_size": 24},
            1,
            "^drafter.conv_group_size=24 must divide hidden_size=32$",
        ),
        ({"drafter.kind": "dflash2", "drafter.selector_top_k": 0}, 1, "^drafter.selector_top_k=0 must be at least 1$"),
        (
            {"drafter.kind": "dspark", "train.loss": "dflash", "train.distill": True},
            1,
            "^train.distill does not apply to drafter.kind='dspark'",
        ),
        ({"eval.confidence_threshold": 0.5}, 1, "^eval.confidence_threshold applies to drafter.kind='dspark' only"),
        ({"train.selector_alpha": -1.0}, 1, "^train.selector_alpha=-1.0 must be at least 0$"),
        ({"train.base_loss_weight": 1.5}, 1, r"^train.base_loss_weight=1.5 must be in \[0, 1\]$"),
        ({"train.init_from_target_layer": -2}, 1, "^train.init_from_target_layer=-2 must be at least -1$"),
        ({"train.init_from_target_layer": 99}, 1, "^train.init_from_target_layer=99 is out of range, the target has"),
    ],
)
def test_config_error_messages(tiny_run, tmp_path, fields, num_devices, message):
    with pytest.raises(ConfigError, match=message):
        resolve(tiny_config(tiny_run, tmp_path, **fields), num_devices=num_devices)


def test_base_config_is_generated_from_the_section_dataclasses():
    config = base_config().to_dict()
    written = {name: config.pop(name) for name in sections.SECTIONS}
    written[""] = config  # what is left: the top-level fields
    for name, section in ALL_SECTIONS.items():
        fields = section_fields(section)  # the drafter's: not those it takes from its target
        assert sorted(written[name]) == sorted(f.name for f in fields), name  # no field more, none fewer
        for field in fields:
            value = written[name][field.name]
            # The same default, of the same type: 0.0 stays a float, () a tuple.
            assert (value, type(value)) == (field.default, type(field.default)), f"{name}.{field.name}"


def test_defaults_of_the_objective_and_optimizer_are_the_train_sections():
    """The train section extends the objective's and the optimizer's settings, so their defaults
    are written once; resolve hands every one of them on."""
    assert issubclass(sections.TrainSettings, ObjectiveSettings) and issubclass(sections.TrainSettings, OptimizerConfig)
    config = base_config()
    config.target.path = str(testing.REPO / "assets" / "tiny-qwen3")
    setup = resolve(config, num_devices=1, check_files=False)
    kind = setup.drafter.kind_spec  # the schedule the run leaves to it
    assert setup.optimizer == dataclasses.replace(
        OptimizerConfig(), warmup_fraction=kind.warmup_fraction, grad_clip_norm=kind.grad_clip_norm
    )
    defaulted = [f.name for f in dataclasses.fields(ObjectiveConfig) if f.default is not dataclasses.MISSING]
    assert {name: getattr(setup.objective, name) for name in defaulted} == {
        name: getattr(ObjectiveConfig, name) for name in defaulted
    }


def test_every_section_default_passes_its_own_checks():
    for name, section in ALL_SECTIONS.items():
        assert section().problems() == [], name


@pytest.mark.parametrize(
    "section, fields, message",
    [
        ("train", {"b2": 1.0}, r"train.b2=1.0 must be in \[0, 1\)"),
        ("train", {"attention": "flash"}, "train.attention='flash' is not one of"),
        ("train", {"anchor_scheme": "token"}, "train.anchor_scheme='token' is not one of document, response, row"),
        ("train", {"grad_clip_norm": -1.0}, r"train.grad_clip_norm=-1.0 must be > 0 \(or 0, the drafter kind's\)"),
        ("target", {"dtype": "fp8"}, "target.dtype='fp8' is not one of"),
        ("log", {"every_steps": 0}, "log.every_steps=0 must be at least 1"),
        ("distributed", {"num_processes": -1}, "distributed.num_processes=-1 must be at least 0"),
        ("drafter", {"intermediate_size": -1}, "drafter.intermediate_size=-1 must be at least 0"),
    ],
)
def test_sections_check_their_own_fields(section, fields, message):
    problems = sections.SECTIONS[section](**fields).problems()
    assert len(problems) == 1 and re.match(message, problems[0]), problems


def test_a_field_that_does_not_exist_names_the_closest_one(tiny_run, tmp_path):
    with pytest.raises(ConfigError, match=r"^no field train.lerning_rate; did you mean train.learning_rate\?$"):
        check_field_path("train.lerning_rate")
    with pytest.raises(ConfigError, match=r"^no field learning_rate; did you mean train.learning_rate\?$"):
        check_field_path("learning_rate")
    with pytest.raises(ConfigError, match="no field zzz; every field, its default and its meaning are documented"):
        check_field_path("zzz")
    config = tiny_config(tiny_run, tmp_path)
    config.eval.promts = "heldout"  # as a config file would set it: silently, were it not checked
    with pytest.raises(ConfigError, match=r"^no field eval.promts; did you mean eval.prompts\?$"):
        resolve(config, num_devices=1)


def test_where_fields_are_documented_exists():
    """The pointer in --help and in messages names the files that define every section."""
    files = re.findall(r"dflash_jax/[\w/]+\.py", FIELDS_DOCUMENTED)
    defined_in = {
        sys.modules[cls.__module__].__file__
        for section in ALL_SECTIONS.values()
        for cls in section.__mro__
        if dataclasses.is_dataclass(cls)
    }
    kinds_folder = str(testing.REPO / "dflash_jax" / "models" / "kinds")
    assert "dflash_jax/models/kinds/" in FIELDS_DOCUMENTED  # the kinds' sizes: a module each
    assert {str(testing.REPO / f) for f in files} == {f for f in defined_in if not f.startswith(kinds_folder)}
    assert len(field_paths()) == sum(len(section_fields(section)) for section in ALL_SECTIONS.values())


def test_values_of_a_close_type_are_converted(tiny_run, tmp_path):
    fields = {"train.learning_rate": 1, "drafter.target_layer_ids": [0, 1], "train.num_anchors": np.int64(16)}
    setup = resolve(tiny_config(tiny_run, tmp_path, **fields), num_devices=1)
    assert type(setup.optimizer.learning_rate) is float and setup.optimizer.learning_rate == 1.0
    assert setup.drafter.target_layer_ids == (0, 1)
    assert type(setup.objective.num_anchors) is int and setup.objective.num_anchors == 16


def test_loss_fields_reach_the_objective(tiny_run, tmp_path):
    fields = {"train.loss": "dpace", "train.dpace_alpha": 0.25, "train.distill": True}
    objective = resolve(tiny_config(tiny_run, tmp_path, **fields), num_devices=1).objective
    assert (objective.loss, objective.dpace_alpha, objective.distill) == ("dpace", 0.25, True)


@pytest.mark.parametrize(
    "fields, drafter, gamma",
    [
        (
            {"drafter.kind": "dflash2", "drafter.selector_rank": 32, "drafter.conv_kernel_size": 3},
            dict(kind="dflash2", selector_rank=32, conv_kernel_size=3, markov_rank=256),
            4.0,  # the paper's for block size 8
        ),
        (
            {"drafter.kind": "dspark", "drafter.markov_rank": 16, "drafter.block_size": 7, "train.loss": "dflash"},
            dict(kind="dspark", markov_rank=16),
            4.0,
        ),
    ],
)
def test_kind_fields_reach_the_drafter_and_the_objective(tiny_run, tmp_path, fields, drafter, gamma):
    setup = resolve(tiny_config(tiny_run, tmp_path, **{**fields, "train.selector_alpha": 0.5}), num_devices=1)
    assert {k: getattr(setup.drafter, k) for k in drafter} == drafter
    assert (setup.objective.drafter, setup.objective.selector_alpha) == (setup.drafter, 0.5)
    assert setup.objective.loss_decay_gamma == gamma  # DSpark: DeepSpec's 4 whatever the block size
    assert type(setup.drafter).from_hf(setup.drafter.to_hf()) == setup.drafter  # what a checkpoint keeps


@pytest.mark.parametrize("kind", sorted(kinds.KINDS))
@pytest.mark.parametrize("loss", ["", "dpace"])
def test_the_kind_alone_makes_a_run_of_that_kind(tiny_run, tmp_path, kind, loss):
    """`drafter.kind=K` and nothing else: the loss ('' = the kind's own), γ and the sizes that
    follow the target are the kind's; a config's other-kind sizes (the default run sets DFlash2's
    selector_top_k) do not stop it."""
    fields = {"drafter.kind": kind, "drafter.selector_top_k": 15, "train.loss": loss}
    setup = resolve(tiny_config(tiny_run, tmp_path, **fields), num_devices=1)
    spec = kinds.get(kind)
    assert setup.drafter.kind == kind and setup.objective.drafter == setup.drafter
    assert setup.objective.loss == (loss or spec.loss)
    assert setup.objective.loss_decay_gamma == (spec.loss_decay_gamma or 4.0)  # else the paper's for block 8
    assert setup.drafter.selector_top_k == (15 if kind == "dflash2" else 16)
    if kind == "domino":  # SpecForge's Qwen3-8B sizes in proportion: H / 4 and H / 16
        hidden = setup.target.hidden_size
        assert (setup.drafter.gru_hidden_dim, setup.drafter.emb_dim) == (hidden // 4, hidden // 16)


@pytest.mark.parametrize("kind", sorted(kinds.KINDS))
def test_the_kind_sets_the_anchors_that_train_num_anchors_0_leaves_to_it(kind):
    """The default run leaves its anchors to the kind: 64 a 512-token row for DFlash2 and XPress,
    192 at most 64 a document for the kinds that gain from SpecForge's density; a set count or cap
    is kept."""
    config = load_config_file(config_file("default"))
    config.drafter.kind = kind
    spec = kinds.get(kind)
    objective = resolve(config, num_devices=1).objective
    assert (objective.num_anchors, objective.anchors_per_document) == (
        round(512 * spec.anchors_per_token),
        spec.anchors_per_document,
    )
    assert objective.num_anchors == (64 if kind in ("dflash2", "xpress") else 192)
    config.train.anchors_per_document = 32
    assert resolve(config, num_devices=1).objective.anchors_per_document == 32
    config.train.num_anchors = 100
    objective = resolve(config, num_devices=1).objective
    assert (objective.num_anchors, objective.anchors_per_document) == (100, 32)
    config.train.anchors_per_document = 0
    assert resolve(config, num_devices=1).objective.anchors_per_document == 0  # no cap, as set


@pytest.mark.parametrize("kind", sorted(kinds.KINDS))
def test_the_kind_sets_d_paces_alpha_unless_train_dpace_alpha_is_set(kind):
    """The default run leaves D-PACE's α to the kind (0.3 for DFlash, the paper's 0.5 for the
    others); a set α, 0 included, is kept."""
    config = load_config_file(config_file("default"))
    config.drafter.kind = kind
    assert config.train.dpace_alpha == -1
    assert resolve(config, num_devices=1).objective.dpace_alpha == (0.3 if kind == "dflash" else 0.5)
    for alpha in (0.0, 0.8):
        config.train.dpace_alpha = alpha
        assert resolve(config, num_devices=1).objective.dpace_alpha == alpha


@pytest.mark.parametrize("kind", sorted(kinds.KINDS))
def test_the_kind_sets_the_schedule_unless_the_run_does(kind):
    """The default run leaves the warmup and the clip to the kind (SpecForge's 0.015 and 0.5 for
    DFlash and Domino, the paper's 0.04 and 1.0 for the others); a set value, a warmup of 0
    included, is kept, and the schedule the optimizer builds is the resolved one. The config the
    run records holds the resolved values, so that a checkpoint saved before a kind took its own
    schedule compares with what the run trains with, not with -1 and 0."""
    config = load_config_file(config_file("default"))
    config.drafter.kind = kind
    assert (config.train.warmup_fraction, config.train.grad_clip_norm) == (-1, 0)
    setup = resolve(config, num_devices=1)
    optimizer = setup.optimizer
    specforge = kind in ("dflash", "domino")
    assert (optimizer.warmup_fraction, optimizer.grad_clip_norm) == ((0.015, 0.5) if specforge else (0.04, 1.0))
    recorded = setup.config_dict["train"]
    assert (recorded["warmup_fraction"], recorded["grad_clip_norm"]) == (
        optimizer.warmup_fraction,
        optimizer.grad_clip_norm,
    )
    assert (recorded["num_anchors"], recorded["loss"]) == (setup.objective.num_anchors, setup.objective.loss)
    before = {"config": {**setup.config_dict, "train": {**recorded, "warmup_fraction": 0.04, "grad_clip_norm": 1.0}}}
    assert changed_settings(before, setup.config_dict) == (
        "train.grad_clip_norm: 1.0 -> 0.5; train.warmup_fraction: 0.04 -> 0.015" if specforge else ""
    )
    warmup_steps = round((0.015 if specforge else PAPER_WARMUP_FRACTION) * 1000)
    schedule = learning_rate_schedule(optimizer, 1000)
    assert schedule(warmup_steps) == pytest.approx(optimizer.learning_rate)
    assert schedule(warmup_steps - 1) < optimizer.learning_rate
    config.train.warmup_fraction, config.train.grad_clip_norm = 0.0, 2.0
    optimizer = resolve(config, num_devices=1).optimizer
    assert (optimizer.warmup_fraction, optimizer.grad_clip_norm) == (0.0, 2.0)
    assert learning_rate_schedule(optimizer, 1000)(0) == pytest.approx(optimizer.learning_rate)


def test_xpress_on_dflash2s_backbone_keeps_the_convolutions_sizes(tiny_run, tmp_path):
    """Sizes XPress borrows from DFlash2 (its convolutions) stay as set; DFlash2's others do not."""
    fields = {
        "drafter.kind": "xpress",
        "drafter.xpress_backbone": "dflash2",
        "drafter.conv_kernel_size": 3,
        "drafter.selector_top_k": 15,
    }
    drafter = resolve(tiny_config(tiny_run, tmp_path, **fields), num_devices=1).drafter
    assert (drafter.xpress_backbone, drafter.conv_kernel_size, drafter.selector_top_k) == ("dflash2", 3, 16)


@pytest.mark.slow
def test_train_py_names_a_mistyped_field_in_one_line():
    """Found when the flags are parsed: before the config file's target is read or JAX starts."""
    result = subprocess.run(
        [sys.executable, str(testing.REPO / "train.py"), "--config.train.lerning_rate=1e-3"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=testing.REPO,
    )
    assert (result.returncode, user_lines(result.stderr)) == (
        1,
        ["config error: no field train.lerning_rate; did you mean train.learning_rate?"],
    )


def test_mask_token_is_looked_up_in_the_tokenizer(tiny_run, tmp_path):
    import json
    import shutil

    tokenizer = json.loads((Path(tiny_run.target) / "tokenizer.json").read_text())
    mask = [t["id"] for t in tokenizer["added_tokens"] if t["content"] == "<|MASK|>"]
    setup = resolve(tiny_config(tiny_run, tmp_path, **{"drafter.mask_token_id": -1}), num_devices=1)
    assert [setup.drafter.mask_token_id] == mask
    target = tmp_path / "no_mask"
    shutil.copytree(tiny_run.target, target)
    tokenizer["added_tokens"] = [t for t in tokenizer["added_tokens"] if t["content"] != "<|MASK|>"]
    (target / "tokenizer.json").write_text(json.dumps(tokenizer))
    config = tiny_config(tiny_run, tmp_path, **{"drafter.mask_token_id": -1, "target.path": str(target)})
    with pytest.raises(ConfigError, match=r"looks up <\|MASK\|> in .*tokenizer.json, which has no such token"):
        resolve(config, num_devices=1)


def test_tensor_axis_splits_rows_over_data_and_fsdp_only(tiny_run, tmp_path):
    setup = resolve(tiny_config(tiny_run, tmp_path, **{"mesh.tensor": 2, "data.global_batch_rows": 2}), num_devices=4)
    assert setup.mesh_shape == (2, 1, 2)
    # fsdp=-1: the target split over every device the tensor groups leave (a preset for any host count)
    split = tiny_config(tiny_run, tmp_path, **{"mesh.tensor": 2, "mesh.data": 1, "mesh.fsdp": -1})
    assert resolve(split, num_devices=4).mesh_shape == (1, 2, 2)


def test_explicit_gamma_allows_other_block_sizes(tiny_run, tmp_path):
    config = tiny_config(tiny_run, tmp_path, **{"drafter.block_size": 12, "train.loss_decay_gamma": 6.0})
    assert resolve(config, num_devices=1).objective.loss_decay_gamma == 6.0


@pytest.mark.slow
def test_train_py_reports_config_errors_before_compiling(tiny_run, tmp_path):
    fields = testing.overrides(tiny_run, tmp_path / "run", **{"drafter.mask_token_id": 4096})
    result = subprocess.run(
        [sys.executable, str(testing.REPO / "train.py"), *[f"--config.{k}={v}" for k, v in fields.items()]],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=testing.REPO,
    )
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "config error: drafter.mask_token_id=4096 is outside the target vocabulary (vocab_size=512); "
        "use an existing reserved token such as <|MASK|>"
    )
    assert not (tmp_path / "run").exists()  # nothing was set up, let alone compiled


CONFIG_FILES = sorted(p.stem for p in (testing.REPO / "configs").glob("*.py"))


def preset_sizes() -> list[tuple[str, str]]:
    """Every size of every preset planned from a public config.json (configs/<name>.py's SIZES)."""
    found = []
    for name in CONFIG_FILES:
        tree = ast.parse(Path(config_file(name)).read_text())
        sizes = [n.value for n in tree.body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "SIZES"]
        found += [(name, ast.literal_eval(key)) for value in sizes for key in value.keys]
    return found


@pytest.mark.parametrize("name, size", preset_sizes())
def test_every_preset_resolves_against_its_published_config(name, size):
    """What `python -m dflash_jax.plan` checks before compiling: the preset's fields against the
    target's public config.json, its mask token a row of that target's embedding included."""
    config = load_config_file(config_file(name), size)
    target, source = target_for_plan(config)
    setup = resolve(config, num_devices=8, target=target, check_files=False)
    assert 0 <= setup.drafter.mask_token_id < target.vocab_size, source
    assert not llama_cpp_problems(setup.drafter.to_hf(), target.num_layers), source  # the export is servable
    if config.drafter.mask_token_id >= 0:  # an id the preset sets is kept, and must be a row of the embedding
        assert setup.drafter.mask_token_id == config.drafter.mask_token_id, source
        config.drafter.mask_token_id = target.vocab_size
        with pytest.raises(ConfigError, match="outside the target vocabulary"):
            resolve(config, num_devices=8, target=target, check_files=False)


@pytest.mark.parametrize("name", CONFIG_FILES)
def test_config_files_open_with_their_command(name):
    docstring = ast.get_docstring(ast.parse(Path(config_file(name)).read_text()))
    paragraphs = docstring.split("\n\n")
    assert paragraphs[1].strip().startswith("python train.py"), paragraphs[:2]


def test_qwen3_variants_pick_size_block_and_mesh(tmp_path):
    config = load_config_file(config_file("qwen3"))
    assert (config.drafter.num_layers, config.drafter.block_size, config.mesh.fsdp) == (5, 16, 1)
    assert (config.train.num_anchors, config.train.learning_rate, config.train.num_epochs) == (512, 6e-4, 6)
    config = load_config_file(config_file("qwen3"), "4b,b10,fsdp")
    assert (config.drafter.block_size, config.mesh.fsdp) == (10, 4)
    config.workdir = str(tmp_path)
    with pytest.raises(ConfigError, match="target.path is empty"):
        resolve(config, num_devices=8)
    for bad, message in [("b12", r"unknown config variant\(s\) \['b12'\]"), ("4b,8b", "one size and one block size")]:
        with pytest.raises(ConfigError, match=message):
            load_config_file(config_file("qwen3"), bad)


@pytest.mark.parametrize("block_size, gamma", [(16, 7.0), (10, 5.0), (8, 4.0)])
def test_loss_decay_gamma_is_the_papers_for_its_block_size(tiny_run, tmp_path, block_size, gamma):
    setup = resolve(tiny_config(tiny_run, tmp_path, **{"drafter.block_size": block_size}), num_devices=1)
    assert setup.objective.loss_decay_gamma == gamma


@pytest.mark.slow
def test_a_failed_start_is_one_line_and_leaves_no_workdir(tiny_run, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant"}]}\n')
    fields = testing.overrides(
        tiny_run,
        tmp_path / "run",
        **{"data.train": str(bad), "data.cache_dir": str(tmp_path / "cache"), "data.on_bad_sample": "error"},
    )
    result = subprocess.run(
        [sys.executable, str(testing.REPO / "train.py"), *[f"--config.{k}={v}" for k, v in fields.items()]],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=testing.REPO,
    )
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(f"error: {bad}:1: ")
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_prepare_reports_config_errors_in_one_line(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "dflash_jax.prepare",
            f"--config={config_file('default')}",
            f"--config.data.train={tmp_path / 'missing.jsonl'}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=testing.REPO,
    )
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("config error: data.train: ")


def test_prepare_plans_the_configs_epochs_unless_told(tiny_run, tmp_path, capsys):
    """`prepare --num_epochs` defaults to the config's train.num_epochs."""
    from dflash_jax import prepare

    config = tiny_config(tiny_run, tmp_path, **{"train.num_epochs": 3})
    for num_epochs, expected in ((None, 3), (1, 1)):
        prepare.main([], types.SimpleNamespace(config=config, rebuild=False, num_epochs=num_epochs))
        steps = re.search(r"steps per epoch \(4 x 128\): \[([\d, ]+)\], total", capsys.readouterr().out)
        assert steps and len(steps.group(1).split(",")) == expected
