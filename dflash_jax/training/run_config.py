"""The training config: one schema (`base_config`), checked once (`resolve`).

`base_config()` is generated from the section dataclasses of training/sections.py (the train
section extends training/objective.py's `ObjectiveSettings` and training/optimizer.py's
`OptimizerConfig`; `data` is data/settings.py's `DataConfig`): each field's default and meaning are
written there, once. Config files (configs/*.py) override what differs.

`resolve(config, num_devices=...)` is the only code that reads a config: every section checks
itself, then resolve checks what spans sections, reads the small files the run depends on (the
target's config.json and tokenizer.json, the existence of the data sources and eval prompts)
and returns one frozen `TrainSetup` that the rest of the run receives. Every mistake, a field
that does not exist or has the wrong type included, is a `ConfigError` naming its field, raised
before anything is created on disk or compiled.
"""

from __future__ import annotations

import contextvars
import dataclasses
import difflib
import importlib.util
import inspect
import json
import numbers
import os
import types
import typing
from typing import Any

import ml_collections

from dflash_jax.data.settings import DataConfig
from dflash_jax.data.sources import resolve_sources
from dflash_jax.decoding.prompt_sets import HeldoutPrompts, resolve_prompt_set
from dflash_jax.errors import ConfigError, ModelError, UserError
from dflash_jax.models import families, kinds
from dflash_jax.models.architecture import DTYPES, TransformerConfig
from dflash_jax.models.drafter_config import MASK_TOKEN, DrafterConfig, DrafterHeads
from dflash_jax.models.gguf import gguf_source
from dflash_jax.models.hf import read_config
from dflash_jax.models.hub import resolve_model
from dflash_jax.training.mesh import mesh_shape
from dflash_jax.training.objective import PAPER_LOSS_DECAY_GAMMA, ObjectiveConfig, ObjectiveSettings
from dflash_jax.training.optimizer import OptimizerConfig
from dflash_jax.training.sections import (
    SECTIONS,
    CheckpointSettings,
    DistributedSettings,
    DrafterSettings,
    EvalSettings,
    LogSettings,
    MeshSettings,
    TopLevelSettings,
    TrainSettings,
    field_path,
)
from dflash_jax.training.workdir import Workdir

# Where a user finds every field, its default and its meaning (messages, --help).
FIELDS_DOCUMENTED = (
    "every field, its default and its meaning are documented in the section dataclasses of "
    "dflash_jax/training/sections.py (train: also ObjectiveSettings in dflash_jax/training/objective.py "
    "and OptimizerConfig in dflash_jax/training/optimizer.py; drafter: also DrafterHeads in "
    "dflash_jax/models/drafter_config.py and each kind's sizes in dflash_jax/models/kinds/; data: DataConfig in dflash_jax/data/settings.py)"
)


def base_config() -> ml_collections.ConfigDict:
    """Every field with its default, generated from the section dataclasses (training/sections.py,
    data/settings.py for `data`), where each field is documented."""
    config = _config_dict(TopLevelSettings())
    for name, section in SECTIONS.items():
        config[name] = _config_dict(section())
    return config


def _config_dict(settings) -> ml_collections.ConfigDict:
    # Not type-safe: a value of the wrong type is reported by resolve, naming section.field.
    return ml_collections.ConfigDict(dataclasses.asdict(settings), type_safe=False)


# The drafter block sizes a preset for a hub-sized target offers as variants (z-lab's drafters use 16 and 10).
HUB_BLOCK_SIZES = {"b16": 16, "b10": 10, "b8": 8}


def hub_target_config(plan_config: str, *, block_size: int, mask_token_id: int | None = None, drafter_layers: int = 5):
    """The paper's recipe for a hub-sized target on one 8-accelerator host, which every preset in
    configs/ starts from: 3,072-token rows, 16 a step, remat, τ on held-out training prompts
    (eval.prompts ''), a 5-layer drafter; the preset adds its drafter shape and mesh."""
    c = base_config()  # 6 epochs, 4% warmup, cosine, clip 1.0, 512 anchors
    c.target.plan_config = plan_config
    c.drafter.num_layers = drafter_layers
    c.drafter.block_size = block_size
    if mask_token_id is not None:
        c.drafter.mask_token_id = mask_token_id
    c.data.seq_len = 3072
    c.data.global_batch_rows = 16
    c.data.read_threads = 4
    c.data.heldout_rows = c.eval.num_prompts
    c.train.remat = True
    c.log.every_steps = 20
    return c


