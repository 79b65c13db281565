"""The training config: one schema (`base_config`), checked once (`resolve`).

`base_config()` lists every field with its default; a sentinel value (-1, 0, '') is explained
next to its field, and nowhere else. Config files (configs/*.py) override what differs.

`resolve(config, num_devices=...)` is the only code that reads a config: it checks every field,
reads the small files the run depends on (the target's config.json and tokenizer.json, the
existence of the data sources and eval prompts) and returns one frozen `TrainSetup` that the
rest of the run receives. Every mistake is a `ConfigError` naming its field, raised before
anything is created on disk or compiled.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from typing import Any

import ml_collections

from dflash_jax.data.chat import MASK_TOKEN
from dflash_jax.data.config import DataConfig
from dflash_jax.data.sources import resolve_sources
from dflash_jax.decoding.chat import resolve_prompt_set
from dflash_jax.errors import ConfigError, UserError
from dflash_jax.models.attention import IMPLEMENTATIONS as ATTENTION_IMPLEMENTATIONS
from dflash_jax.models.config import DTYPES, DrafterConfig, TransformerConfig
from dflash_jax.models.hf import read_config
from dflash_jax.training.mesh import mesh_shape
from dflash_jax.training.objective import ANCHOR_SCHEMES, PAPER_LOSS_DECAY_GAMMA, ObjectiveConfig
from dflash_jax.training.step import OptimizerConfig
from dflash_jax.training.workdir import Workdir


def base_config() -> ml_collections.ConfigDict:
    """Every field with the paper's recipe as default (docs/design.md §3.5)."""
    c = ml_collections.ConfigDict()
    c.workdir = ""  # checkpoints, logs and exports; rerunning with the same workdir resumes
    c.seed = 0  # drafter init and anchor sampling (the data order has data.seed)

    c.target = ml_collections.ConfigDict()
    c.target.path = ""  # Hugging Face model directory (config.json, safetensors, tokenizer)
    c.target.dtype = "bfloat16"  # weights and compute of the frozen target
    # A config.json for `python -m dflash_jax.plan` when target.path is empty (configs/targets/);
    # training always reads target.path's own.
    c.target.plan_config = ""

    c.drafter = ml_collections.ConfigDict()
    c.drafter.num_layers = 5
    c.drafter.block_size = 16
    c.drafter.target_layer_ids = ()  # () = docs/design.md §2 default spread
    c.drafter.mask_token_id = -1  # -1 = the id of <|MASK|> in the target tokenizer
    c.drafter.intermediate_size = 0  # 0 = the target's

    c.data = ml_collections.ConfigDict(dataclasses.asdict(DataConfig()))  # see data/config.py

    c.train = ml_collections.ConfigDict()
    c.train.num_epochs = 6
    c.train.max_steps = 0  # 0 = every step of num_epochs; > 0: stop (and end the LR schedule) there
    c.train.grad_accum_steps = 1
    c.train.num_anchors = 512  # blocks per row
    # docs/design.md §3.1: 'document' (response-token anchors, every document its share),
    # 'response' (response-token anchors, uniform over the row) or 'row' (the original scheme).
    c.train.anchor_scheme = "document"
    c.train.anchors_per_document = 0  # 'document': cap on one document's anchors; 0 = no cap
    c.train.loss_decay_gamma = 0.0  # 0 = the paper's value for the block size
    c.train.learning_rate = 6e-4
    c.train.warmup_fraction = 0.04
    c.train.b1 = 0.9
    c.train.b2 = 0.999
    c.train.weight_decay = 0.0
    c.train.grad_clip_norm = 1.0
    c.train.compute_dtype = "bfloat16"  # drafter compute; master weights are always fp32
    c.train.remat = False  # recompute each drafter layer in the backward pass
    # Attention code (models/attention.py): 'auto' = fused Pallas kernels on GPU, XLA elsewhere;
    # 'xla' (the reference) or 'fused' to force one.
    c.train.attention = "auto"
    c.train.attention_chunk_blocks = 32  # blocks per attention chunk (memory vs speed)
    c.train.lm_head_chunk_blocks = 32  # blocks per LM-head/cross-entropy chunk
    c.train.max_nonfinite_streak = 20  # stop after this many consecutive skipped updates

    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = -1  # -1 = every device fsdp x tensor leave over
    c.mesh.fsdp = 1  # > 1: the frozen target's weights split over this many devices
    c.mesh.tensor = 1  # > 1: the target's heads, kv heads and MLP split over this many devices

    c.checkpoint = ml_collections.ConfigDict()
    c.checkpoint.every_steps = 1000
    c.checkpoint.keep = 3
    c.checkpoint.async_save = True

    c.log = ml_collections.ConfigDict()
    c.log.every_steps = 10
    c.log.progress_bars = True
    c.log.tensorboard = True
    c.log.wandb = False  # needs `pip install wandb`
    c.log.wandb_project = "dflash_jax"

    c.eval = ml_collections.ConfigDict()
    c.eval.prompts = ""  # JSONL of chat prompts or a bundled set name; '' = no acceptance evaluation
    c.eval.every_steps = 1000  # 0 = only the closing evaluation
    c.eval.num_prompts = 32  # 0 = every prompt of the set
    c.eval.max_new_tokens = 128

    c.distributed = ml_collections.ConfigDict()
    # host:port of process 0; '' = $JAX_COORDINATOR_ADDRESS if set, else a single process.
    c.distributed.coordinator_address = ""
    c.distributed.num_processes = 0  # 0 = $JAX_NUM_PROCESSES or the cluster's
    c.distributed.process_id = -1  # -1 = $JAX_PROCESS_ID or the cluster's
    return c


