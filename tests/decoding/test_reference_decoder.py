"""Our export in the reference DFlash decoder (z-lab's `dflash` package, PyTorch; `.ci/run` installs
it, as the README's test section does; without it these tests skip): the reference reads the same
context features (the last target layer's after the final norm), drafts the same logits and
decodes the same tokens in the same steps as we do."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from dflash_jax.decoding.speculative import SpeculativeDecoder
from dflash_jax.models.drafter import DFlashDrafter
from dflash_jax.models.drafter_config import DrafterConfig
from dflash_jax.models.formats.hf import export_drafter, load_target

# Not in the `test` extra: dflash==0.1.0 pins datasets, requests and tqdm exactly.
reference = pytest.importorskip(
    "dflash.model", reason='the reference decoder is not installed: pip install --no-deps "dflash==0.1.0"'
)

BLOCK = 4
MASK = 127
NEW = 12


@pytest.fixture(scope="module")
def models(qwen3_checkpoint, tmp_path_factory):
    """(our target, our drafter reading every layer incl. L - 1, reference target, reference drafter)."""
    target = load_target(qwen3_checkpoint, param_dtype=jnp.float32, compute_dtype=jnp.float32)
    last = target.cfg.num_layers - 1
    cfg = DrafterConfig.for_target(
        target.cfg, num_layers=1, mask_token_id=MASK, block_size=BLOCK, target_layer_ids=(1, last)
    )
    drafter = DFlashDrafter(cfg, rngs=nnx.Rngs(3))
    out = export_drafter(drafter, tmp_path_factory.mktemp("export") / "drafter", dtype=jnp.float32)
    ref_target = transformers.AutoModelForCausalLM.from_pretrained(qwen3_checkpoint, dtype=torch.float32).eval()
    ref_drafter = reference.DFlashDraftModel.from_pretrained(out, dtype=torch.float32).eval()
    return target, drafter, ref_target, ref_drafter


@pytest.mark.slow  # the fast tier keeps the reference's tokens and steps (below)
def test_reference_drafts_the_same_logits_from_the_same_features(models):
    target, drafter, ref_target, ref_drafter = models
    prompt = np.random.default_rng(0).integers(0, MASK, 10)
    anchor = 5
    block = np.array([anchor] + [MASK] * (BLOCK - 1))
    with torch.no_grad():
        hidden = ref_target(torch.tensor(prompt)[None], output_hidden_states=True).hidden_states
        features = reference.extract_context_feature(hidden, ref_drafter.target_layer_ids)
        noise = ref_target.get_input_embeddings()(torch.tensor(block)[None])
        positions = torch.arange(len(prompt) + BLOCK)[None]
        draft_hidden = ref_drafter(target_hidden=features, noise_embedding=noise, position_ids=positions)
        expected = ref_drafter.compute_logits(draft_hidden[:, 1:], ref_target.lm_head).numpy()

    with jax.default_matmul_precision("highest"):
        ids = drafter.cfg.target_layer_ids
        _, ours_features, _ = target.decode(jnp.asarray(prompt)[None], target.new_cache(1, 32), feature_layers=ids)
        cache = drafter.extend_context(
            drafter.new_cache(1, 32), ours_features, jnp.arange(len(prompt))[None], jnp.array([len(prompt)])
        )
        block_positions = len(prompt) + jnp.arange(BLOCK)[None]
        logits = target.unembed(drafter.decode(target.embed(jnp.asarray(block)[None]), block_positions, cache)[:, 1:])
    np.testing.assert_allclose(np.asarray(ours_features), features.numpy(), atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(logits), expected, atol=1e-4, rtol=1e-4)


def test_reference_decodes_the_same_tokens_in_the_same_steps(models, monkeypatch):
    target, drafter, ref_target, ref_drafter = models
    monkeypatch.setattr(reference, "_cuda_time", lambda: 0.0)  # its timing synchronises CUDA
    prompts = [np.random.default_rng(seed).integers(0, MASK, n) for seed, n in ((1, 7), (2, 15))]
    with jax.default_matmul_precision("highest"):
        ours = SpeculativeDecoder(target, drafter, max_prompt_len=16, max_new_tokens=NEW, batch_size=1).generate(
            prompts
        )
    for prompt, got in zip(prompts, ours):
        stats = reference.dflash_generate(
            ref_drafter, ref_target, torch.tensor(prompt)[None], NEW, None, temperature=0.0, return_stats=True
        )
        np.testing.assert_array_equal(got.tokens, stats.output_ids[0, len(prompt) :].numpy())
        np.testing.assert_array_equal(got.step_lengths, stats.acceptance_lengths)
