"""Rollout batches as the learner sees them: the prompt width of a batch, where each sampler
log-prob lands, and that a narrower (less padded) batch gives the policy the same log-probs."""

from __future__ import annotations

import ml_collections
import numpy as np
import pytest

from jaxrlhf.fleet.sample import Sample
from jaxrlhf.rl.batch import prompt_width, rollout_arrays
from jaxrlhf.rl.rollout import PromptItem, Rollout

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


def mixed_rollout() -> Rollout:
    """Two samples of one prompt generated across an in-flight swap from version 3 to 4: the
    first sampled 2 tokens on 3 and 2 on 4, the second all 3 on 4."""
    samples = [
        Sample(0, 0, (11, 12, 13, 14), (-0.5, -1.0, -0.25, -2.0), "stop", 3, (3, 3, 4, 4)),
        Sample(0, 1, (15, 16, 17), (-0.1, -0.2, -0.3), "stop", 4, (4, 4, 4)),
    ]
    return Rollout(0, [PromptItem("0", (5, 6))], samples, 3, 0.0)


def test_staleness_is_measured_per_sample_and_per_token():
    from jaxrlhf.rl.step_metrics import staleness_metrics

    batch = mixed_rollout()
    assert [s.oldest_version for s in batch.samples] == [3, 4]
    # The learner trains this batch from version 5: samples 2 and 1 versions behind (oldest
    # token); tokens 2, 2, 1, 1 and 1, 1, 1.
    metrics = staleness_metrics(batch, 5)
    assert metrics == {
        "staleness_mean": 1.5,
        "staleness_max": 2,
        "token_staleness_mean": pytest.approx(9 / 7),
        "token_staleness_max": 2,
        "mixed_version_fraction": 0.5,
    }
    # A generator that reports no per-token versions: every token is the sample's version.
    old = Sample(0, 0, (1, 2), (-1.0, -1.0), "stop", 2)
    assert old.token_versions == (2, 2) and old.oldest_version == 2
    assert Rollout.from_json(batch.to_json()).samples == batch.samples


def test_generator_occupancy_is_request_seconds_over_capacity_by_hand():
    from jaxrlhf.rl.step_metrics import occupancy_metrics

    # The learner saw 10.2 s between the readings (its answers' latencies differ); each
    # replica's own clock: A (capacity 8) 10 s, idle 2 s, 40 request-seconds (4 at a time:
    # half full); B (capacity 4) 10 s, idle 0 s, 40 request-seconds (full: by the learner's
    # 10.2 s it would read 0.98, and above 1 for a window the learner saw shorter); C answered
    # only once (left out); D reports no capacity and no uptime (a server older than both
    # fields): the learner's window, in the means, not in occupancy.
    before = {"A": (1.0, 10.0, 8, 100.0), "B": (0.0, 0.0, 4, 50.0), "D": (0.0, 0.0, 0, 0.0)}
    after = {"A": (3.0, 50.0, 8, 110.0), "B": (0.0, 40.0, 4, 60.0), "C": (0.0, 9.0, 4, 9.0),
             "D": (4.0, 10.2, 0, 0.0)}  # fmt: skip
    assert occupancy_metrics(before, after, 10.2) == {
        "generator_window_s": pytest.approx((10.0 + 10.0 + 10.2) / 3),
        "generator_idle_s": pytest.approx((2.0 + 0.0 + 4.0) / 3),
        "generator_requests_mean": pytest.approx((4.0 + 4.0 + 1.0) / 3),
        "generator_occupancy": pytest.approx((4 / 8 + 4 / 4) / 2),
    }
    assert occupancy_metrics({}, after, 10.0) == {}


def test_engine_occupancy_counts_at_most_its_capacity(monkeypatch):
    from generator_service import engine

    clock = iter([0.0, 1.0, 3.0, 4.0, 5.0, 6.0, 6.0])
    monkeypatch.setattr(engine.time, "monotonic", lambda: next(clock))
    occupancy = engine.Occupancy(capacity=2)  # t = 0
    occupancy.started()  # t = 1: 1 s idle
    occupancy.started()  # t = 3: 1 running for 2 s
    occupancy.started()  # t = 4: 2 running for 1 s (a third is admitted: it queues)
    occupancy.paused(True)  # t = 5: 2 of 3 generating (the capacity) for 1 s
    assert occupancy.totals() == (2.0, 2 * 1.0 + 2 * 1.0 + 1 * 2.0)  # t = 6: paused 1 s
    assert occupancy.fraction() == pytest.approx(6.0 / (6.0 * 2))  # t = 6


def test_truncated_is_weights_take_each_tokens_own_behaviour_logprob():
    """Across a swap, each token's behaviour log-prob is the one of the weights that sampled
    it: the per-token weight min(π_old/π_sampler, cap) and the sequence weight use them."""
    from jaxrlhf.losses import LossInputs

    batch = mixed_rollout()
    arrays = rollout_arrays(batch, PAD, 2, 4)
    learner = np.zeros_like(arrays.sampler_logprobs)
    learner[0, 1:5] = [-0.4, -1.5, -0.25, -1.0]  # π_old of sample 0's tokens
    learner[1, 1:4] = [-0.1, -0.2, -0.3]
    inputs = LossInputs(
        arrays.input_ids, arrays.attention_mask, arrays.loss_mask, np.zeros(2), 2,
        arrays.sampler_logprobs, learner,
    )  # fmt: skip
    cap = 2.0
    settings = ml_collections.ConfigDict(
        {"is_correction": "truncate", "truncated_is_cap": cap, "is_low": 0.0, "is_high": 0.0}
    )
    token = inputs.correction(settings, per="token").weights
    sampler = np.array([-0.5, -1.0, -0.25, -2.0])
    expected = np.minimum(np.exp(np.array([-0.4, -1.5, -0.25, -1.0]) - sampler), cap)
    np.testing.assert_allclose(token[0, 1:5], expected, rtol=1e-6)
    np.testing.assert_allclose(token[1, 1:4], 1.0, rtol=1e-6)
    sequence = inputs.correction(settings, per="sequence").weights
    np.testing.assert_allclose(sequence, [min(np.exp(-3.15 - -3.75), cap), 1.0], rtol=1e-5)