def load_config_file(path: str, variants: str = "") -> ml_collections.ConfigDict:
    """What `--config=path:variants` gives train.py, for scripts, benchmarks and notebooks."""
    spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(variants) if variants else module.get_config()


@dataclasses.dataclass(frozen=True)
class RunSettings:
    num_epochs: int
    max_steps: int  # 0 = no cap
    grad_accum_steps: int
    max_nonfinite_streak: int
    seed: int
    attention: str = "auto"  # models.attention implementation: auto, xla or fused


@dataclasses.dataclass(frozen=True)
class CheckpointSettings:
    every_steps: int
    keep: int
    async_save: bool


@dataclasses.dataclass(frozen=True)
class LogSettings:
    every_steps: int
    progress_bars: bool
    tensorboard: bool
    wandb: bool
    wandb_project: str


@dataclasses.dataclass(frozen=True)
class EvalSettings:
    prompts: str  # a JSONL path; '' = no acceptance evaluation
    every_steps: int  # 0 = only the closing evaluation
    num_prompts: int  # 0 = all
    max_new_tokens: int

    @property
    def enabled(self) -> bool:
        return bool(self.prompts)

    @property
    def during_training(self) -> bool:
        return self.enabled and self.every_steps > 0


@dataclasses.dataclass(frozen=True)
class DistributedSettings:
    coordinator_address: str  # '' = $JAX_COORDINATOR_ADDRESS or a single process
    num_processes: int  # 0 = from the environment
    process_id: int  # -1 = from the environment


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
    d = config.distributed
    _require(
        d.num_processes >= 0, f"distributed.num_processes={d.num_processes} must be >= 0 (0 = from the environment)"
    )
    _require(d.process_id >= -1, f"distributed.process_id={d.process_id} must be >= -1 (-1 = from the environment)")
    return DistributedSettings(d.coordinator_address, d.num_processes, d.process_id)


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
    train, drafter_section = config.train, config.drafter
    if check_files:
        _require(bool(config.workdir), "workdir is empty: set --config.workdir=/path/to/run")
    if target is None:
        target = _target_config(config.target.path)
    target_dtype = _dtype(config.target.dtype, "target.dtype")
    compute_dtype = _dtype(train.compute_dtype, "train.compute_dtype")

    data = _data(config, check_files)

    block_size, seq_len = drafter_section.block_size, data.seq_len
    _require(drafter_section.num_layers >= 1, f"drafter.num_layers={drafter_section.num_layers} must be at least 1")
    _require(
        2 <= block_size < seq_len,
        f"drafter.block_size={block_size} must be at least 2 and below data.seq_len={seq_len}",
    )
    _require(
        drafter_section.intermediate_size >= 0,
        f"drafter.intermediate_size={drafter_section.intermediate_size} must be >= 0 (0 = the target's)",
    )
    layer_ids = tuple(drafter_section.target_layer_ids)
    bad = [i for i in layer_ids if not 0 <= i < target.num_layers]
    _require(
        not bad,
        f"drafter.target_layer_ids {list(layer_ids)}: {bad} out of range, the target has "
        f"{target.num_layers} layers (valid ids 0..{target.num_layers - 1})",
    )
    mask_token_id = _mask_token_id(drafter_section.mask_token_id, config.target.path)
    _require(
        0 <= mask_token_id < target.vocab_size,
        f"drafter.mask_token_id={mask_token_id} is outside the target vocabulary "
        f"(vocab_size={target.vocab_size}); use an existing reserved token such as {MASK_TOKEN}",
    )

    _require(
        1 <= train.num_anchors <= seq_len, f"train.num_anchors={train.num_anchors} must be in 1..data.seq_len={seq_len}"
    )
    _require(
        train.attention in ATTENTION_IMPLEMENTATIONS,
        f"train.attention={train.attention!r} is not one of {', '.join(ATTENTION_IMPLEMENTATIONS)}",
    )
    _require(
        train.anchor_scheme in ANCHOR_SCHEMES,
        f"train.anchor_scheme={train.anchor_scheme!r} is not one of {', '.join(ANCHOR_SCHEMES)}",
    )
    _require(
        train.anchors_per_document >= 0,
        f"train.anchors_per_document={train.anchors_per_document} must be >= 0 (0 = no cap)",
    )
    _require(
        train.loss_decay_gamma >= 0, f"train.loss_decay_gamma={train.loss_decay_gamma} must be >= 0 (0 = the paper's)"
    )
    _require(
        bool(train.loss_decay_gamma) or block_size in PAPER_LOSS_DECAY_GAMMA,
        f"drafter.block_size={block_size} has no paper loss decay gamma (known for "
        f"{sorted(PAPER_LOSS_DECAY_GAMMA)}); set train.loss_decay_gamma",
    )
    for name in (
        "num_epochs",
        "grad_accum_steps",
        "attention_chunk_blocks",
        "lm_head_chunk_blocks",
        "max_nonfinite_streak",
    ):
        _require(train[name] >= 1, f"train.{name}={train[name]} must be at least 1")
    _require(train.max_steps >= 0, f"train.max_steps={train.max_steps} must be >= 0 (0 = every step of num_epochs)")
    _require(train.learning_rate > 0, f"train.learning_rate={train.learning_rate} must be > 0")
    _require(0 <= train.warmup_fraction < 1, f"train.warmup_fraction={train.warmup_fraction} must be in [0, 1)")
    for name in ("b1", "b2"):
        _require(0 <= train[name] < 1, f"train.{name}={train[name]} must be in [0, 1)")
    _require(train.weight_decay >= 0, f"train.weight_decay={train.weight_decay} must be >= 0")
    _require(train.grad_clip_norm > 0, f"train.grad_clip_norm={train.grad_clip_norm} must be > 0")
    _require(config.seed >= 0, f"seed={config.seed} must be >= 0")

    try:
        shape = mesh_shape(config.mesh.data, config.mesh.fsdp, num_devices, config.mesh.tensor)
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
    rows, accum = data.global_batch_rows, train.grad_accum_steps
    row_groups = shape[0] * shape[1]  # batch rows are split over data x fsdp, not tensor
    _require(
        rows % (row_groups * accum) == 0,
        f"data.global_batch_rows={rows} must be divisible by mesh data x fsdp ({row_groups}) x "
        f"train.grad_accum_steps ({accum}) = {row_groups * accum}",
    )

    for field in ("checkpoint.every_steps", "checkpoint.keep", "log.every_steps", "eval.max_new_tokens"):
        section, name = field.split(".")
        _require(config[section][name] >= 1, f"{field}={config[section][name]} must be at least 1")
    for field in ("eval.every_steps", "eval.num_prompts"):
        section, name = field.split(".")
        _require(config[section][name] >= 0, f"{field}={config[section][name]} must be >= 0")
    eval_prompts = config.eval.prompts
    if eval_prompts and check_files:
        try:
            eval_prompts = resolve_prompt_set(eval_prompts)[1]
        except (FileNotFoundError, UserError):
            raise ConfigError(f"eval.prompts={eval_prompts!r} does not exist ('' turns evaluation off)") from None

    drafter = DrafterConfig.for_target(
        target,
        num_layers=drafter_section.num_layers,
        mask_token_id=mask_token_id,
        block_size=block_size,
        target_layer_ids=layer_ids or None,
        intermediate_size=drafter_section.intermediate_size or None,
    )
    return TrainSetup(
        workdir=Workdir.at(config.workdir) if config.workdir else None,
        target_path=config.target.path,
        target=target,
        target_dtype=target_dtype,
        compute_dtype=compute_dtype,
        drafter=drafter,
        objective=ObjectiveConfig(
            block_size=block_size,
            mask_token_id=mask_token_id,
            num_anchors=train.num_anchors,
            anchor_scheme=train.anchor_scheme,
            anchors_per_document=train.anchors_per_document,
            loss_decay_gamma=float(train.loss_decay_gamma or PAPER_LOSS_DECAY_GAMMA[block_size]),
            target_layer_ids=drafter.target_layer_ids,
            attention_chunk_blocks=train.attention_chunk_blocks,
            lm_head_chunk_blocks=train.lm_head_chunk_blocks,
            remat=train.remat,
        ),
        optimizer=OptimizerConfig(
            learning_rate=train.learning_rate,
            warmup_fraction=train.warmup_fraction,
            b1=train.b1,
            b2=train.b2,
            weight_decay=train.weight_decay,
            grad_clip_norm=train.grad_clip_norm,
        ),
        data=data,
        mesh_shape=shape,
        run=RunSettings(
            train.num_epochs, train.max_steps, accum, train.max_nonfinite_streak, config.seed, train.attention
        ),
        checkpoint=CheckpointSettings(**config.checkpoint.to_dict()),
        log=LogSettings(**config.log.to_dict()),
        eval=EvalSettings(eval_prompts, config.eval.every_steps, config.eval.num_prompts, config.eval.max_new_tokens),
        distributed=resolve_distributed(config),
        config_dict=json.loads(config.to_json_best_effort()),
    )


