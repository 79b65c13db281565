"""Which training recipe or drafter kind trains the better drafter? Held-out τ decides, not the loss.

    python bench/study.py --study=kinds            # DFlash, DFlash2 and DSpark on the default job
    python bench/study.py --study=anchors          # the anchor schemes, seeds 0 and 1
    python bench/study.py --study=objective        # 'dflash' against 'dpace' (two alphas)
    python bench/study.py --study=recipe --seeds=0 --max_new_tokens=64   # §3.6, then Muon
    python bench/study.py --variants=anchor_scheme=document,anchor_scheme=row --seeds=0 --num_epochs=1
    python bench/study.py --study=kinds --seeds=0 --max_steps=20 --num_prompts=4 --max_new_tokens=16,32

A variant is a set of overrides of `configs/default.py` (or of `--config`), `key=value` joined by `+`
(`loss=dpace+dpace_alpha=0.8`; a bare key is a `train.` field, others name their section:
`data.docs_per_row=1`); `--study` names a prepared list of them and the base they were measured
on (`STUDY_BASES`: the settings of the default run at the time, applied before each variant, so
a study measures the same thing after the default changes); `--variants` alone applies to the
default as it is. Trains once per (variant, seed), for the default's steps unless the variant
changes the batching (the seed sets the drafter init, the anchors and the data order), then
measures τ by real greedy speculative decoding on the bundled held-out prompts for every
`--max_new_tokens`, and prints one row per run and the mean per variant, side by side, with the
train step time (the median of the logged intervals after the first, which holds the
compilation) and the decode step time (one drafter pass, the walk and one target verification:
decoding seconds per speculative step, after compiling). Runs live in `--root/<variant>_s<seed>`;
a finished run is evaluated again without retraining, so an interrupted study resumes.

The kinds study (docs/design.md §12): every kind drafts 7 tokens a step, so the target verifies 8
tokens for each: DFlash, DFlash2, XPress and Domino on the default's blocks of 8 (Domino drafts all
but the last slot, as SpecForge's decoder does), DSpark on blocks of 7 (every slot drafts). Each
kind trains with its own defaults on the default config (its slot weights under the default's
D-PACE; `loss=dflash` selects the kind's exponential weights).
"""

from __future__ import annotations

# First, so that the package's start-up (dflash_jax/startup.py) runs before jax loads.
import dflash_jax  # noqa: F401

# isort: split
import argparse
import ast
import json
import os
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.decoding.acceptance import acceptance_stats
from dflash_jax.decoding.prompt_sets import ChatTokenizer, load_prompts
from dflash_jax.decoding.speculative import SpeculativeDecoder
from dflash_jax.models.formats.hf import load_drafter, load_target
from dflash_jax.models.formats.hub import resolve_model
from dflash_jax.training.config.presets import load_config_file
from dflash_jax.training.config.run_config import resolve
from dflash_jax.training.loop import train

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", "default.py")

# The variant of each drafter kind, on the default config as it is: each kind brings its own
# defaults, and every kind drafts 7 tokens a step (DSpark drafts every slot of its block of 7,
# Domino all but the last of its block of 8, as SpecForge's decoder does).
KINDS = {
    "dflash": "drafter.kind=dflash",
    "dflash2": "drafter.kind=dflash2",
    "dspark": "drafter.kind=dspark+drafter.block_size=7",
    "domino": "drafter.kind=domino",
    "xpress": "drafter.kind=xpress",
}