@dataclasses.dataclass(frozen=True)
class Variants:
    """What a config file's `file.py:variants` accepts: one size (else `default_size`), at most
    one block size, and flags."""

    sizes: tuple[str, ...]
    blocks: tuple[str, ...]
    flags: tuple[str, ...]
    default_size: str

    def names(self) -> tuple[str, ...]:
        return (*self.sizes, *self.blocks, *self.flags)


# While config_variants runs a config file, the Variants its choose_variants call was given.
_ASKED: contextvars.ContextVar[list[Variants] | None] = contextvars.ContextVar("asked", default=None)


def choose_variants(variants: str, *, sizes, blocks, flags=(), default_size: str) -> tuple[str, str | None, set]:
    """A config file's `file.py:variants` string -> (size, block or None, flags set), each at most
    once (big_vision style: `8b,b10,fsdp`); anything unknown is a one-line ConfigError."""
    if (asked := _ASKED.get()) is not None:
        asked.append(Variants(tuple(sizes), tuple(blocks), tuple(flags), default_size))
    chosen = [v for v in variants.split(",") if v]
    unknown = [v for v in chosen if v not in sizes and v not in blocks and v not in flags]
    if unknown:
        raise ConfigError(
            f"unknown config variant(s) {unknown}: use a size {sorted(sizes)}, a block size "
            f"{sorted(blocks)}" + (f" and/or {' / '.join(flags)}" if flags else "")
        )
    picked_sizes = [v for v in chosen if v in sizes] or [default_size]
    picked_blocks = [v for v in chosen if v in blocks]
    if len(picked_sizes) > 1 or len(picked_blocks) > 1:
        raise ConfigError(f"config variants {chosen}: give one size and one block size at most")
    return picked_sizes[0], (picked_blocks[0] if picked_blocks else None), {v for v in chosen if v in flags}


def load_config_file(path: str, variants: str = "") -> ml_collections.ConfigDict:
    """What `--config=path:variants` gives train.py, for scripts, benchmarks and notebooks."""
    module = load_config_module(path)
    return module.get_config(variants) if variants else module.get_config()


def load_config_module(path: str) -> types.ModuleType:
    """A config file as a module: its docstring and `get_config`."""
    spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def takes_variants(module: types.ModuleType) -> bool:
    return bool(inspect.signature(module.get_config).parameters)


def config_variants(module: types.ModuleType) -> Variants | None:
    """The variants a config module accepts: what its get_config() passes to choose_variants;
    None when it takes no variants or chooses them otherwise."""
    if not takes_variants(module):
        return None
    asked = []
    token = _ASKED.set(asked)
    try:
        module.get_config()
    finally:
        _ASKED.reset(token)
    return asked[0] if asked else None


def check_variants_accepted(path: str, variants: str, shown_as: str) -> None:
    """A ConfigError when `variants` are given to a config file whose get_config takes none
    (ml_collections would end in a TypeError's traceback)."""
    if variants and not takes_variants(load_config_module(path)):
        raise ConfigError(f"--config={shown_as}:{variants}: {shown_as} has no variants; use --config={shown_as}")


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
    config_dict: dict  # the config as the user wrote it, for checkpoints and experiment trackers


def resolve_distributed(config: ml_collections.ConfigDict) -> DistributedSettings:
    """The distributed section alone: train.py needs it before JAX can count devices."""
    check_field_names(config)
    return _section(config, "distributed")


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
    """Each section checks itself (training/sections.py); then, in order, what spans sections or
    reads files."""
    check_field_names(config)
    top, target_section, drafter_section = _section(config, ""), _section(config, "target"), _section(config, "drafter")
    train = _section(config, "train")
    if check_files:
        _require(bool(top.workdir), "workdir is empty: set --config.workdir=/path/to/run")
    target_path, target = _target(target_section.path, target, check_files)
    data = _data(config, check_files)
    _check_blocks(drafter_section, train, target, data.seq_len)
    mask_token_id = _mask_token(drafter_section.mask_token_id, target, target_path, check_files)
    drafter = _drafter(drafter_section, target, mask_token_id)
    _check_drafter_kind(drafter, train)
    shape = _mesh(_section(config, "mesh"), num_devices, target, data.global_batch_rows, train.grad_accum_steps)
    evaluation = _evaluation(_section(config, "eval"), drafter.kind, data, target_path, check_files)
    return TrainSetup(
        workdir=Workdir.at(top.workdir) if top.workdir else None,
        target_path=target_path,
        target=target,
        target_dtype=DTYPES[target_section.dtype],
        compute_dtype=DTYPES[train.compute_dtype],
        drafter=drafter,
        objective=_objective(train, drafter),
        optimizer=OptimizerConfig(**_fields_of(train, OptimizerConfig)),
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
        checkpoint=_section(config, "checkpoint"),
        log=_section(config, "log"),
        eval=evaluation,
        distributed=_section(config, "distributed"),
        config_dict=json.loads(config.to_json_best_effort()),
    )


