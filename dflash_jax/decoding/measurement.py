"""Measuring a drafter as a serving engine would: acceptance length and speed against the target.

For every prompt set, the same prompts are decoded by DFlash speculative decoding and by the
target alone (after compiling both; batch by batch, the two in turn), and the result holds τ
(docs/design.md §4), its histogram, per-slot acceptance rates, tokens/s, time per output token
and the speed ratio, end to end and after the first token (the prefill, the same for both, left
out). Multi-turn rows (mt-bench) are decoded turn by turn: each later user turn
follows the target's own answer to the earlier ones, and every answered turn counts as one
generation in τ, as in the DFlash benchmark.
"""

from __future__ import annotations

import json
import os
import time

import jax
import numpy as np
from tqdm import tqdm

from dflash_jax.decoding import report
from dflash_jax.decoding.acceptance import acceptance_stats
from dflash_jax.decoding.generate import Decoder, TargetDecoder
from dflash_jax.decoding.prompt_sets import ChatTokenizer, PromptSet, load_prompt_set
from dflash_jax.decoding.sampling import GREEDY, SamplingConfig
from dflash_jax.decoding.speculative import SpeculativeDecoder
from dflash_jax.models.drafter import DFlashDrafter
from dflash_jax.models.transformer import Transformer


def timed_generate(
    decoders: dict[str, Decoder], prompts, *, seed: int, desc: str
) -> dict[str, list[tuple[float, list]]]:
    """Decode batch by batch, each batch by every decoder in turn; returns, per decoder name,
    (seconds, generations) per batch. Interleaved, so that a slow spell of a shared machine
    weighs on every decoder alike and their speed ratio stays fair."""
    batches = {name: [] for name in decoders}
    batch_size = min(d.batch_size for d in decoders.values())
    for i, start in enumerate(tqdm(range(0, len(prompts), batch_size), desc=desc, leave=False)):
        for name, decoder in decoders.items():
            t0 = time.perf_counter()
            generations = decoder.generate(prompts[start : start + batch_size], seed=seed + i)
            batches[name].append((time.perf_counter() - t0, generations))
    return batches


def speed(batches: list[tuple[float, list]]) -> dict:
    """Throughput, and each prompt's batch time per output token averaged over prompts; then the
    same for the decoding after the first token (the batch's prefill, `Generation.first_token_s`,
    left out: what a serving engine reports as time per output token after time to first token).
    A batch is one decoder batch, as `timed_generate` times them."""
    generations = [g for _, gens in batches for g in gens]
    tokens = sum(len(g.tokens) for g in generations)
    seconds = sum(s for s, _ in batches)
    first_token_s = [gens[0].first_token_s for _, gens in batches if gens]
    after_first = [(s - g.first_token_s, len(g.tokens) - 1) for s, gens in batches for g in gens if len(g.tokens) > 1]
    decode_seconds = seconds - sum(first_token_s)
    return {
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "ms_per_token": 1000 * float(np.mean([s / len(g.tokens) for s, gens in batches for g in gens])),
        "first_token_ms": 1000 * float(np.mean(first_token_s)),
        "decode_tokens_per_s": (tokens - len(generations)) / decode_seconds if decode_seconds > 0 else 0.0,
        "decode_ms_per_token": 1000 * float(np.mean([s / n for s, n in after_first])) if after_first else 0.0,
    }


