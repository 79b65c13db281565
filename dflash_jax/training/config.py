"""The training config: its sections, its checks, and what it resolves to.

`resolve(config)` reads only small files (the target's config.json and tokenizer.json) and
raises `ConfigError` with one message naming the offending field for every mistake that
would otherwise surface late (inside compilation, or hours into a run).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os

import ml_collections

from dflash_jax.data.config import default_data_config
from dflash_jax.data.sources import resolve_sources
from dflash_jax.models.config import DTYPES, DrafterConfig, TransformerConfig
from dflash_jax.models.hf import read_config
from dflash_jax.training.mesh import mesh_shape
from dflash_jax.training.objective import (
    PAPER_LOSS_DECAY_GAMMA,
    ObjectiveConfig,
    loss_decay_gamma,
)
from dflash_jax.training.step import OptimizerConfig

MASK_TOKEN = "<|MASK|>"


class ConfigError(ValueError):
    """A mistake in the config, found before anything is compiled."""


@dataclasses.dataclass(frozen=True)
class TrainSetup:
    """Everything the run needs that the config determines."""

    target: TransformerConfig
    drafter: DrafterConfig
    objective: ObjectiveConfig
    optimizer: OptimizerConfig
    mesh_shape: tuple[int, int]
    target_dtype: object
    compute_dtype: object


def base_config() -> ml_collections.ConfigDict:
    """Every field with the paper's recipe as default; config files override what differs."""
    c = ml_collections.ConfigDict()
    c.workdir = ""  # checkpoints, logs and exports; rerunning with the same workdir resumes
    c.seed = 0  # drafter init and anchor sampling (the data order has data.seed)

    c.target = ml_collections.ConfigDict()
    c.target.path = ""  # Hugging Face model directory (config.json, safetensors, tokenizer)
    c.target.dtype = "bfloat16"  # weights and compute of the frozen target

    c.drafter = ml_collections.ConfigDict()
    c.drafter.num_layers = 5
    c.drafter.block_size = 16
    c.drafter.target_layer_ids = ()  # () = DESIGN §2 default spread
    c.drafter.mask_token_id = -1  # -1 = the id of <|MASK|> in the target tokenizer
    c.drafter.intermediate_size = 0  # 0 = the target's

    c.data = default_data_config()

    c.train = ml_collections.ConfigDict()
    c.train.num_epochs = 6
    c.train.max_steps = 0  # > 0: stop (and end the LR schedule) after this many steps
    c.train.grad_accum_steps = 1
    c.train.num_anchors = 512  # per row
    c.train.loss_decay_gamma = 0.0  # 0 = the paper's value for the block size
    c.train.learning_rate = 6e-4
    c.train.warmup_fraction = 0.04
    c.train.b1 = 0.9
    c.train.b2 = 0.999
    c.train.weight_decay = 0.0
    c.train.grad_clip_norm = 1.0
    c.train.compute_dtype = "bfloat16"  # drafter compute; master weights are always fp32
    c.train.remat = False  # recompute each drafter layer in the backward pass
    c.train.attention_chunk_blocks = 32  # blocks per attention chunk (memory vs speed)
    c.train.lm_head_chunk_blocks = 32  # blocks per LM-head/cross-entropy chunk
    c.train.max_nonfinite_streak = 20  # stop after this many consecutive skipped updates

    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = -1  # -1 = every device fsdp leaves over
    c.mesh.fsdp = 1

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
    c.eval.prompts = ""  # JSONL of chat prompts; '' = no acceptance evaluation
    c.eval.every_steps = 1000
    c.eval.num_prompts = 32
    c.eval.max_new_tokens = 128

    c.distributed = ml_collections.ConfigDict()
    # host:port of process 0; '' = $JAX_COORDINATOR_ADDRESS if set, else a single process.
    c.distributed.coordinator_address = ""
    c.distributed.num_processes = 0  # 0 = $JAX_NUM_PROCESSES or the cluster's
    c.distributed.process_id = -1  # -1 = $JAX_PROCESS_ID or the cluster's
    return c


PAPER_BLOCK_SIZES = {"b16": 16, "b10": 10, "b8": 8}


def apply_variants(c: ml_collections.ConfigDict, variants: str) -> ml_collections.ConfigDict:
    """Config-file variants (`file.py:b10,fsdp`): a paper block size, or FSDP over 4 devices."""
    for variant in filter(None, variants.split(",")):
        if variant in PAPER_BLOCK_SIZES:
            c.drafter.block_size = PAPER_BLOCK_SIZES[variant]
        elif variant == "fsdp":
            c.mesh.fsdp = 4
        else:
            raise ConfigError(f"unknown config variant {variant!r}: use {sorted(PAPER_BLOCK_SIZES)} or 'fsdp'")
    return c


def load_config_file(path: str, variants: str = "") -> ml_collections.ConfigDict:
    """What `--config=path:variants` gives train.py, for scripts, benchmarks and notebooks."""
    spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(variants) if variants else module.get_config()


