"""Where a run's target comes from: `target.path` as a local directory (a directory, or a hub id
resolved through the Hugging Face cache), its architecture read from its config.json, and the
memory plan's target, read from a config.json alone (`target_for_plan`).
"""

from __future__ import annotations

import json
import os

import ml_collections

from dflash_jax.errors import ConfigError, UserError
from dflash_jax.models import families
from dflash_jax.models.architecture import TransformerConfig
from dflash_jax.models.formats.gguf import gguf_source
from dflash_jax.models.formats.hf import read_config
from dflash_jax.models.formats.hub import resolve_model
from dflash_jax.training.config.schema import require, section


def target_for_plan(config: ml_collections.ConfigDict, override: str = "") -> tuple[TransformerConfig, str]:
    """(target architecture, where it was read) for the memory plan, from a config.json alone:
    `override`, else `target.plan_config`, else `target.path`/config.json."""
    target = section(config, "target")
    path = override or target.plan_config or target.path
    field = "--target_config" if override else "target.plan_config" if target.plan_config else "target.path"
    require(
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


def target_directory(spec: str) -> str:
    """target.path as a local directory: a directory, or a hub id `org/name[@revision]` resolved
    through the Hugging Face cache."""
    require(bool(spec), "target.path is empty: set --config.target.path=/path/to/hf_model_dir or org/name")
    try:
        return str(resolve_model(spec))
    except UserError as e:
        raise ConfigError(f"target.path={e}") from None


def target_architecture(path: str) -> TransformerConfig:
    try:
        return families.target_config(read_config(path))
    except (FileNotFoundError, ValueError, KeyError) as e:
        raise ConfigError(f"target.path={path!r}: {e}") from None
