"""Acceptance statistics: τ as the reference benchmark defines it, and consistent bookkeeping."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

from dflash_jax.decoding import speculative
from dflash_jax.decoding.acceptance import acceptance_stats, measure_acceptance
from dflash_jax.decoding.generate import Generation
from dflash_jax.decoding.sampling import GREEDY
from support.decoding_models import BLOCK, OracleDrafter, make_successor_target, random_prompts


def gen(steps):
    steps = np.asarray(steps, np.int32)
    return Generation(np.zeros(1 + steps.sum(), np.int32), steps)


def test_tau_is_the_mean_over_prompts_of_per_prompt_means():
    result = acceptance_stats([gen([4, 4]), gen([1, 1, 1, 1]), gen([])], block_size=4)
    assert result["tau"] == pytest.approx((4 + 1) / 2)  # the prompt without a step is left out
    assert result["tau_pooled"] == pytest.approx(12 / 6)
    assert result["histogram"] == [4, 0, 0, 2]
    assert result["slot_acceptance"] == pytest.approx([2 / 6, 2 / 6, 2 / 6])
    assert (result["num_prompts"], result["num_prompts_with_steps"], result["num_steps"]) == (3, 2, 6)
    assert result["num_tokens"] == 9 + 5 + 1


def test_acceptance_lengths_outside_the_block_are_an_error():
    with pytest.raises(ValueError, match="outside 1..4"):
        acceptance_stats([gen([5])], block_size=4)


def test_measure_acceptance_bookkeeping_and_no_recompilation():
    target, successor = make_successor_target(seed=4, noise=2.0)
    drafter = OracleDrafter(target, successor)
    prompts = random_prompts(80, (4, 9, 15, 6, 11))
    result = measure_acceptance(target, drafter, prompts, max_new_tokens=20, batch_size=2)
    step_fn = speculative.spec_fns(nnx.graphdef((target, drafter)), GREEDY)[1]
    steps = step_fn._cache_size()
    again = measure_acceptance(target, drafter, prompts, max_new_tokens=20, batch_size=2)
    assert step_fn._cache_size() == steps
    assert again == result

    hist = np.array(result["histogram"])
    assert len(hist) == BLOCK and hist.sum() == result["num_steps"]
    # Every token but each prompt's first comes from a step: Σ n·count(n) + prompts = tokens.
    assert (np.arange(1, BLOCK + 1) * hist).sum() + len(prompts) == result["num_tokens"] == 20 * len(prompts)
    assert 1 <= result["tau"] <= BLOCK
    rates = np.array(result["slot_acceptance"])
    assert np.all(np.diff(rates) <= 0) and 0 < rates[-1] < rates[0] < 1