STUDIES = {
    # docs/design.md §12: the drafter kinds.
    "kinds": tuple(KINDS.values()),
    # docs/design.md §3.1: how anchors are drawn.
    "anchors": (
        "anchor_scheme=document",
        "anchor_scheme=response",
        "anchor_scheme=row",
        "anchor_scheme=document+anchors_per_document=16",
    ),
    # docs/design.md §3.3: how slots are weighted.
    "objective": ("loss=dflash", "loss=dpace+dpace_alpha=0.5", "loss=dpace+dpace_alpha=0.8"),
    # docs/design.md §3.6: what a per-conversation trainer does differently, one at a time; then
    # the optimizer (§3.5).
    "recipe": (
        "loss=dpace",  # the default run of the time: packed rows, 64 anchors per row, AdamW
        "data.docs_per_row=1+max_steps=558",  # one conversation per row, the default's steps
        "data.docs_per_row=1",  # one conversation per row, the default's epochs (1536 steps)
        "num_anchors=128",  # twice the anchors per row
        "num_anchors=192+anchors_per_document=64",  # anchors per conversation, 64 each
        "learning_rate=0.005",
        "b2=0.95",
        "loss=dpace+dpace_alpha=0.3",
        "data.global_batch_rows=2",  # half the rows per step: the default's epochs in 1116 steps
        "data.global_batch_rows=2+num_anchors=128",  # and twice the anchors: twice the blocks
        "data.global_batch_rows=8+num_epochs=6",  # twice the rows per step, the default's steps
        "data.global_batch_rows=8+num_epochs=6+num_anchors=32",  # ... and the default's blocks
        "grad_clip_norm=1000000000.0",  # no clipping
        "distill=True",  # the target's distribution instead of the data token
        "distill=True+b1=0.95",
        "optimizer=muon",  # Muon for the drafter's matrices
        "optimizer=muon+learning_rate=0.0015",
        "optimizer=muon+learning_rate=0.006",  # the default run now
        "optimizer=muon+learning_rate=0.01",
    ),
}

# What each study was measured on, before its variants: the default run of the time (a DFlash
# drafter, AdamW at 3e-3; the anchor study also with the paper's loss).
STUDY_BASES = {
    "anchors": "drafter.kind=dflash+optimizer=adamw+learning_rate=0.003+loss=dflash",
    "objective": "drafter.kind=dflash+optimizer=adamw+learning_rate=0.003",
    "recipe": "drafter.kind=dflash+optimizer=adamw+learning_rate=0.003",
}


def overrides(variant: str) -> dict[str, object]:
    """'loss=dpace+dpace_alpha=0.8' -> {'loss': 'dpace', 'dpace_alpha': 0.8}."""
    out = {}
    for item in filter(None, variant.split("+")):
        key, _, value = item.partition("=")
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):  # a bare word: a string
            out[key] = value
    return out


def apply_variant(config, variant: str) -> None:
    """Set a variant's fields on the config; a bare field name is train's."""
    for key, value in overrides(variant).items():
        section, _, field = key.rpartition(".")
        section = config[section or "train"]
        if field not in section:
            raise ValueError(f"variant {variant!r}: {key} is not a field of the config")
        section[field] = value


def study_target(args):
    """(the study's config, its target in fp32, its chat tokenizer, the first --num_prompts
    bundled held-out prompts)."""
    config = load_config_file(args.config)
    model = str(resolve_model(config.target.path))
    target = load_target(model, param_dtype=jnp.float32, compute_dtype=jnp.float32)
    chat = ChatTokenizer(model)
    return config, target, chat, load_prompts("heldout_prompts", chat, limit=args.num_prompts)[1]


def train_one(variant: str, seed: int, args) -> tuple[str, float, int]:
    """(export directory, training seconds, steps) of one run."""
    config = load_config_file(args.config)
    config.workdir = os.path.join(args.root, f"{variant.replace('=', '-').replace('+', '_')}_s{seed}")
    config.seed = config.data.seed = seed
    config.train.max_steps = args.max_steps
    config.train.num_epochs = args.num_epochs or config.train.num_epochs
    config.eval.every_steps = 0  # measured below, the same way for every run
    config.log.progress_bars = False
    # Last: a variant may set max_steps too; the variant after the study's base.
    apply_variant(config, args.base)
    apply_variant(config, variant)
    setup = resolve(config, num_devices=jax.device_count())
    start = time.perf_counter()
    outcome = train(setup)
    return setup.workdir.export, time.perf_counter() - start, outcome.step


def train_step_seconds(workdir: str) -> float:
    """The median logged seconds per train step, the first interval (compilation) left out."""
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    rates = [r["steps_per_sec"] for r in rows if r["kind"] == "train"][1:]
    return float(np.median([1 / r for r in rates])) if rates else float("nan")


