"""Rollout batches as the learner sees them: the prompt width of a batch, where each sampler
log-prob lands, and that a narrower (less padded) batch gives the policy the same log-probs."""

from __future__ import annotations

import numpy as np
import pytest

from jaxrlhf.rl.batch import prompt_width, rollout_arrays
from jaxrlhf.rl.rollout import PromptItem, Rollout, Sample

PAD = 0


def rollout(prompts, responses) -> Rollout:
    samples = [
        Sample(i, 0, tuple(r), tuple(-0.1 * (j + 1) for j in range(len(r))), "stop", 3)
        for i, r in enumerate(responses)
    ]
    items = [PromptItem(str(i), tuple(p)) for i, p in enumerate(prompts)]
    return Rollout(0, items, samples, 3, 0.0)


@pytest.mark.parametrize(
    "longest, multiple, expected", [(5, 16, 16), (16, 16, 16), (17, 16, 32), (30, 8, 32),
                                    (60, 16, 48), (5, 0, 48), (1, 1, 2)],
)  # fmt: skip
def test_prompt_width_is_the_longest_prompt_rounded_up_and_capped(longest, multiple, expected):
    batch = rollout([[7] * longest, [8] * 2], [[1], [2]])
    assert prompt_width(batch, 48, multiple) == expected


def test_sampler_logprobs_sit_under_the_response_tokens_they_score():
    batch = rollout([[5, 6, 7], [9]], [[11, 12], [13, 14, 15]])
    arrays = rollout_arrays(batch, PAD, prompt_width(batch, 64, 4), 4)
    assert arrays.input_ids.shape == (2, 8)
    np.testing.assert_array_equal(arrays.input_ids[0], [0, 5, 6, 7, 11, 12, 0, 0])
    np.testing.assert_array_equal(arrays.input_ids[1], [0, 0, 0, 9, 13, 14, 15, 0])
    # Entry t scores token t + 1: the first response token (column 4) is scored by entry 3.
    np.testing.assert_allclose(arrays.sampler_logprobs[1, 3:6], [-0.1, -0.2, -0.3])
    np.testing.assert_array_equal(arrays.loss_mask[0, :7], [0, 0, 0, 1, 1, 0, 0])
    np.testing.assert_array_equal(arrays.loss_mask[1, :7], [0, 0, 0, 1, 1, 1, 0])


def test_a_narrower_batch_gives_the_policy_the_same_logprobs(tiny_llama):
    """Left padding only shifts the prompt: positions come from the attention mask, so the
    response log-probs of the bucketed width equal those of the full max_prompt_tokens width."""
    from jaxrlhf.models import load_pretrained, logprobs_from_logits

    model, params = load_pretrained(tiny_llama)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 200, size=n).tolist() for n in (9, 3, 14)]
    responses = [rng.integers(1, 200, size=n).tolist() for n in (4, 6, 1)]
    batch = rollout(prompts, responses)

    def response_logprobs(width):
        arrays = rollout_arrays(batch, PAD, width, 6)
        logits = model.apply({"params": params}, arrays.input_ids, arrays.attention_mask)
        lp = np.asarray(logprobs_from_logits(logits[:, :-1], arrays.input_ids[:, 1:]))
        return [row[mask > 0] for row, mask in zip(lp, arrays.loss_mask, strict=True)]

    narrow, full = response_logprobs(prompt_width(batch, 64, 16)), response_logprobs(64)
    assert prompt_width(batch, 64, 16) == 16
    for a, b in zip(narrow, full, strict=True):
        np.testing.assert_allclose(a, b, atol=2e-5)
