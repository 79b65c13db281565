r"""Measure a DFlash drafter as a serving engine would: acceptance length and speed-up.

    python -m dflash_jax.evaluate --target=assets/tiny-qwen3 --drafter=runs/default/export \
        [--prompts=heldout_prompts,my_prompts.jsonl] [--num_prompts=32] [--max_new_tokens=256] \
        [--batch_size=1] [--temperature=0] [--out_dir=eval_results]

--drafter is an export directory (ours or a released DFlash drafter) or a training workdir
(latest checkpoint, or --drafter_step). --prompts lists bundled held-out sets (heldout_prompts,
stdlib_heldout) and/or JSONL files of chat rows. For every set, the same prompts are decoded by
DFlash speculative decoding and by the target alone (block size 1), after compiling both, and
the run reports τ (mean acceptance length), its histogram, per-slot acceptance rates, tokens/s,
time per output token and the speed ratio: a table on the terminal, `eval.json` and `eval.png`
in --out_dir.
"""

from __future__ import annotations

import json
import os
import time

import jax
import numpy as np
from absl import app, flags
from tqdm import tqdm

from dflash_jax.decoding import report
from dflash_jax.decoding.acceptance import acceptance_stats
from dflash_jax.decoding.chat import ChatTokenizer, load_prompts
from dflash_jax.decoding.generate import Decoder, TargetDecoder
from dflash_jax.decoding.loading import load_any_drafter
from dflash_jax.decoding.sampling import SamplingConfig
from dflash_jax.decoding.speculative import SpeculativeDecoder
from dflash_jax.models.config import DTYPES
from dflash_jax.models.hf import load_target


def timed_generate(decoder: Decoder, prompts, *, seed: int, desc: str) -> list[tuple[float, list]]:
    """Decode batch by batch; returns (seconds, generations) per batch."""
    batches = []
    for i, start in enumerate(tqdm(range(0, len(prompts), decoder.batch_size), desc=desc, leave=False)):
        t0 = time.perf_counter()
        generations = decoder.generate(prompts[start : start + decoder.batch_size], seed=seed + i)
        batches.append((time.perf_counter() - t0, generations))
    return batches


def speed(batches: list[tuple[float, list]]) -> dict:
    """Throughput, and each prompt's batch time per output token averaged over prompts."""
    tokens = sum(len(g.tokens) for _, gens in batches for g in gens)
    seconds = sum(s for s, _ in batches)
    return {
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "ms_per_token": 1000 * float(np.mean([s / len(g.tokens) for s, gens in batches for g in gens])),
    }


def evaluate_set(target, drafter, prompts, *, max_new_tokens, batch_size, sampling, stop_tokens, seed) -> dict:
    kw = dict(max_prompt_len=max(len(p) for p in prompts), max_new_tokens=max_new_tokens,
              batch_size=min(batch_size, len(prompts)), sampling=sampling, stop_tokens=stop_tokens)
    dflash = SpeculativeDecoder(target, drafter, **kw)
    alone = TargetDecoder(target, **kw)
    lengths = [len(p) for p in prompts]
    dflash.warmup(lengths)  # compile outside the timed runs
    alone.warmup(lengths)
    spec = timed_generate(dflash, prompts, seed=seed, desc="DFlash")
    ref = timed_generate(alone, prompts, seed=seed, desc="target alone")
    spec_gens = [g for _, gens in spec for g in gens]
    ref_gens = [g for _, gens in ref for g in gens]
    result = acceptance_stats(spec_gens, drafter.cfg.block_size)
    result["dflash"] = speed(spec)
    result["target"] = speed(ref)
    result["speedup"] = result["dflash"]["tokens_per_s"] / result["target"]["tokens_per_s"]
    if sampling.greedy:
        # Greedy DFlash is lossless in exact arithmetic; in bf16 a near-tie can still flip.
        result["identical_outputs"] = float(np.mean(
            [np.array_equal(a.tokens, b.tokens) for a, b in zip(spec_gens, ref_gens)]
        ))
    return result


