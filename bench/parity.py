"""Parity of the JAX target LM with transformers (torch CPU) on tiny random checkpoints.

    python bench/parity.py

Prints the max absolute error of logits and of every layer's hidden state, fp32 and bf16
compute, for Qwen3 (untied and tied embeddings) and Llama-3 (llama3 RoPE scaling).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers

from dflash_jax.models.hf import load_target

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tests/support/
from support.hf_reference import write_hf_checkpoint  # noqa: E402

SEQ = 64


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


def main():
    transformers.utils.logging.disable_progress_bar()
    print(f"{'model':<12} {'compute':<9} {'max|Δlogit|':>12} {'max|Δhidden|':>13} {'argmax agree':>13}")
    with tempfile.TemporaryDirectory() as tmp:
        cases = {
            "qwen3": write_hf_checkpoint(f"{tmp}/q", arch="qwen3"),
            "qwen3-tied": write_hf_checkpoint(f"{tmp}/t", arch="qwen3", tie_word_embeddings=True),
            "llama3": write_hf_checkpoint(f"{tmp}/l", arch="llama"),
        }
        for name, path in cases.items():
            for dtype in (jnp.float32, jnp.bfloat16):
                logit_err, hidden_err, agree = errors(path, dtype)
                print(f"{name:<12} {jnp.dtype(dtype).name:<9} {logit_err:>12.2e} {hidden_err:>13.2e} {agree:>13.3f}")


if __name__ == "__main__":
    main()