def resolve(config: ml_collections.ConfigDict, *, num_devices: int) -> TrainSetup:
    """Checks the config against the target checkpoint, the data and the devices."""
    if not config.workdir:
        raise ConfigError("workdir is empty: set --config.workdir=/path/to/run")
    target = _target_config(config.target.path)
    _check_data(config.data)
    if config.eval.prompts and not os.path.isfile(config.eval.prompts):
        raise ConfigError(f"eval.prompts={config.eval.prompts!r} does not exist ('' turns evaluation off)")
    mask_token_id = _mask_token_id(config.drafter.mask_token_id, config.target.path)
    return setup_for_target(config, target, mask_token_id=mask_token_id, num_devices=num_devices)


def setup_for_target(
    config: ml_collections.ConfigDict, target: TransformerConfig, *, mask_token_id: int, num_devices: int
) -> TrainSetup:
    """The model, objective, optimizer and mesh settings for a given target architecture."""
    train, drafter_section = config.train, config.drafter
    target_dtype = _dtype(config.target.dtype, "target.dtype")
    compute_dtype = _dtype(train.compute_dtype, "train.compute_dtype")

    layer_ids = tuple(drafter_section.target_layer_ids) or None
    bad = [i for i in layer_ids or () if not 0 <= i < target.num_layers]
    if bad:
        raise ConfigError(
            f"drafter.target_layer_ids {list(layer_ids)}: {bad} out of range, the target has "
            f"{target.num_layers} layers (valid ids 0..{target.num_layers - 1})"
        )
    if not 0 <= mask_token_id < target.vocab_size:
        raise ConfigError(
            f"drafter.mask_token_id={mask_token_id} is outside the target vocabulary "
            f"(vocab_size={target.vocab_size}); use an existing reserved token such as {MASK_TOKEN}"
        )
    block_size, seq_len = drafter_section.block_size, config.data.seq_len
    if not 2 <= block_size < seq_len:
        raise ConfigError(
            f"drafter.block_size={block_size} must be at least 2 and below data.seq_len={seq_len}"
        )
    if not 1 <= train.num_anchors <= seq_len:
        raise ConfigError(f"train.num_anchors={train.num_anchors} must be in 1..data.seq_len={seq_len}")
    if not train.loss_decay_gamma and block_size not in PAPER_LOSS_DECAY_GAMMA:
        raise ConfigError(
            f"drafter.block_size={block_size} has no paper loss decay gamma (known for "
            f"{sorted(PAPER_LOSS_DECAY_GAMMA)}); set train.loss_decay_gamma"
        )
    for field in ("log.every_steps", "checkpoint.every_steps", "checkpoint.keep", "train.num_epochs"):
        section, name = field.split(".")
        if config[section][name] < 1:
            raise ConfigError(f"{field}={config[section][name]} must be at least 1")
    try:
        shape = mesh_shape(config.mesh.data, config.mesh.fsdp, num_devices)
    except ValueError as e:
        raise ConfigError(f"mesh: {e}") from None
    rows, accum = config.data.global_batch_rows, train.grad_accum_steps
    if accum < 1 or rows % (num_devices * accum):
        raise ConfigError(
            f"data.global_batch_rows={rows} must be divisible by devices ({num_devices}) x "
            f"train.grad_accum_steps ({accum}) = {num_devices * accum}"
        )
    drafter = DrafterConfig.for_target(
        target, num_layers=drafter_section.num_layers, mask_token_id=mask_token_id,
        block_size=block_size, target_layer_ids=layer_ids,
        intermediate_size=drafter_section.intermediate_size or None,
    )
    return TrainSetup(
        target=target,
        drafter=drafter,
        objective=ObjectiveConfig(
            block_size=block_size, mask_token_id=mask_token_id, num_anchors=train.num_anchors,
            loss_decay_gamma=loss_decay_gamma(block_size, train.loss_decay_gamma),
            target_layer_ids=drafter.target_layer_ids,
            attention_chunk_blocks=train.attention_chunk_blocks,
            lm_head_chunk_blocks=train.lm_head_chunk_blocks,
            remat=train.remat,
        ),
        optimizer=OptimizerConfig(
            learning_rate=train.learning_rate, warmup_fraction=train.warmup_fraction,
            b1=train.b1, b2=train.b2, weight_decay=train.weight_decay,
            grad_clip_norm=train.grad_clip_norm,
        ),
        mesh_shape=shape,
        target_dtype=target_dtype,
        compute_dtype=compute_dtype,
    )


def _target_config(path: str) -> TransformerConfig:
    if not path:
        raise ConfigError("target.path is empty: set --config.target.path=/path/to/hf_model_dir")
    if not os.path.isdir(path):
        raise ConfigError(f"target.path={path!r} does not exist or is not a directory")
    try:
        return TransformerConfig.from_hf(read_config(path))
    except (FileNotFoundError, ValueError, KeyError) as e:
        raise ConfigError(f"target.path={path!r}: {e}") from None


def _check_data(data: ml_collections.ConfigDict) -> None:
    if not data.train:
        raise ConfigError("data.train is empty: set --config.data.train=/path/to/train.jsonl")
    try:
        resolve_sources(data.train)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"data.train: {e}") from None


def _dtype(name: str, field: str):
    if name not in DTYPES:
        raise ConfigError(f"{field}={name!r} is not one of {sorted(DTYPES)}")
    return DTYPES[name]


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