def run_evaluation(target_path: str, drafter_path: str, prompt_specs, *, drafter_step=None, num_prompts=0,
                   max_new_tokens=256, batch_size=1, sampling=SamplingConfig(), enable_thinking=False,
                   dtype="bfloat16", seed=0) -> dict:
    """Evaluate every prompt set; returns {"run": settings, "sets": {name: results}}."""
    chat = ChatTokenizer(target_path, enable_thinking=enable_thinking)
    prompt_sets = dict(load_prompts(spec, chat, limit=num_prompts) for spec in prompt_specs)
    target = load_target(target_path, param_dtype=DTYPES[dtype], compute_dtype=DTYPES[dtype])
    drafter = load_any_drafter(drafter_path, step=drafter_step, param_dtype=DTYPES[dtype],
                               compute_dtype=DTYPES[dtype])
    sets = {}
    for name, prompts in prompt_sets.items():
        print(f"{name}: {len(prompts)} prompts")
        sets[name] = evaluate_set(
            target, drafter, prompts, max_new_tokens=max_new_tokens, batch_size=batch_size,
            sampling=sampling, stop_tokens=chat.stop_tokens, seed=seed,
        )
    run = {
        "target": target_path, "drafter": drafter_path, "drafter_step": drafter_step,
        "block_size": drafter.cfg.block_size, "max_new_tokens": max_new_tokens, "batch_size": batch_size,
        "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
        "enable_thinking": enable_thinking, "dtype": dtype, "device": jax.devices()[0].device_kind,
    }
    return {"run": run, "sets": sets}


def write_outputs(evaluation: dict, out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "eval.json"), "w") as out:
        json.dump(evaluation, out, indent=2)
    report.plot(evaluation["sets"], evaluation["run"]["block_size"], os.path.join(out_dir, "eval.png"))


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """The CLI's flags; defined when run as a program (tests use their own FlagValues, since
    several CLIs share flag names)."""
    fv = dict(flag_values=flag_values)
    flags.DEFINE_string("target", None, "Hugging Face target directory (weights, tokenizer, chat template).", **fv)
    flags.DEFINE_string("drafter", None, "Drafter export directory or training workdir.", **fv)
    flags.DEFINE_integer("drafter_step", None, "Checkpoint step when --drafter is a workdir (default: latest).", **fv)
    flags.DEFINE_list("prompts", ["heldout_prompts"], "Bundled prompt set names and/or JSONL paths.", **fv)
    flags.DEFINE_integer("num_prompts", 0, "Prompts per set (0: all).", **fv)
    flags.DEFINE_integer("max_new_tokens", 256, "Tokens generated per prompt at most (stop tokens end earlier).", **fv)
    flags.DEFINE_integer("batch_size", 1, "Prompts decoded together (speed-ups are usually quoted at 1).", **fv)
    flags.DEFINE_float("temperature", 0.0, "0: greedy (lossless); > 0: rejection sampling.", **fv)
    flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass (1: off).", **fv)
    flags.DEFINE_integer("top_k", 0, "Top-k sampling (0: off).", **fv)
    flags.DEFINE_integer("seed", 0, "Sampling seed.", **fv)
    flags.DEFINE_bool("enable_thinking", False, "Render prompts with thinking enabled (Qwen3 templates).", **fv)
    flags.DEFINE_enum("dtype", "bfloat16", sorted(DTYPES), "Weight and compute dtype of both models.", **fv)
    flags.DEFINE_string("out_dir", "eval_results", "Where eval.json and eval.png are written.", **fv)
    flags.mark_flags_as_required(["target", "drafter"], **fv)


def main(argv, f: flags.FlagValues = flags.FLAGS):
    del argv
    if f.max_new_tokens < 1 or f.batch_size < 1 or f.num_prompts < 0:
        raise app.UsageError("--max_new_tokens and --batch_size must be >= 1, --num_prompts >= 0")
    evaluation = run_evaluation(
        f.target, f.drafter, f.prompts, drafter_step=f.drafter_step, num_prompts=f.num_prompts,
        max_new_tokens=f.max_new_tokens, batch_size=f.batch_size,
        sampling=SamplingConfig(f.temperature, top_p=f.top_p, top_k=f.top_k),
        enable_thinking=f.enable_thinking, dtype=f.dtype, seed=f.seed,
    )
    write_outputs(evaluation, f.out_dir)
    print(report.table(evaluation["sets"]))
    print(f"wrote {f.out_dir}/eval.json and {f.out_dir}/eval.png")


if __name__ == "__main__":
    define_flags()
    app.run(main)