def resolve_data(config: ml_collections.ConfigDict) -> tuple[DataConfig, str]:
    """(data settings, target directory), checked with the data sources: what
    `python -m dflash_jax.prepare` needs (no devices, no model weights)."""
    try:
        _target_dir(config.target.path)
        return _data(config, check_files=True), config.target.path
    except ConfigError:
        raise
    except UserError as e:
        raise ConfigError(str(e)) from None


def _data(config: ml_collections.ConfigDict, check_files: bool) -> DataConfig:
    data = DataConfig(**config.data.to_dict())
    problems = data.problems()
    _require(not problems, "; ".join(problems))
    if check_files:
        _require(bool(data.train), "data.train is empty: set --config.data.train=/path/to/train.jsonl")
        try:
            resolve_sources(data.train)
        except UserError as e:
            raise ConfigError(f"data.train: {e}") from None
    return data


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def target_for_plan(config: ml_collections.ConfigDict, override: str = "") -> tuple[TransformerConfig, str]:
    """(target architecture, where it was read) for the memory plan, from a config.json alone:
    `override`, else `target.plan_config`, else `target.path`/config.json."""
    path = override or config.target.plan_config or config.target.path
    field = "--target_config" if override else "target.plan_config" if config.target.plan_config else "target.path"
    _require(
        bool(path),
        "no target to plan for: set --target_config=configs/targets/Qwen3-8B.json (or another config.json) "
        "or --config.target.path=/path/to/hf_model_dir",
    )
    config_file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    try:
        with open(config_file, encoding="utf-8") as f:
            return TransformerConfig.from_hf(json.load(f)), config_file
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"{field}={path!r}: {e}") from None


def _target_dir(path: str) -> None:
    _require(bool(path), "target.path is empty: set --config.target.path=/path/to/hf_model_dir")
    _require(os.path.isdir(path), f"target.path={path!r} does not exist or is not a directory")


def _target_config(path: str) -> TransformerConfig:
    _target_dir(path)
    try:
        return TransformerConfig.from_hf(read_config(path))
    except (FileNotFoundError, ValueError, KeyError) as e:
        raise ConfigError(f"target.path={path!r}: {e}") from None


def _dtype(name: str, field: str):
    _require(name in DTYPES, f"{field}={name!r} is not one of {', '.join(sorted(DTYPES))}")
    return DTYPES[name]


def _mask_token_id(configured: int, target_path: str) -> int:
    """An explicit id, or (-1) the id of `<|MASK|>` in the target's tokenizer.json."""
    if configured >= 0:
        return configured
    _require(configured == -1, f"drafter.mask_token_id={configured} must be >= 0, or -1 to look up {MASK_TOKEN}")
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
