"""The training config resolved: `resolve(config, num_devices=...)` -> one frozen `TrainSetup`.

The schema and its checks are training/config/schema.py's (`base_config`, generated from the section
dataclasses of training/config/sections.py); config files (configs/*.py, their variants
training/config/presets.py's) override what differs. `resolve` is the only code that reads a config:
every section checks itself, then resolve checks what spans sections, reads the small files the run depends on (the
target's config.json and tokenizer.json, the existence of the data sources and eval prompts)
and returns one frozen `TrainSetup` that the rest of the run receives. Every mistake, a field
that does not exist or has the wrong type included, is a `ConfigError` naming its field, raised
before anything is created on disk or compiled.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import ml_collections

from dflash_jax.data.settings import DataConfig
from dflash_jax.data.sources import resolve_sources
from dflash_jax.decoding.prompt_sets import HeldoutPrompts, resolve_prompt_set
from dflash_jax.errors import ConfigError, ModelError, UserError
from dflash_jax.models import kinds
from dflash_jax.models.architecture import DTYPES, TransformerConfig
from dflash_jax.models.drafter_config import MASK_TOKEN, DrafterConfig
from dflash_jax.models.formats.hf import replace_problem
from dflash_jax.models.kind import Kind
from dflash_jax.training.config.schema import check_field_names, require, section
from dflash_jax.training.config.sections import (
    CheckpointSettings,
    DistributedSettings,
    EvalSettings,
    LogSettings,
    MeshSettings,
    TrainSettings,
)
from dflash_jax.training.config.targets import target_architecture, target_directory
from dflash_jax.training.mesh import mesh_shape
from dflash_jax.training.objective import PAPER_LOSS_DECAY_GAMMA, ObjectiveConfig, ObjectiveSettings
from dflash_jax.training.optim.optimizer import OptimizerConfig, with_schedule
from dflash_jax.training.workdir import Workdir, check_writable


@dataclasses.dataclass(frozen=True)
class RunSettings:
    """What the loop reads of the train section and the top-level seed (documented there)."""

    num_epochs: int
    max_steps: int
    grad_accum_steps: int
    max_nonfinite_streak: int
    seed: int
    attention: str
    init_from_target_layer: int
    scan_layers: bool


@dataclasses.dataclass(frozen=True)
class TrainSetup:
    """Everything a run needs, checked: what every part of training receives instead of the config."""

    workdir: Workdir
    target_path: str
    target: TransformerConfig
    target_dtype: Any
    compute_dtype: Any
    drafter: DrafterConfig
    objective: ObjectiveConfig
    optimizer: OptimizerConfig
    data: DataConfig
    mesh_shape: tuple[int, int, int]  # (data, fsdp, tensor)
    run: RunSettings
    checkpoint: CheckpointSettings
    log: LogSettings
    eval: EvalSettings
    distributed: DistributedSettings
    # The config as the user wrote it, each setting left to the drafter's kind (0 or -1) replaced
    # by the value the run trains with: what checkpoints record, a resumed run compares, and
    # experiment trackers show.
    config_dict: dict

    def with_run(self, **fields) -> TrainSetup:
        """This setup with fields of its run settings replaced (`attention="fused"`, `scan_layers=True`):
        how the plan's callers and bench/ compare one choice on the same run."""
        return dataclasses.replace(self, run=dataclasses.replace(self.run, **fields))

    def with_optimizer(self, optimizer: str) -> TrainSetup:
        """This setup with another optimizer (`train.optimizer`), its other settings kept."""
        return dataclasses.replace(self, optimizer=dataclasses.replace(self.optimizer, optimizer=optimizer))


def resolve_distributed(config: ml_collections.ConfigDict) -> DistributedSettings:
    """The distributed section alone: train.py needs it before JAX can count devices."""
    check_field_names(config)
    return section(config, "distributed")


def resolve(
    config: ml_collections.ConfigDict,
    *,
    num_devices: int,
    target: TransformerConfig | None = None,
    check_files: bool = True,
) -> TrainSetup:
    """Checks `config` and resolves every default; raises ConfigError naming the first bad field.

    target: the target architecture, when it does not come from `target.path` (benchmarks, the
    memory plan). check_files=False skips what only a real run reads (workdir, data sources,
    eval prompts): the memory plan and benchmarks have none.
    """
    try:
        return _resolve(config, num_devices, target, check_files)
    except ConfigError:
        raise
    except UserError as e:  # a file the config names is missing or unreadable
        raise ConfigError(str(e)) from None