def evaluate_set(
    target,
    drafter,
    chat: ChatTokenizer,
    prompt_set: PromptSet,
    *,
    max_new_tokens,
    batch_size,
    sampling,
    seed,
    drafting: dict | None = None,
) -> dict:
    """DFlash against the target alone on every turn of every row. Turn k of every row that has
    one is decoded together, after turn k-1: a row's history holds its earlier turns and the
    target-alone answers to them (its own greedy output, which greedy DFlash reproduces).
    `drafting`: `SpeculativeDecoder`'s drafting options (default: its own)."""
    rows = prompt_set.rows
    turns = max(map(len, rows))
    histories: list[list[dict]] = [[] for _ in rows]
    spec, ref = [], []
    for turn in range(turns):
        active = [i for i, row in enumerate(rows) if turn < len(row)]
        for i in active:
            histories[i] = histories[i] + rows[i][turn]
        prompts = [chat.prompt_ids(histories[i]) for i in active]
        label = f", turn {turn + 1}" if turns > 1 else ""
        turn_spec, turn_ref = _decode_both(
            target,
            drafter,
            prompts,
            max_new_tokens=max_new_tokens,
            batch_size=batch_size,
            sampling=sampling,
            stop_tokens=chat.stop_tokens,
            seed=seed + turn * len(rows),  # every batch of every turn its own seed
            label=label,
            drafting=drafting or {},
        )
        answers = [g for _, gens in turn_ref for g in gens]
        for i, answer in zip(active, answers):
            histories[i] = histories[i] + [{"role": "assistant", "content": chat.response_text(answer.tokens)}]
        spec += turn_spec
        ref += turn_ref
    spec_gens = [g for _, gens in spec for g in gens]
    ref_gens = [g for _, gens in ref for g in gens]
    result = acceptance_stats(spec_gens, drafter.cfg.verify_size)
    result["num_prompts"] = len(rows)
    result["num_turns"] = len(spec_gens)
    result["dflash"] = speed(spec)
    result["target"] = speed(ref)
    result["speedup"] = result["dflash"]["tokens_per_s"] / result["target"]["tokens_per_s"]
    # The prefill is the same work for both and weighs more the shorter the answers. None where
    # no answer had a token after its first (nothing decoded to time; the table prints '-').
    dflash_rate, target_rate = result["dflash"]["decode_tokens_per_s"], result["target"]["decode_tokens_per_s"]
    result["decode_speedup"] = dflash_rate / target_rate if target_rate else None
    if sampling.greedy:
        # Greedy DFlash is lossless in exact arithmetic; in bf16 a near-tie can still flip.
        result["identical_outputs"] = float(
            np.mean([np.array_equal(a.tokens, b.tokens) for a, b in zip(spec_gens, ref_gens)])
        )
    return result


def _decode_both(target, drafter, prompts, *, max_new_tokens, batch_size, sampling, stop_tokens, seed, label, drafting):
    """(DFlash, target alone) timed batches of the same prompts, each decoder compiled first."""
    kw = dict(
        max_prompt_len=max(len(p) for p in prompts),
        max_new_tokens=max_new_tokens,
        batch_size=min(batch_size, len(prompts)),
        sampling=sampling,
        stop_tokens=stop_tokens,
    )
    dflash = SpeculativeDecoder(target, drafter, **drafting, **kw)
    alone = TargetDecoder(target, **kw)
    lengths = [len(p) for p in prompts]
    dflash.warmup(lengths)  # compile outside the timed runs
    alone.warmup(lengths)
    batches = timed_generate({"dflash": dflash, "alone": alone}, prompts, seed=seed, desc=f"DFlash and target{label}")
    return batches["dflash"], batches["alone"]


def evaluate(
    target: Transformer,
    drafter: DFlashDrafter,
    chat: ChatTokenizer,
    prompt_specs,
    *,
    num_prompts: int = 0,
    max_new_tokens: int = 256,
    batch_size: int = 1,
    sampling: SamplingConfig = GREEDY,
    seed: int = 0,
    confidence_threshold: float = 0.0,
    draft_tokens: np.ndarray | None = None,
) -> dict:
    """Evaluate every prompt set (specs as `chat.resolve_prompt_set` reads them, or
    `HeldoutPrompts`); {"run": settings, "sets": {name: result}}. `confidence_threshold`:
    the truncation of a drafter with a confidence head (0 = the whole block); `draft_tokens`: the draft vocabulary
    (decoding/draft_vocab.py; None = the whole vocabulary)."""
    drafting = dict(confidence_threshold=confidence_threshold, draft_tokens=draft_tokens)
    prompt_sets = [load_prompt_set(spec, chat, limit=num_prompts) for spec in prompt_specs]
    sets = {}
    for prompt_set in prompt_sets:
        turns = sum(map(len, prompt_set.rows))
        print(f"{prompt_set.name}: {len(prompt_set.rows)} prompts, {turns} turns to answer")
        sets[prompt_set.name] = evaluate_set(
            target,
            drafter,
            chat,
            prompt_set,
            max_new_tokens=max_new_tokens,
            batch_size=batch_size,
            sampling=sampling,
            seed=seed,
            drafting=drafting,
        )
    run = {
        "drafter_kind": drafter.cfg.kind,
        "block_size": drafter.cfg.block_size,
        "verify_size": drafter.cfg.verify_size,  # the longest acceptance
        "confidence_threshold": confidence_threshold,
        "draft_vocab": 0 if draft_tokens is None else len(draft_tokens),  # 0: the whole vocabulary
        "max_new_tokens": max_new_tokens,
        "batch_size": batch_size,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "enable_thinking": chat.enable_thinking,
        "device": jax.devices()[0].device_kind,
    }
    return {"run": run, "sets": sets}


def write_outputs(evaluation: dict, out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "eval.json"), "w") as out:
        json.dump(evaluation, out, indent=2)
    report.plot(evaluation["sets"], evaluation["run"]["verify_size"], os.path.join(out_dir, "eval.png"))
