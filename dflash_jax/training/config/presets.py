"""What config files (configs/*.py) are made of: the recipe every preset for a hub-sized target
starts from (`hub_target_config`), the variants a file accepts (`Variants`, declared once as its
module-level `VARIANTS`, which its get_config and list-configs both read), and how a file is
loaded as train.py loads it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import os
import types
from collections.abc import Mapping

import ml_collections

from dflash_jax.errors import ConfigError
from dflash_jax.training.config.schema import base_config

# The drafter block sizes a preset for a hub-sized target offers as variants (z-lab's drafters use 16 and 10).
HUB_BLOCK_SIZES = {"b16": 16, "b10": 10, "b8": 8}


def hub_target_config(plan_config: str, *, block_size: int, mask_token_id: int | None = None):
    """The paper's recipe for a hub-sized target on one 8-accelerator host, which every preset in
    configs/ starts from: 3,072-token rows, 16 a step, remat, τ on held-out training prompts
    (eval.prompts ''), the drafter section's 5 layers; the preset adds its drafter shape and mesh."""
    c = base_config()  # 6 epochs, 4% warmup, cosine, clip 1.0, 512 anchors
    c.target.plan_config = plan_config
    c.drafter.block_size = block_size
    if mask_token_id is not None:
        c.drafter.mask_token_id = mask_token_id
    c.data.seq_len = 3072
    c.data.global_batch_rows = 16
    c.data.read_threads = 4
    c.data.heldout_rows = c.eval.num_prompts
    c.train.remat = True
    # The paper's position decay for every kind: D-PACE's lead is measured on small targets only.
    c.train.loss = "dflash"
    c.log.every_steps = 20
    return c


@dataclasses.dataclass(frozen=True)
class Variants:
    """What a config file's `file.py:variants` accepts (big_vision style: `8b,b10,fsdp`): one size
    (else `default_size`), one block size (else `default_block`; None: the file's per-size choice)
    and flags, each at most once."""

    sizes: tuple[str, ...]
    default_size: str
    flags: tuple[str, ...] = ()
    default_block: str | None = "b16"
    blocks: Mapping[str, int] = dataclasses.field(default_factory=lambda: dict(HUB_BLOCK_SIZES))

    def names(self) -> tuple[str, ...]:
        return (*self.sizes, *self.blocks, *self.flags)

    def choose(self, variants: str) -> tuple[str, int | None, set[str]]:
        """A variants string -> (size, block size or None, flags); anything unknown or given
        twice is a one-line ConfigError."""
        chosen = [v for v in variants.split(",") if v]
        unknown = [v for v in chosen if v not in self.names()]
        if unknown:
            raise ConfigError(
                f"unknown config variant(s) {unknown}: use a size {sorted(self.sizes)}, a block size "
                f"{sorted(self.blocks)}" + (f" and/or {' / '.join(self.flags)}" if self.flags else "")
            )
        sizes = [v for v in chosen if v in self.sizes] or [self.default_size]
        blocks = [v for v in chosen if v in self.blocks] or [self.default_block]
        if len(sizes) > 1 or len(blocks) > 1:
            raise ConfigError(f"config variants {chosen}: give one size and one block size at most")
        block_size = self.blocks[blocks[0]] if blocks[0] else None
        return sizes[0], block_size, {v for v in chosen if v in self.flags}


def load_config_file(path: str, variants: str = "") -> ml_collections.ConfigDict:
    """What `--config=path:variants` gives train.py, for scripts, benchmarks and notebooks."""
    module = load_config_module(path)
    return module.get_config(variants) if variants else module.get_config()


def load_config_module(path: str) -> types.ModuleType:
    """A config file as a module: its docstring, `get_config` and `VARIANTS`."""
    spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def takes_variants(module: types.ModuleType) -> bool:
    return bool(inspect.signature(module.get_config).parameters)


def config_variants(module: types.ModuleType) -> Variants | None:
    """The variants a config module declares (`VARIANTS`); None when it declares none."""
    return getattr(module, "VARIANTS", None)


def check_variants_accepted(path: str, variants: str, shown_as: str) -> None:
    """A ConfigError when `variants` are given to a config file whose get_config takes none
    (ml_collections would end in a TypeError's traceback)."""
    if variants and not takes_variants(load_config_module(path)):
        raise ConfigError(f"--config={shown_as}:{variants}: {shown_as} has no variants; use --config={shown_as}")