def _resolve(config, num_devices, target, check_files) -> TrainSetup:
    """Each section checks itself (training/config/sections.py); then, in order, what spans sections or
    reads files."""
    check_field_names(config)
    top, target_section, drafter_section = section(config, ""), section(config, "target"), section(config, "drafter")
    train = section(config, "train")
    if check_files:
        require(bool(top.workdir), "workdir is empty: set --config.workdir=/path/to/run")
        check_writable(top.workdir, "workdir")
        workdir = Workdir.at(top.workdir)
        for out in (workdir.export, workdir.export_best):
            if problem := replace_problem(out):
                raise ConfigError(f"workdir={top.workdir}: {problem}: move it away, or choose another workdir")
    target_path, target = _target(target_section.path, target, check_files)
    data = _data(config, check_files)
    _check_blocks(drafter_section, train, target, data.seq_len)
    mask_token_id = _mask_token(drafter_section.mask_token_id, target, target_path, check_files)
    drafter = _drafter(dataclasses.replace(drafter_section, mask_token_id=mask_token_id), target)
    _check_drafter_kind(drafter, train)
    shape = _mesh(section(config, "mesh"), num_devices, target, data.global_batch_rows, train.grad_accum_steps)
    evaluation = _evaluation(section(config, "eval"), drafter.kind, data, target_path, check_files)
    objective, optimizer = _objective(train, drafter, data.seq_len), _optimizer(train, drafter.kind_spec)
    return TrainSetup(
        workdir=Workdir.at(top.workdir) if top.workdir else None,
        target_path=target_path,
        target=target,
        target_dtype=DTYPES[target_section.dtype],
        compute_dtype=DTYPES[train.compute_dtype],
        drafter=drafter,
        objective=objective,
        optimizer=optimizer,
        data=data,
        mesh_shape=shape,
        run=RunSettings(
            train.num_epochs,
            train.max_steps,
            train.grad_accum_steps,
            train.max_nonfinite_streak,
            top.seed,
            train.attention,
            train.init_from_target_layer,
            train.scan_layers,
        ),
        checkpoint=section(config, "checkpoint"),
        log=section(config, "log"),
        eval=evaluation,
        distributed=section(config, "distributed"),
        config_dict=_as_trained(json.loads(config.to_json_best_effort()), objective, optimizer),
    )


def _as_trained(config_dict: dict, *resolved) -> dict:
    """`config_dict` with its train section's fields as the `resolved` settings hold them (the
    objective's and optimizer's, the kind's defaults filled in): a checkpoint from before a kind
    took a default then compares with what this run trains with, not with its -1 or 0."""
    train = dict(config_dict["train"])
    for settings in resolved:
        train.update({k: v for k, v in _fields_of(settings, type(settings)).items() if k in train})
    return {**config_dict, "train": json.loads(json.dumps(train))}  # tuples as the JSON lists a checkpoint holds


def _target(path: str, target: TransformerConfig | None, check_files: bool) -> tuple[str, TransformerConfig]:
    """(target directory, target architecture): read from target.path unless given."""
    target_path = target_directory(path) if check_files or target is None else path
    return target_path, target or target_architecture(target_path)


def _check_blocks(drafter: DrafterConfig, train: TrainSettings, target: TransformerConfig, seq_len: int) -> None:
    """Blocks fit the rows, and the target layer a warm start copies exists."""
    require(
        drafter.block_size < seq_len, f"drafter.block_size={drafter.block_size} must be below data.seq_len={seq_len}"
    )
    require(
        train.init_from_target_layer < target.num_layers,
        f"train.init_from_target_layer={train.init_from_target_layer} is out of range, the target has "
        f"{target.num_layers} layers (valid 0..{target.num_layers - 1}, or -1 for random init)",
    )
    require(
        train.num_anchors <= seq_len, f"train.num_anchors={train.num_anchors} must be at most data.seq_len={seq_len}"
    )


def _mask_token(configured: int, target: TransformerConfig, target_path: str, check_files: bool) -> int:
    """The mask token's id: configured, or looked up in the tokenizer (DrafterConfig checks it
    is a row of the embedding)."""
    if check_files or configured >= 0:
        return _mask_token_id(configured, target_path)
    return target.vocab_size - 1  # a plan without a tokenizer: which row is the mask changes nothing planned


def _check_drafter_kind(drafter: DrafterConfig, train: TrainSettings) -> None:
    """The loss settings the drafter's kind can take."""
    kind = drafter.kind_spec
    require(
        bool(train.loss_decay_gamma or kind.loss_decay_gamma) or drafter.block_size in PAPER_LOSS_DECAY_GAMMA,
        f"drafter.block_size={drafter.block_size} has no paper loss decay gamma (known for "
        f"{sorted(PAPER_LOSS_DECAY_GAMMA)}); set train.loss_decay_gamma",
    )
    require(
        not (kind.reads_target_distribution and train.distill),
        f"train.distill does not apply to drafter.kind={kind.name!r}: its loss always reads the target's distribution",
    )


def _mesh(
    mesh: MeshSettings, num_devices: int, target: TransformerConfig, rows: int, accum: int
) -> tuple[int, int, int]:
    """(data, fsdp, tensor): the devices' layout, which the target's heads and MLP and the batch
    rows divide."""
    try:
        shape = mesh_shape(mesh.data, mesh.fsdp, num_devices, mesh.tensor)
    except ValueError as e:
        raise ConfigError(f"mesh: {e}") from None
    tensor = shape[2]
    for name, size in (
        ("num_attention_heads", target.num_heads),
        ("num_key_value_heads", target.num_kv_heads),
        ("intermediate_size", target.intermediate_size),
    ):
        require(
            size % tensor == 0,
            f"mesh.tensor={tensor} must divide the target's {name}={size} (heads and MLP are split over it)",
        )
    row_groups = shape[0] * shape[1]  # batch rows are split over data x fsdp, not tensor
    require(
        rows % (row_groups * accum) == 0,
        f"data.global_batch_rows={rows} must be divisible by mesh data x fsdp ({row_groups}) x "
        f"train.grad_accum_steps ({accum}) = {row_groups * accum}",
    )
    return shape