def decode(target, drafter, prompts, stop_tokens, max_new_tokens: int) -> tuple[float, float]:
    """(τ, seconds per speculative step) of greedy decoding, compiled first."""
    decoder = SpeculativeDecoder(
        target, drafter, max_prompt_len=max(map(len, prompts)), max_new_tokens=max_new_tokens, stop_tokens=stop_tokens
    )
    decoder.warmup([len(p) for p in prompts])
    start = time.perf_counter()
    generations = decoder.generate(prompts)
    seconds = time.perf_counter() - start
    steps = sum(len(g.step_lengths) for g in generations)
    return acceptance_stats(generations, drafter.cfg.verify_size)["tau"], seconds / max(steps, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--study", choices=sorted(STUDIES), default="", help="a prepared list, on its base")
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="the config file the variants change")
    parser.add_argument("--variants", default="", help="comma-separated variants; default: the study's")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--max_new_tokens", default="64,256")
    parser.add_argument("--num_prompts", type=int, default=32)
    parser.add_argument("--num_epochs", type=int, default=0, help="0: the default config's")
    parser.add_argument("--max_steps", type=int, default=0, help="0: every step of the epochs")
    parser.add_argument("--root", default="", help="default: runs/<study>_study, runs/variants_study")
    args = parser.parse_args()
    if not (args.study or args.variants):
        parser.error("give --study or --variants")
    # Commas inside parentheses belong to a tuple value: drafter.target_layer_ids=(0,1,2).
    variants = re.split(r",(?![^()]*\))", args.variants) if args.variants else list(STUDIES[args.study])
    args.base = STUDY_BASES.get(args.study, "")
    seeds = [int(s) for s in args.seeds.split(",")]
    lengths = [int(n) for n in args.max_new_tokens.split(",")]
    args.root = args.root or os.path.join("runs", f"{args.study or 'variants'}_study")

    _, target, chat, prompts = study_target(args)

    rows = []
    for seed in seeds:  # a seed of every variant first: a study cut short still compares them
        for variant in variants:
            export, seconds, steps = train_one(variant, seed, args)
            drafter = load_drafter(export, param_dtype=jnp.float32, compute_dtype=jnp.float32)
            measured = [decode(target, drafter, prompts, chat.stop_tokens, n) for n in lengths]
            taus, step_seconds = [t for t, _ in measured], train_step_seconds(os.path.dirname(export))
            rows.append((variant, seed, steps, seconds, step_seconds, measured[-1][1], taus))
            print(f"{variant} seed {seed}: {steps} steps in {seconds:.0f} s, tau {taus}", flush=True)

    width = max(len("variant"), *map(len, variants))
    taus_header = "".join(f"  tau@{n:<4d}" for n in lengths)
    base = f"; every variant on {args.base}" if args.base else ""
    print(f"\n{len(prompts)} held-out prompts (heldout_prompts), greedy; {jax.devices()[0].device_kind}{base}")
    print(
        f"{'variant':{width}s} {'seed':>4s} {'steps':>6s} {'train_s':>8s} {'step ms':>8s} {'decode ms':>9s}{taus_header}"
    )
    for variant, seed, steps, seconds, step_seconds, decode_seconds, taus in rows:
        print(
            f"{variant:{width}s} {seed:4d} {steps:6d} {seconds:8.0f} {step_seconds * 1e3:8.1f} {decode_seconds * 1e3:9.2f}"
            + "".join(f"  {t:8.3f}" for t in taus)
        )
    print("mean per variant (and against the first's tau):")
    means = {v: np.mean([r[-1] for r in rows if r[0] == v], axis=0) for v in variants}
    first = means[variants[0]]
    for variant in variants:
        ratios = "".join(f"  x{m / f:.3f}" for m, f in zip(means[variant], first))
        print(
            f"{variant:{width}s} {'':4s} {'':6s} {'':8s} {'':8s} {'':9s}"
            + "".join(f"  {t:8.3f}" for t in means[variant])
            + ratios
        )


if __name__ == "__main__":
    main()
