"""The sections of the training config. Every field, its default and its meaning are written once:
here, or in the dataclass the part of the run that reads it receives: the drafter section is
models/drafter_config.py's `DrafterConfig` (its kinds' sizes in models/kinds/), the data section
data/settings.py's `DataConfig`, and the train section extends training/objective.py's
ObjectiveSettings and training/optim/optimizer.py's OptimizerConfig.

Each section is a frozen dataclass whose defaults are the paper's recipe (docs/design.md §3.5);
a sentinel value (-1, 0, '') is explained next to its field, and nowhere else. `problems()`
checks what a section can check alone, one message per field named `section.field`; checks
that span sections or read files are `training.config.run_config.resolve`'s.
`training.config.schema.base_config` is generated from `TopLevelSettings` and `SECTIONS`.
"""

from __future__ import annotations

import dataclasses

from dflash_jax.data.settings import DataConfig
from dflash_jax.field_checks import at_least, one_of
from dflash_jax.models.architecture import DTYPES
from dflash_jax.models.drafter_config import DrafterConfig
from dflash_jax.models.layers.attention import IMPLEMENTATIONS as ATTENTION_IMPLEMENTATIONS
from dflash_jax.models.layers.layer_stack import REMAT_POLICIES
from dflash_jax.training.objective import ANCHOR_SCHEMES, LOSSES, ObjectiveSettings
from dflash_jax.training.optim.optimizer import OPTIMIZERS, OptimizerConfig


@dataclasses.dataclass(frozen=True)
class TopLevelSettings:
    """The fields outside any section."""

    # Checkpoints, logs and exports; rerunning with the same workdir resumes.
    workdir: str = ""
    # Drafter init and anchor sampling (the data order has data.seed).
    seed: int = 0

    def problems(self) -> list[str]:
        return at_least("", self, seed=0)


@dataclasses.dataclass(frozen=True)
class TargetSettings:
    """The frozen target LLM."""

    # Hugging Face model directory (config.json, safetensors, tokenizer), a hub id
    # `org/name[@revision]` read through the Hugging Face cache (HF_HUB_OFFLINE=1 works offline),
    # or a GGUF file / a directory holding one (models/formats/gguf.py).
    path: str = ""
    # Weights and compute of the frozen target.
    dtype: str = "bfloat16"
    # A config.json for `python -m dflash_jax.plan` when path is empty (configs/targets/);
    # training always reads path's own.
    plan_config: str = ""

    def problems(self) -> list[str]:
        return one_of("target", self, dtype=sorted(DTYPES))


@dataclasses.dataclass(frozen=True)
class TrainSettings(ObjectiveSettings, OptimizerConfig):
    """The objective (its fields: training/objective.py's ObjectiveSettings), the optimizer (its
    fields: training/optim/optimizer.py's OptimizerConfig) and the loop (below)."""

    num_epochs: int = 6
    # 0 = every step of num_epochs; > 0: stop (and end the LR schedule) there.
    max_steps: int = 0
    # Micro-batches per optimizer update (the global batch is data.global_batch_rows).
    grad_accum_steps: int = 1
    # Drafter compute; master weights are always fp32.
    compute_dtype: str = "bfloat16"
    # Attention code (models/layers/attention.py): 'auto' = fused Pallas kernels on GPU, XLA elsewhere;
    # 'xla' (the reference) or 'fused' to force one.
    attention: str = "auto"
    # Run the target's and the drafter's layers under a scan over their stacked weights, one per
    # run of a repeating layer pattern (models/layers/layer_stack.py): compile time grows with the
    # pattern's period, not the depth. False: every layer in the program.
    scan_layers: bool = True
    # Stop after this many consecutive skipped (non-finite) updates.
    max_nonfinite_streak: int = 20
    # >= 0: every drafter layer starts as a copy of this target layer, and the final norm as the
    # target's, where shapes match (training/warm_start.py); -1 = random init.
    init_from_target_layer: int = -1

    def problems(self) -> list[str]:
        out = one_of(
            "train",
            self,
            anchor_scheme=ANCHOR_SCHEMES,
            optimizer=OPTIMIZERS,
            compute_dtype=sorted(DTYPES),
            attention=ATTENTION_IMPLEMENTATIONS,
            remat_policy=tuple(REMAT_POLICIES),
        )
        out += at_least(
            "train",
            self,
            num_epochs=1,
            max_steps=0,
            grad_accum_steps=1,
            num_anchors=0,
            anchors_per_document=0,
            loss_decay_gamma=0,
            weight_decay=0,
            attention_chunk_blocks=1,
            lm_head_chunk_blocks=1,
            max_nonfinite_streak=1,
            init_from_target_layer=-1,
        )
        if self.loss and self.loss not in LOSSES:  # '' = the drafter kind's own
            out.append(f"train.loss={self.loss!r} is not one of {', '.join(LOSSES)} (or '', the drafter kind's)")
        if not self.learning_rate > 0:
            out.append(f"train.learning_rate={self.learning_rate} must be > 0")
        if not self.grad_clip_norm >= 0:
            out.append(f"train.grad_clip_norm={self.grad_clip_norm} must be > 0 (or 0, the drafter kind's)")
        for name in ("b1", "b2", "ema_decay"):
            if not 0 <= getattr(self, name) < 1:
                out.append(f"train.{name}={getattr(self, name)} must be in [0, 1)")
        if not (0 <= self.warmup_fraction < 1 or self.warmup_fraction == -1):
            out.append(f"train.warmup_fraction={self.warmup_fraction} must be in [0, 1) (or -1, the drafter kind's)")
        if not (0 <= self.dpace_alpha <= 1 or self.dpace_alpha == -1):
            out.append(f"train.dpace_alpha={self.dpace_alpha} must be in [0, 1] (or -1, the drafter kind's)")
        if self.selector_alpha < 0:
            out.append(f"train.selector_alpha={self.selector_alpha} must be at least 0")
        for name in ("base_loss_weight", "base_loss_decay"):
            if not 0 <= getattr(self, name) <= 1:
                out.append(f"train.{name}={getattr(self, name)} must be in [0, 1]")
        return out