def _evaluation(
    evaluation: EvalSettings, kind: str, data: DataConfig, target_path: str, check_files: bool
) -> EvalSettings:
    """The eval section with its prompt set resolved (a file, a benchmark or the held-out rows)."""
    if evaluation.confidence_threshold and (problem := kinds.confidence_problem(kind)):
        raise ConfigError(f"eval.confidence_threshold {problem}")
    if evaluation.prompts and check_files:
        try:
            return dataclasses.replace(evaluation, prompts=resolve_prompt_set(evaluation.prompts)[1])
        except FileNotFoundError:
            raise ConfigError(f"eval.prompts={evaluation.prompts!r} does not exist ('' turns evaluation off)") from None
        except UserError as e:  # keeps the hub-cache hint
            raise ConfigError(f"eval.prompts: {e} ('' turns evaluation off)") from None
    if data.heldout_rows:
        return dataclasses.replace(evaluation, prompts=HeldoutPrompts(data, target_path))
    return evaluation


def _drafter(settings: DrafterConfig, target: TransformerConfig) -> DrafterConfig:
    """The drafter the section describes, resolved against the target and checked (its messages
    name the field)."""
    try:
        return DrafterConfig.for_target(target, settings)
    except ModelError as e:
        raise ConfigError(f"drafter.{e}") from None


def _objective(train: TrainSettings, drafter: DrafterConfig, seq_len: int) -> ObjectiveConfig:
    """The train section's objective fields, with the slot weighting, γ, D-PACE's α and anchors
    resolved for the drafter's kind, block size and row length."""
    kind = drafter.kind_spec
    gamma = train.loss_decay_gamma or kind.loss_decay_gamma or PAPER_LOSS_DECAY_GAMMA.get(drafter.block_size)
    anchors = {}
    if not train.num_anchors:
        anchors = {
            "num_anchors": max(1, round(kind.anchors_per_token * seq_len)),
            "anchors_per_document": train.anchors_per_document or kind.anchors_per_document,
        }
    return ObjectiveConfig(
        **{
            **_fields_of(train, ObjectiveSettings),
            "loss": train.loss or kind.loss,
            "loss_decay_gamma": float(gamma),
            "dpace_alpha": train.dpace_alpha if train.dpace_alpha >= 0 else kind.dpace_alpha,
            **anchors,
        },
        drafter=drafter,
    )


def _optimizer(train: TrainSettings, kind: Kind) -> OptimizerConfig:
    """The train section's optimizer fields, with the schedule the run leaves to the drafter's kind,
    or to the paper where the kind sets none."""
    return with_schedule(
        OptimizerConfig(**_fields_of(train, OptimizerConfig)), kind.warmup_fraction, kind.grad_clip_norm
    )


def _fields_of(settings, cls) -> dict[str, Any]:
    """The fields of `cls` (a dataclass `settings` extends) as `settings` holds them."""
    return {f.name: getattr(settings, f.name) for f in dataclasses.fields(cls)}


def resolve_data(config: ml_collections.ConfigDict) -> tuple[DataConfig, str]:
    """(data settings, target directory), checked with the data sources: what
    `python -m dflash_jax.prepare` needs (no devices, no model weights)."""
    try:
        check_field_names(config)
        target_path = target_directory(section(config, "target").path)
        return _data(config, check_files=True), target_path
    except ConfigError:
        raise
    except UserError as e:
        raise ConfigError(str(e)) from None


def _data(config: ml_collections.ConfigDict, check_files: bool) -> DataConfig:
    data = section(config, "data")
    if check_files:
        require(bool(data.train), "data.train is empty: set --config.data.train=/path/to/train.jsonl")
        try:
            resolve_sources(data.train)
        except UserError as e:
            raise ConfigError(f"data.train: {e}") from None
    return data


def _mask_token_id(configured: int, target_path: str) -> int:
    """An explicit id, or (-1) the id of `<|MASK|>` in the target's tokenizer.json."""
    if configured >= 0:
        return configured
    tokenizer_file = os.path.join(target_path, "tokenizer.json")
    if os.path.isfile(tokenizer_file):
        with open(tokenizer_file, encoding="utf-8") as f:
            added = json.load(f).get("added_tokens", [])
        for token in added:
            if token.get("content") == MASK_TOKEN:
                return int(token["id"])
    raise ConfigError(
        f"drafter.mask_token_id=-1 looks up {MASK_TOKEN} in {tokenizer_file}, which has no such "
        "token; set drafter.mask_token_id to an existing reserved token id"
    )