def _target(path: str, target: TransformerConfig | None, check_files: bool) -> tuple[str, TransformerConfig]:
    """(target directory, target architecture): read from target.path unless given."""
    target_path = _target_path(path) if check_files or target is None else path
    return target_path, target or _target_config(target_path)


def _check_blocks(drafter: DrafterSettings, train: TrainSettings, target: TransformerConfig, seq_len: int) -> None:
    """Blocks fit the rows, and the target layer a warm start copies exists."""
    _require(
        drafter.block_size < seq_len, f"drafter.block_size={drafter.block_size} must be below data.seq_len={seq_len}"
    )
    _require(
        train.init_from_target_layer < target.num_layers,
        f"train.init_from_target_layer={train.init_from_target_layer} is out of range, the target has "
        f"{target.num_layers} layers (valid 0..{target.num_layers - 1}, or -1 for random init)",
    )
    _require(
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
    _require(
        bool(train.loss_decay_gamma or kind.loss_decay_gamma) or drafter.block_size in PAPER_LOSS_DECAY_GAMMA,
        f"drafter.block_size={drafter.block_size} has no paper loss decay gamma (known for "
        f"{sorted(PAPER_LOSS_DECAY_GAMMA)}); set train.loss_decay_gamma",
    )
    _require(
        not kind.losses or train.loss in kind.losses,
        f"train.loss={train.loss!r} does not apply to drafter.kind={kind.name!r}: use train.loss="
        + " or ".join(map(repr, kind.losses)),
    )
    _require(
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
        _require(
            size % tensor == 0,
            f"mesh.tensor={tensor} must divide the target's {name}={size} (heads and MLP are split over it)",
        )
    row_groups = shape[0] * shape[1]  # batch rows are split over data x fsdp, not tensor
    _require(
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


def _drafter(drafter: DrafterSettings, target: TransformerConfig, mask_token_id: int) -> DrafterConfig:
    """The drafter the section describes, checked by DrafterConfig (its messages name the field)."""
    own = kinds.KINDS.get(drafter.kind)
    heads = {  # the kind, the block size and the kind's own sizes
        name: value
        for name, value in _fields_of(drafter, DrafterHeads).items()
        if name not in kinds.SIZE_FIELDS or (own and name in own.fields)
    }
    try:
        return DrafterConfig.for_target(
            target,
            num_layers=drafter.num_layers,
            mask_token_id=mask_token_id,
            target_layer_ids=drafter.target_layer_ids or None,
            intermediate_size=drafter.intermediate_size or None,
            num_heads=drafter.num_heads or None,
            num_kv_heads=drafter.num_kv_heads or None,
            head_dim=drafter.head_dim or None,
            num_context_layers=drafter.num_context_layers or None,
            layer_types=drafter.layer_types,
            sliding_window=drafter.sliding_window,
            **heads,
        )
    except ModelError as e:
        raise ConfigError(f"drafter.{e}") from None


def _objective(train: TrainSettings, drafter: DrafterConfig) -> ObjectiveConfig:
    """The train section's objective fields, with γ resolved for the drafter's block size and kind."""
    default_gamma = drafter.kind_spec.loss_decay_gamma or PAPER_LOSS_DECAY_GAMMA.get(drafter.block_size)
    return ObjectiveConfig(
        **{**_fields_of(train, ObjectiveSettings), "loss_decay_gamma": float(train.loss_decay_gamma or default_gamma)},
        block_size=drafter.block_size,
        mask_token_id=drafter.mask_token_id,
        target_layer_ids=drafter.target_layer_ids,
        kind=drafter.kind,
    )


def _fields_of(settings, cls) -> dict[str, Any]:
    """The fields of `cls` (a dataclass `settings` extends) as `settings` holds them."""
    return {f.name: getattr(settings, f.name) for f in dataclasses.fields(cls)}


def resolve_data(config: ml_collections.ConfigDict) -> tuple[DataConfig, str]:
    """(data settings, target directory), checked with the data sources: what
    `python -m dflash_jax.prepare` needs (no devices, no model weights)."""
    try:
        check_field_names(config)
        target_path = _target_path(_section(config, "target").path)
        return _data(config, check_files=True), target_path
    except ConfigError:
        raise
    except UserError as e:
        raise ConfigError(str(e)) from None


def _data(config: ml_collections.ConfigDict, check_files: bool) -> DataConfig:
    data = _section(config, "data")
    if check_files:
        _require(bool(data.train), "data.train is empty: set --config.data.train=/path/to/train.jsonl")
        try:
            resolve_sources(data.train)
        except UserError as e:
            raise ConfigError(f"data.train: {e}") from None
    return data


def field_paths() -> list[str]:
    """Every field of the config as overrides name it: `workdir`, `train.learning_rate`, ..."""
    top = [f.name for f in dataclasses.fields(TopLevelSettings)]
    return top + [field_path(name, f.name) for name, cls in SECTIONS.items() for f in dataclasses.fields(cls)]


def check_field_path(path: str) -> None:
    """Raises ConfigError, naming the closest real field, when `path` is not a field."""
    paths = field_paths()
    if path in paths:
        return
    closest = difflib.get_close_matches(path, paths, n=1)
    raise ConfigError(f"no field {path}; " + (f"did you mean {closest[0]}?" if closest else FIELDS_DOCUMENTED))


def check_field_names(config: ml_collections.ConfigDict) -> None:
    """Every field `config` sets exists: a mistyped name would otherwise be a silent no-op."""
    for key in config.keys():
        value = config[key]
        if key in SECTIONS and isinstance(value, (ml_collections.ConfigDict, dict)):
            for name in value.keys():
                check_field_path(field_path(key, name))
        else:
            check_field_path(key)


def _section(config: ml_collections.ConfigDict, name: str):
    """Section `name` ('' = the top-level fields) of `config` as its dataclass, checked: a value
    of the wrong type or one of the section's problems is a ConfigError. Fields the config does
    not set keep their dataclass defaults."""
    cls = SECTIONS[name] if name else TopLevelSettings
    values = config if not name else config[name] if name in config else {}
    types = typing.get_type_hints(cls)
    settings = cls(
        **{
            f.name: _typed(field_path(name, f.name), values[f.name], types[f.name])
            for f in dataclasses.fields(cls)
            if f.name in values
        }
    )
    problems = settings.problems()
    _require(not problems, "; ".join(problems))
    return settings


# What a message calls each type a field can have, and the values it accepts (numpy scalars
# included; an int is a number), converted to it.
_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "True or False"}
_ACCEPTED = {str: str, int: numbers.Integral, float: numbers.Real, bool: bool}


def _typed(path: str, value, kind):
    """`value` as a field of type `kind` (a list is a tuple), else a ConfigError."""
    if typing.get_origin(kind) is tuple:
        item = typing.get_args(kind)[0]  # tuple[item, ...]
        if isinstance(value, (tuple, list)) and all(_accepts(item, v) for v in value):
            return tuple(item(v) for v in value)
        raise ConfigError(f"{path}={value!r} must be a tuple of {_TYPE_NAMES[item].split()[-1]}s")
    _require(_accepts(kind, value), f"{path}={value!r} must be {_TYPE_NAMES[kind]}")
    return kind(value)


def _accepts(kind, value) -> bool:
    # A bool is an int to Python, not to a config.
    return isinstance(value, _ACCEPTED[kind]) and (kind is bool or not isinstance(value, bool))


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def target_for_plan(config: ml_collections.ConfigDict, override: str = "") -> tuple[TransformerConfig, str]:
    """(target architecture, where it was read) for the memory plan, from a config.json alone:
    `override`, else `target.plan_config`, else `target.path`/config.json."""
    target = _section(config, "target")
    path = override or target.plan_config or target.path
    field = "--target_config" if override else "target.plan_config" if target.plan_config else "target.path"
    _require(
        bool(path),
        "no target to plan for: set --target_config=configs/targets/Qwen3-8B.json (or another config.json) "
        "or --config.target.path=/path/to/hf_model_dir",
    )
    if not os.path.exists(path) or gguf_source(path):
        try:
            path = str(resolve_model(path, files=("config.json",)))
        except UserError as e:
            raise ConfigError(f"{field}: {e}") from None
    config_file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    try:
        with open(config_file, encoding="utf-8") as f:
            return families.target_config(json.load(f)), config_file
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"{field}={path!r}: {e}") from None


def _target_path(spec: str) -> str:
    """target.path as a local directory: a directory, or a hub id `org/name[@revision]` resolved
    through the Hugging Face cache."""
    _require(bool(spec), "target.path is empty: set --config.target.path=/path/to/hf_model_dir or org/name")
    try:
        return str(resolve_model(spec))
    except UserError as e:
        raise ConfigError(f"target.path={e}") from None


def _target_config(path: str) -> TransformerConfig:
    try:
        return families.target_config(read_config(path))
    except (FileNotFoundError, ValueError, KeyError) as e:
        raise ConfigError(f"target.path={path!r}: {e}") from None


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