@dataclasses.dataclass(frozen=True)
class MeshSettings:
    """How the devices are laid out: data x fsdp x tensor (docs/design.md §8)."""

    # -1 = every device fsdp x tensor leave over.
    data: int = -1
    # > 1: the frozen target's weights split over this many devices; -1 = every device data x
    # tensor leave over (with data >= 1).
    fsdp: int = 1
    # > 1: the target's heads, kv heads and MLP split over this many devices.
    tensor: int = 1

    def problems(self) -> list[str]:
        return []  # the shape is checked against the devices, by training.mesh.mesh_shape


@dataclasses.dataclass(frozen=True)
class CheckpointSettings:
    every_steps: int = 1000
    # The most recent checkpoints kept (the best-evaluated drafter weights are kept apart).
    keep: int = 3
    # Write checkpoints in the background while training goes on (Orbax asynchronous saves).
    async_save: bool = True

    def problems(self) -> list[str]:
        return at_least("checkpoint", self, every_steps=1, keep=1)


@dataclasses.dataclass(frozen=True)
class LogSettings:
    every_steps: int = 10
    progress_bars: bool = True
    tensorboard: bool = True
    # Needs `pip install wandb`.
    wandb: bool = False
    wandb_project: str = "dflash_jax"

    def problems(self) -> list[str]:
        return at_least("log", self, every_steps=1)


@dataclasses.dataclass(frozen=True)
class EvalSettings:
    """Acceptance evaluation: speculative decoding of held-out prompts (docs/design.md §7.4)."""

    # JSONL of chat prompts, a bundled set or benchmark name (evaluate --help); '' = the prompts
    # data.heldout_rows keeps out of training ("heldout:<N> of <data.train>") when it is > 0, else
    # no acceptance evaluation. Resolved, it can also be a `decoding.prompt_sets.HeldoutPrompts`.
    prompts: str = ""
    # 0 = only the closing evaluation.
    every_steps: int = 1000
    # 0 = every prompt of the set.
    num_prompts: int = 32
    max_new_tokens: int = 128
    # A drafter with a confidence head: propose the drafts only up to the first slot whose
    # confidence is below this; 0 = the whole block.
    confidence_threshold: float = 0.0
    # > 0: draft among this many of the most frequent trained-on tokens (docs/design.md §4 "Draft
    # vocabulary"; evaluate --draft_vocab); 0 = every token.
    draft_vocab: int = 0

    @property
    def enabled(self) -> bool:
        return bool(self.prompts)

    @property
    def during_training(self) -> bool:
        return self.enabled and self.every_steps > 0

    def problems(self) -> list[str]:
        out = at_least("eval", self, every_steps=0, num_prompts=0, max_new_tokens=1, draft_vocab=0)
        if not 0 <= self.confidence_threshold < 1:
            out.append(f"eval.confidence_threshold={self.confidence_threshold} must be in [0, 1)")
        return out


@dataclasses.dataclass(frozen=True)
class DistributedSettings:
    """Multi-process runs; the defaults read the cluster's environment."""

    # host:port of process 0; '' = $JAX_COORDINATOR_ADDRESS if set, else a single process.
    coordinator_address: str = ""
    # 0 = $JAX_NUM_PROCESSES or the cluster's.
    num_processes: int = 0
    # -1 = $JAX_PROCESS_ID or the cluster's.
    process_id: int = -1

    def problems(self) -> list[str]:
        return at_least("distributed", self, num_processes=0, process_id=-1)


# Every section in the order base_config() lists them, after the top-level fields.
SECTIONS = {
    "target": TargetSettings,
    "drafter": DrafterConfig,
    "data": DataConfig,
    "train": TrainSettings,
    "mesh": MeshSettings,
    "checkpoint": CheckpointSettings,
    "log": LogSettings,
    "eval": EvalSettings,
    "distributed": DistributedSettings,
}
