"""The optimizer of the drafter: its settings (the `train` section's optimizer fields, defaults and
meanings written here once), the learning-rate schedule and the optax transformation.

docs/design.md §3.5: 'adamw' (the paper's), or 'muon': the drafter's matrices by Muon
(orthogonalized momentum, its update scaled to AdamW's size so one learning rate serves), its
vectors (norm scales) by AdamW. Linear warmup, then cosine to 0; global-norm clipping first; weight
decay on matrices only; optionally an average of the weights in the optimizer state
(training/optim/ema.py).
"""

from __future__ import annotations

import dataclasses

import jax
import optax

from dflash_jax.training.optim import muon
from dflash_jax.training.optim.ema import with_weight_average

OPTIMIZERS = ("adamw", "muon")

# Muon's update is scaled to this RMS per matrix, about AdamW's (Moonlight, arXiv 2502.16982), so
# one learning rate serves both optimizers and the AdamW-trained vectors.
MUON_UPDATE_RMS = 0.2

# The paper's schedule: what a run gets where neither it nor its drafter kind sets one.
PAPER_WARMUP_FRACTION = 0.04
PAPER_GRAD_CLIP_NORM = 1.0


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """The optimizer's fields of the `train` section (training/config/sections.py's TrainSettings)."""

    # 'adamw' or 'muon' (the drafter's matrices by Muon, norm scales by AdamW).
    optimizer: str = "adamw"
    learning_rate: float = 6e-4
    # Linear warmup over this share of the steps, then cosine to 0; -1: the drafter kind's
    # (`Kind.warmup_fraction`), else the paper's 0.04.
    warmup_fraction: float = -1.0
    # AdamW's (Muon's vectors included).
    b1: float = 0.9
    b2: float = 0.999
    # Applies to matrices only (norm scales shrinking towards 0 is not regularization).
    weight_decay: float = 0.0
    # Clips the global gradient norm; 0: the drafter kind's (`Kind.grad_clip_norm`), else the
    # paper's 1.0.
    grad_clip_norm: float = 0.0
    # > 0: evaluate and export an exponential moving average of the weights with this decay
    # (training/optim/ema.py); 0 = the last weights.
    ema_decay: float = 0.0


def with_schedule(cfg: OptimizerConfig, warmup_fraction: float = -1.0, grad_clip_norm: float = 0.0) -> OptimizerConfig:
    """`cfg` with the warmup and clip it leaves unset (-1, 0) taken from those given (a drafter
    kind's), and the paper's where those are unset too."""
    warmup = next(f for f in (cfg.warmup_fraction, warmup_fraction, PAPER_WARMUP_FRACTION) if f >= 0)
    clip = cfg.grad_clip_norm or grad_clip_norm or PAPER_GRAD_CLIP_NORM
    return dataclasses.replace(cfg, warmup_fraction=warmup, grad_clip_norm=clip)


def learning_rate_schedule(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
    """Linear warmup over `warmup_fraction` of training, then cosine to 0."""
    warmup = int(round(with_schedule(cfg).warmup_fraction * total_steps))
    return optax.warmup_cosine_decay_schedule(
        0.0, cfg.learning_rate, warmup_steps=warmup, decay_steps=max(total_steps, warmup + 1)
    )


def make_optimizer(
    cfg: OptimizerConfig, total_steps: int, adam_params: tuple[str, ...] = ()
) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW or Muon; weight decay applies to matrices only.
    `adam_params`: the drafter kind's matrices Muon leaves to AdamW (`Kind.adam_params`)."""
    cfg = with_schedule(cfg)
    schedule = learning_rate_schedule(cfg, total_steps)
    if cfg.optimizer == "muon":
        # Muon takes every 2-D leaf (all the drafter's matrices) and decays them; the rest get
        # AdamW with b1, b2 and no decay. Its Newton-Schulz iterations run on whole matrices.
        update = muon.muon(
            schedule,
            consistent_rms=MUON_UPDATE_RMS,
            weight_decay=cfg.weight_decay,
            adam_b1=cfg.b1,
            adam_b2=cfg.b2,
            adam_params=adam_params,
        )
    else:
        update = optax.adamw(
            schedule,
            b1=cfg.b1,
            b2=cfg.b2,
            weight_decay=cfg.weight_decay,
            mask=lambda params: jax.tree.map(lambda p: p.ndim >= 2, params),
        )
    tx = optax.chain(optax.clip_by_global_norm(cfg.grad_clip_norm), update)
    return with_weight_average(tx, cfg.ema_decay) if cfg.ema_decay > 0 else tx
