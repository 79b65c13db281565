r"""τ of an export in the reference DFlash decoder (z-lab's `dflash` package, PyTorch) beside ours.

    pip install --no-deps dflash==0.1.0
    python bench/reference_decoder.py --drafter=runs/default/export [--target=assets/tiny-qwen3] \
        [--prompts=heldout_prompts] [--limit=32] [--max_new_tokens=64]

Both decoders get the same prompt token ids (our chat rendering), the same stop tokens and fp32
weights (the export's, cast up), greedy. The reference runs `dflash.model.dflash_generate` on the
target as transformers loads it; ours is `SpeculativeDecoder` at batch size 1. Printed per set:
verification steps, output tokens, τ (mean over prompts of each prompt's mean acceptance length,
as the reference benchmark reports it) and how many outputs are identical. Agreement within ±1 % of
steps says the drafter is served on the features it was trained on.
"""

from __future__ import annotations

# First, so that the package's start-up (dflash_jax/startup.py) runs before jax loads.
import dflash_jax  # noqa: F401

# isort: split
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers
from absl import app, flags

from dflash_jax.decoding.acceptance import acceptance_stats
from dflash_jax.decoding.prompt_sets import ChatTokenizer, load_prompt_set
from dflash_jax.decoding.speculative import SpeculativeDecoder
from dflash_jax.models.formats.hf import load_target
from dflash_jax.training.drafters import load_any_drafter

flags.DEFINE_string("drafter", None, "Drafter export directory.", required=True)
flags.DEFINE_string("target", "assets/tiny-qwen3", "Target directory (Hugging Face layout).")
flags.DEFINE_list("prompts", ["heldout_prompts"], "Prompt sets, as evaluate's --prompts.")
flags.DEFINE_integer("limit", 32, "Prompts per set (0: all).")
flags.DEFINE_integer("max_new_tokens", 64, "Tokens generated per prompt at most.")
FLAGS = flags.FLAGS


def reference_generations(target_dir: str, drafter_dir: str, prompts, stop_tokens, max_new_tokens):
    """Per prompt: (output tokens, acceptance length of every verification step)."""
    from dflash import model as reference  # the reference's own code, optional: see the docstring

    reference._cuda_time = time.perf_counter  # its timing synchronises CUDA; CPU here
    target = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    draft_cls = reference.DFlash2DraftModel if _is_dflash2(drafter_dir) else reference.DFlashDraftModel
    draft = draft_cls.from_pretrained(drafter_dir, dtype=torch.float32).eval()
    out = []
    for prompt in prompts:
        ids = torch.tensor(np.asarray(prompt, np.int64))[None]
        stats = reference.dflash_generate(
            draft, target, ids, max_new_tokens, list(stop_tokens), temperature=0.0, return_stats=True
        )
        out.append((stats.output_ids[0, stats.num_input_tokens :].numpy(), np.asarray(stats.acceptance_lengths)))
    return out


def _is_dflash2(drafter_dir: str) -> bool:
    return "DFlash2DraftModel" in (transformers.AutoConfig.from_pretrained(drafter_dir).architectures or [])


def ours_generations(target_dir: str, drafter_dir: str, prompts, stop_tokens, max_new_tokens):
    with jax.default_matmul_precision("highest"):
        target = load_target(target_dir, param_dtype=jnp.float32, compute_dtype=jnp.float32)
        drafter = load_any_drafter(drafter_dir, param_dtype=jnp.float32, compute_dtype=jnp.float32)
        decoder = SpeculativeDecoder(
            target,
            drafter,
            max_prompt_len=max(len(p) for p in prompts),
            max_new_tokens=max_new_tokens,
            batch_size=1,
            stop_tokens=stop_tokens,
        )
        return decoder.generate(prompts), drafter.cfg.block_size


def main(argv):
    del argv
    chat = ChatTokenizer(FLAGS.target)
    print(f"{'set':<18}{'decoder':<11}{'prompts':>8}{'steps':>7}{'tokens':>8}{'tau':>8}{'identical':>11}")
    for spec in FLAGS.prompts:
        prompt_set = load_prompt_set(spec, chat, limit=FLAGS.limit)
        prompts = [chat.prompt_ids(row[0]) for row in prompt_set.rows]
        ours, block_size = ours_generations(
            FLAGS.target, FLAGS.drafter, prompts, chat.stop_tokens, FLAGS.max_new_tokens
        )
        ref = reference_generations(FLAGS.target, FLAGS.drafter, prompts, chat.stop_tokens, FLAGS.max_new_tokens)
        identical = sum(np.array_equal(g.tokens, tokens) for g, (tokens, _) in zip(ours, ref))
        ours_stats = acceptance_stats(ours, block_size)
        ref_steps = [s for _, s in ref if len(s)]
        rows = [
            ("ours", ours_stats["num_steps"], ours_stats["num_tokens"], ours_stats["tau"]),
            (
                "reference",
                sum(map(len, ref_steps)),
                sum(len(t) for t, _ in ref),
                np.mean([s.mean() for s in ref_steps]),
            ),
        ]
        for name, steps, tokens, tau in rows:
            print(f"{prompt_set.name:<18}{name:<11}{len(prompts):>8}{steps:>7}{tokens:>8}{tau:>8.3f}{identical:>11}")


if __name__ == "__main__":
    app.run(main)
