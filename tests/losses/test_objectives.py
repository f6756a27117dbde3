"""Every registry loss, prepare + loss, against numpy written out from its docstring.

`build_objective` binds a registry entry to the run's models and nothing else, so a loss that
trains the wrong thing (a sign, an index, a normaliser, a cap) would be wrong here first. Each
test runs `spec.prepare` and the jitted `spec.loss` (with its gradient) on a small hand-made
rollout (tests/losses/table_model.py: 2 prompts × k samples, left-padded prompts, right-padded
responses of 1 to 3 tokens) through a table "policy" whose token log-probs are θ[token], and
compares the prepared batch, the loss, its metrics and ∂loss/∂θ with numpy. The expected values
never call jaxrlhf's loss code. The glue rules (when the reference is needed, the truncated-IS
config checks) are at the end.
"""

import functools
import math

import jax
import numpy as np
import pytest
from numpy.testing import assert_allclose, assert_array_equal

from jaxrlhf.config import ConfigError, base_config, validate
from jaxrlhf.losses import LOSSES, get_loss_spec
from tests.losses.table_model import (
    THETA,
    VALUE_TABLE,
    VOCAB,
    TableModel,
    make_inputs,
    table_params,
)

TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


def close(actual, expected):
    """assert_allclose at float32 tolerance."""
    assert_allclose(np.asarray(actual, np.float64), expected, **TOLERANCE)


def loss_params(**overrides):
    """The default config.loss_params with these values."""
    cfg = base_config().loss_params
    cfg.update(overrides)
    return cfg


def run(name, inputs, cfg):
    """(prepared batch, loss, metrics, ∂loss/∂params) of the registry entry `name`."""
    spec = get_loss_spec(name)
    batch = spec.prepare(inputs, cfg)
    loss_fn = functools.partial(spec.loss, TableModel(), cfg)
    (loss, metrics), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(
        table_params(), batch
    )
    close(metrics["loss"], float(loss))
    return batch, float(loss), {k: float(v) for k, v in metrics.items()}, grads


def token_logprobs(ids):
    """[N, T−1] log π_θ of each target token under the table, float64."""
    return THETA[ids[:, 1:]].astype(np.float64)


def seq(token_values, mask):
    """[N] Σ_t m_t v_t in float64."""
    return (np.asarray(token_values, np.float64) * mask).sum(-1)


def table_grad(ids, dtokens):
    """∂loss/∂θ from ∂loss/∂(token log-probs) [N, T−1]: entry t adds to θ[ids[:, t+1]]."""
    grad = np.zeros(VOCAB)
    np.add.at(grad, ids[:, 1:], dtokens)
    return grad


def clipped(log_ratio, advantages, clip):
    """PPO's surrogate per element: (loss, clipped-term-active, ρ, ∂loss/∂log ρ)."""
    ratio = np.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped_term = -advantages * np.clip(ratio, 1 - clip, 1 + clip)
    active = clipped_term > unclipped
    return np.maximum(unclipped, clipped_term), active, ratio, np.where(active, 0.0, unclipped)


def assert_rows(batch, inputs, rows, prefix=""):
    """The batch's model inputs are those of `rows` of the rollout."""
    for key in ("input_ids", "attention_mask", "loss_mask"):
        assert_array_equal(batch[prefix + key], getattr(inputs, key)[rows])


# Online DPO / IPO: (k, scores, chosen, rejected, valid). The tie gives valid 0 and the group's
# first sample twice; among equal maxima the first wins.
DPO_CASES = {
    "tie": (2, [1.0, 1.0, 0.5, 2.0], [0, 3], [0, 2], [0.0, 1.0]),
    "k4": (4, [0.5, 2.0, -1.0, 2.0, 0.0, 1.0, -2.0, 3.0], [1, 7], [2, 6], [1.0, 1.0]),
}


@pytest.mark.parametrize("case", DPO_CASES)
@pytest.mark.parametrize("name", ["online_dpo", "ipo"])
def test_online_dpo_and_ipo(name, case):
    k, scores, chosen, rejected, valid = DPO_CASES[case]
    inputs = make_inputs(scores, k)
    beta = 0.5
    batch, loss, metrics, grads = run(name, inputs, loss_params(beta=beta))

    mask, ids = inputs.loss_mask, inputs.input_ids
    ref = seq(inputs.ref_logprobs, mask)
    assert_rows(batch, inputs, chosen, "first_")
    assert_rows(batch, inputs, rejected, "second_")
    close(batch["ref_first"], ref[chosen])
    close(batch["ref_second"], ref[rejected])
    assert_array_equal(batch["reward_first"], np.float32(scores)[chosen])
    assert_array_equal(batch["reward_second"], np.float32(scores)[rejected])
    assert_array_equal(batch["valid"], valid)

    new = seq(token_logprobs(ids), mask)
    chosen_ratio, rejected_ratio = new[chosen] - ref[chosen], new[rejected] - ref[rejected]
    h = chosen_ratio - rejected_ratio
    if name == "online_dpo":
        losses, dloss_dh = np.logaddexp(0.0, -beta * h), -beta / (1.0 + np.exp(beta * h))
    else:
        losses, dloss_dh = (h - 1 / (2 * beta)) ** 2, 2 * (h - 1 / (2 * beta))
    valid = np.array(valid)

    def valid_mean(x):
        return (valid * x).sum() / valid.sum()

    close(loss, valid_mean(losses))
    close(metrics["accuracy"], valid_mean(h > 0))
    close(metrics["margins"], valid_mean(beta * h))
    close(metrics["chosen_rewards"], valid_mean(beta * chosen_ratio))
    close(metrics["rejected_rewards"], valid_mean(beta * rejected_ratio))
    close(metrics["valid_fraction"], valid.mean())

    dseq = np.zeros(len(ids))
    np.add.at(dseq, chosen, valid * dloss_dh / valid.sum())
    np.add.at(dseq, rejected, -valid * dloss_dh / valid.sum())
    close(grads["policy"]["theta"], table_grad(ids, dseq[:, None] * mask))
    assert not np.any(grads["value"]["w"])


def test_copg():
    scores = np.float32([1.0, 0.0, 1.0, 2.0, -1.0, 0.5])  # the pair (0, 2) is tied
    first, second = [0, 0, 1, 3, 3, 4], [1, 2, 2, 4, 5, 5]  # every i < j within each prompt
    inputs = make_inputs(scores, 3)
    beta = 0.5
    batch, loss, metrics, grads = run("copg", inputs, loss_params(beta=beta))

    mask, ids = inputs.loss_mask, inputs.input_ids
    ref = seq(inputs.ref_logprobs, mask)
    assert_rows(batch, inputs, first, "first_")
    assert_rows(batch, inputs, second, "second_")
    close(batch["ref_first"], ref[first])
    close(batch["ref_second"], ref[second])
    assert_array_equal(batch["reward_first"], scores[first])
    assert_array_equal(batch["reward_second"], scores[second])
    assert_array_equal(batch["valid"], np.ones(6))

    logratio = seq(token_logprobs(ids), mask) - ref
    reward_gap = scores[first].astype(np.float64) - scores[second]
    implicit_gap = beta * (logratio[first] - logratio[second])
    residual = reward_gap - implicit_gap
    close(loss, np.mean(residual**2) / (4 * beta))
    close(metrics["reward_gap"], np.abs(reward_gap).mean())
    close(metrics["implicit_gap"], np.abs(implicit_gap).mean())
    close(metrics["residual_rms"], np.sqrt(np.mean(residual**2)))
    ordered = reward_gap != 0
    accuracy = np.mean(np.sign(implicit_gap[ordered]) == np.sign(reward_gap[ordered]))
    assert 0 < accuracy < 1
    close(metrics["accuracy"], accuracy)

    # The docstring's gradient: −½ Δ (∇log π(y) − ∇log π(y′)), averaged over the pairs.
    dseq = np.zeros(len(ids))
    np.add.at(dseq, first, -residual / 2 / len(first))
    np.add.at(dseq, second, residual / 2 / len(first))
    close(grads["policy"]["theta"], table_grad(ids, dseq[:, None] * mask))


def test_best_of_k():
    scores = [0.0, 2.0, 2.0, -1.0, 0.5, 0.3]
    best = [1, 4]  # the first of equal maxima in prompt 0
    inputs = make_inputs(scores, 3)
    batch, loss, metrics, grads = run("best_of_k", inputs, loss_params())

    assert set(batch) == {"input_ids", "attention_mask", "loss_mask"}
    assert_rows(batch, inputs, best)
    ids, mask = inputs.input_ids[best], inputs.loss_mask[best]
    close(loss, -seq(token_logprobs(ids), mask).sum() / mask.sum())
    close(metrics["num_tokens"], mask.sum())
    close(grads["policy"]["theta"], table_grad(ids, -mask / mask.sum()))


@pytest.mark.parametrize(
    ("kl_coef", "cap"), [(0.3, 1.5), (0.3, 100.0), (0.0, 0.0)], ids=["cap1.5", "cap100", "nokl"]
)
def test_rloo(kl_coef, cap):
    k, scores = 3, np.float32([1.0, 0.0, 0.5, 2.0, -1.0, 0.0])
    inputs = make_inputs(scores, k, with_ref=bool(kl_coef))
    clip = 0.2
    cfg = loss_params(kl_coef=kl_coef, truncated_is_cap=cap, clip=clip)
    batch, loss, metrics, grads = run("rloo", inputs, cfg)

    mask, ids = inputs.loss_mask, inputs.input_ids
    old = seq(inputs.old_logprobs, mask)
    rewards = scores.astype(np.float64)
    if kl_coef:
        rewards = rewards - kl_coef * seq(inputs.old_logprobs - inputs.ref_logprobs, mask)
    advantages = np.array([
        rewards[i] - np.mean([rewards[j] for j in range(i - i % k, i - i % k + k) if j != i])
        for i in range(len(rewards))
    ])  # fmt: skip
    assert_rows(batch, inputs, slice(None))
    close(batch["advantages"], advantages)
    close(batch["old_logprobs"], inputs.old_logprobs)
    is_ratio = np.exp(old - seq(inputs.sampler_logprobs, mask))
    assert is_ratio.max() > 2 and is_ratio.min() < 1.5  # a cap of 2.0 or 1.5 binds on some rows
    if cap:
        assert batch["importance_weights"].shape == (len(ids),)
        close(batch["importance_weights"], np.minimum(is_ratio, cap))
    else:
        assert "importance_weights" not in batch
    weights = np.minimum(is_ratio, cap) if cap else np.ones(len(ids))

    log_ratio = seq(token_logprobs(ids), mask) - old
    losses, active, ratio, dlosses = clipped(log_ratio, advantages, clip)
    assert 0 < active.mean() < 1
    close(loss, np.mean(weights * losses))
    close(metrics["clipfrac"], active.mean())
    close(metrics["ratio_mean"], ratio.mean())
    close(metrics["ratio_max"], ratio.max())
    close(metrics["approx_kl"], 0.5 * np.mean(log_ratio**2))
    close(metrics["advantages_mean"], advantages.mean())
    dseq = weights * dlosses / len(ids)
    close(grads["policy"]["theta"], table_grad(ids, dseq[:, None] * mask))


def token_surrogate(inputs, advantages, cfg, weights=None):
    """PPO/GRPO's token-level clipped surrogate with truncated IS weights (or the given
    `weights`): (loss, metrics, ∂loss/∂token log-probs), with every mean over the batch's
    response tokens."""
    mask, ids = inputs.loss_mask, inputs.input_ids
    log_ratio = (token_logprobs(ids) - inputs.old_logprobs) * mask
    losses, active, ratio, dlosses = clipped(log_ratio, advantages, cfg.clip)
    if weights is None:
        weights = np.ones_like(mask)
    if cfg.truncated_is_cap:
        weights = np.exp(inputs.old_logprobs - inputs.sampler_logprobs)
        weights = np.minimum(weights, cfg.truncated_is_cap) * mask
    real, n = mask.astype(bool), mask.sum()
    assert 0 < active[real].mean() < 1
    metrics = {
        "policy_loss": (weights * losses)[real].sum() / n,
        "clipfrac": active[real].mean(),
        "ratio_mean": ratio[real].mean(),
        "ratio_max": ratio[real].max(),
        "approx_kl": 0.5 * (log_ratio[real] ** 2).mean(),
    }
    return metrics["policy_loss"], metrics, weights * dlosses * mask / n


def check_importance_weights(batch, inputs, cap):
    """Token-level truncated IS: min(exp(old − sampler), cap) · mask, absent without a cap."""
    if not cap:
        assert "importance_weights" not in batch
        return
    ratio = np.exp(inputs.old_logprobs - inputs.sampler_logprobs)[inputs.loss_mask > 0]
    assert ratio.max() > cap > ratio.min()
    expected = np.minimum(np.exp(inputs.old_logprobs - inputs.sampler_logprobs), cap)
    close(batch["importance_weights"], expected * inputs.loss_mask)


@pytest.mark.parametrize(("kl_coef", "cap"), [(0.3, 1.5), (0.0, 0.0)], ids=["kl", "nokl"])
def test_grpo(kl_coef, cap):
    k, scores = 4, [1.0, 0.0, 0.5, 3.0, 2.0, -1.0, 0.0, 0.5]
    inputs = make_inputs(scores, k, with_ref=bool(kl_coef))
    cfg = loss_params(kl_coef=kl_coef, truncated_is_cap=cap, clip=0.2)
    batch, loss, metrics, grads = run("grpo", inputs, cfg)

    mask, ids = inputs.loss_mask, inputs.input_ids
    groups = np.reshape(scores, (-1, k))
    advantages = np.concatenate([
        (g - g.mean()) / (np.std(g, ddof=1) + 1e-6) for g in groups
    ])  # fmt: skip
    assert_rows(batch, inputs, slice(None))
    close(batch["advantages"], advantages)
    close(batch["old_logprobs"], inputs.old_logprobs)
    check_importance_weights(batch, inputs, cap)
    assert ("ref_logprobs" in batch) == bool(kl_coef) == get_loss_spec("grpo").needs_reference(cfg)

    expected, expected_metrics, dtokens = token_surrogate(inputs, advantages[:, None], cfg)
    if kl_coef:
        close(batch["ref_logprobs"], inputs.ref_logprobs)
        q = (inputs.ref_logprobs - token_logprobs(ids)) * mask  # log π_ref − log π_θ
        expected_metrics["kl"] = ((np.exp(q) - q - 1) * mask).sum() / mask.sum()
        expected += kl_coef * expected_metrics["kl"]
        dtokens = dtokens + kl_coef * (1 - np.exp(q)) * mask / mask.sum()
    else:
        assert "kl" not in metrics
    close(loss, expected)
    for key, value in expected_metrics.items():
        close(metrics[key], value)
    close(grads["policy"]["theta"], table_grad(ids, dtokens))


def test_grpo_constant_group_has_zero_advantage():
    batch = get_loss_spec("grpo").prepare(make_inputs([1.0, 3.0, 2.0, 2.0], 2), loss_params())
    a = 1 / (np.sqrt(2) + 1e-6)  # mean 2, unbiased std √2
    close(batch["advantages"], [-a, a, 0.0, 0.0])


def gae(rewards, values, mask, gamma, lam):
    """(advantages, returns) by the docstring's recursion, one row and token at a time."""
    rewards, values = rewards * mask, values * mask
    advantages = np.zeros_like(rewards)
    for row in range(len(rewards)):
        running = 0.0
        for t in reversed(range(rewards.shape[1])):
            next_value = values[row, t + 1] if t + 1 < rewards.shape[1] else 0.0
            running = rewards[row, t] + gamma * next_value - values[row, t] + gamma * lam * running
            advantages[row, t] = running
    return advantages * mask, (advantages + values) * mask


@pytest.mark.parametrize(
    ("kl_coef", "cap", "whiten"), [(0.3, 1.5, True), (0.0, 0.0, False)], ids=["kl", "nokl"]
)
def test_ppo(kl_coef, cap, whiten):
    k, scores = 4, np.float32([1.0, -0.5, 0.3, 2.0, 0.0, 1.5, -1.0, 0.8])
    inputs = make_inputs(scores, k, with_ref=bool(kl_coef))
    cfg = loss_params(
        kl_coef=kl_coef, truncated_is_cap=cap, whiten_advantages=whiten, gamma=0.9, lam=0.8,
        clip=0.2, clip_value=0.125, vf_coef=0.3,
    )  # fmt: skip
    batch, loss, metrics, grads = run("ppo", inputs, cfg)

    mask, ids = inputs.loss_mask, inputs.input_ids
    rewards = np.zeros(mask.shape)
    if kl_coef:
        rewards -= kl_coef * (inputs.old_logprobs - inputs.ref_logprobs) * mask
    last = [np.flatnonzero(row)[-1] for row in mask]  # each response's last (EOS) token
    rewards[np.arange(len(ids)), last] += scores
    advantages, returns = gae(rewards, inputs.old_values, mask, cfg.gamma, cfg.lam)
    real = mask.astype(bool)
    if whiten:
        std = np.sqrt(np.var(advantages[real], ddof=1) + 1e-8)
        advantages = (advantages - advantages[real].mean()) / std * mask
    assert_rows(batch, inputs, slice(None))
    close(batch["advantages"], advantages)
    close(batch["returns"], returns)
    close(batch["old_logprobs"], inputs.old_logprobs)
    close(batch["old_values"], inputs.old_values)
    check_importance_weights(batch, inputs, cap)

    policy_loss, expected, dtokens = token_surrogate(inputs, advantages, cfg)
    values, old_values = VALUE_TABLE[ids[:, :-1]].astype(np.float64), inputs.old_values
    clipped_values = np.clip(values, old_values - cfg.clip_value, old_values + cfg.clip_value)
    unclipped_loss, clipped_loss = (values - returns) ** 2, (clipped_values - returns) ** 2
    value_active = clipped_loss > unclipped_loss
    assert 0 < value_active[real].mean() < 1
    expected["value_loss"] = 0.5 * np.maximum(unclipped_loss, clipped_loss)[real].mean()
    expected["value_clipfrac"] = value_active[real].mean()
    expected["value_mean"] = values[real].mean()
    close(loss, policy_loss + cfg.vf_coef * expected["value_loss"])
    for key, value in expected.items():
        close(metrics[key], value)
    close(grads["policy"]["theta"], table_grad(ids, dtokens))
    dvalues = cfg.vf_coef * np.where(value_active, 0.0, values - returns) * mask / mask.sum()
    value_grad = np.zeros(VOCAB)
    np.add.at(value_grad, ids[:, :-1], dvalues)
    close(grads["value"]["w"], value_grad)


# The masking corrections (loss_params.is_correction), by hand: r_t = exp(old − sampler).

MASKS = {  # kind: (is_low, is_high), chosen so that the table's ratios fall on both sides
    "mask": (0.9, 1.6),
    "sequence_mask": (1.1, 1.4),
}


def kept_by_hand(inputs, kind, low, high):
    """The loss mask a masking correction leaves, its token weights (M(r_t) = r_t on kept
    tokens under "mask", 1 under "sequence_mask"), and its is_* metrics, from the docstring."""
    mask = inputs.loss_mask
    real = mask > 0
    ratio = np.exp(inputs.old_logprobs.astype(np.float64) - inputs.sampler_logprobs)
    if kind == "mask":
        inside = real & (ratio >= low) & (ratio <= high)
        kept, tested = inside[real], ratio[real]
    else:
        geometric = np.exp(seq(np.log(np.where(real, ratio, 1.0)), mask) / real.sum(-1))
        inside = ((geometric >= low) & (geometric <= high))[:, None] & real
        kept, tested = (geometric >= low) & (geometric <= high), geometric
    assert 0 < kept.mean() < 1  # some kept, some dropped
    metrics = {"is_kept_fraction": kept.mean(), "is_ratio_mean": tested.mean(),
               "is_ratio_max": tested.max()}  # fmt: skip
    weights = np.where(inside, ratio, 0.0) if kind == "mask" else mask * inside
    return mask * inside, weights, metrics


@pytest.mark.parametrize("kind", MASKS)
@pytest.mark.parametrize("name", ["ppo", "grpo", "rloo"])
def test_masking_corrections(name, kind):
    """A dropped token (sequence) leaves the loss mask: zero gradient, out of the normaliser;
    a kept token's term is weighted by r_t under "mask" (inside RLOO's sequence log-probs)."""
    import dataclasses

    from jaxrlhf.losses import apply_correction

    k = 4
    scores = np.float32([1.0, -0.5, 0.3, 2.0, 0.0, 1.5, -1.0, 0.8])
    inputs = make_inputs(scores, k, with_ref=False)
    low, high = MASKS[kind]
    cfg = loss_params(is_correction=kind, is_low=low, is_high=high, kl_coef=0.0,
                      old_logprobs="learner", whiten_advantages=False, clip=0.2)  # fmt: skip
    batch, loss, metrics, grads = run(name, inputs, cfg)

    kept_mask, weights, expected_metrics = kept_by_hand(inputs, kind, low, high)
    assert_array_equal(batch["loss_mask"], kept_mask)
    weight_key = "token_weights" if name == "rloo" else "importance_weights"
    if kind == "mask":
        close(batch[weight_key] * kept_mask, weights)
    else:
        assert weight_key not in batch
    correction = apply_correction(kind, inputs.old_logprobs, inputs.sampler_logprobs,
                                  inputs.loss_mask, "token", low=low, high=high)  # fmt: skip
    for key, value in expected_metrics.items():
        close(correction.metrics[key], value)
    kept_inputs = dataclasses.replace(inputs, loss_mask=kept_mask)
    ids = inputs.input_ids
    if name == "rloo":
        rows = kept_mask.sum(-1) > 0
        assert_array_equal(batch["kept"], rows)
        assert get_loss_spec("rloo").batch_weight(batch) == rows.sum()
        grouped = scores.reshape(-1, k).astype(np.float64)
        advantages = (grouped - (grouped.sum(1, keepdims=True) - grouped) / (k - 1)).ravel()
        log_ratio = seq(token_logprobs(ids), weights) - seq(inputs.old_logprobs, weights)
        losses, _, _, dlosses = clipped(log_ratio, advantages, cfg.clip)
        close(loss, losses[rows].mean())
        dtokens = (rows * dlosses / rows.sum())[:, None] * weights
    else:
        assert get_loss_spec(name).batch_weight(batch) == kept_mask.sum()
        if name == "grpo":
            grouped = scores.reshape(-1, k)
            advantages = np.concatenate(
                [(g - g.mean()) / (np.std(g, ddof=1) + 1e-6) for g in grouped]
            )[:, None]
        else:  # ppo: GAE on the whole response, then the kept tokens' terms
            rewards = np.zeros(inputs.loss_mask.shape)
            last = [np.flatnonzero(row)[-1] for row in inputs.loss_mask]
            rewards[np.arange(len(ids)), last] += scores
            advantages, _ = gae(rewards, inputs.old_values, inputs.loss_mask, cfg.gamma, cfg.lam)
        policy_loss, expected, dtokens = token_surrogate(kept_inputs, advantages, cfg, weights)
        close(metrics["policy_loss"] if name == "ppo" else loss, policy_loss)
        for key, value in expected.items():
            close(metrics[key], value)
    close(grads["policy"]["theta"], table_grad(ids, dtokens))


def test_truncation_metrics_and_correction_defaults():
    from jaxrlhf.losses import apply_correction
    from jaxrlhf.losses.importance import correction_kind, correction_range

    inputs = make_inputs([0.0] * 8, 4)
    real = inputs.loss_mask > 0
    ratio = np.exp(inputs.old_logprobs.astype(np.float64) - inputs.sampler_logprobs)[real]
    correction = apply_correction("truncate", inputs.old_logprobs, inputs.sampler_logprobs,
                                  inputs.loss_mask, "token", cap=1.5)  # fmt: skip
    close(correction.metrics["is_kept_fraction"], np.mean(ratio <= 1.5))
    close(correction.metrics["is_ratio_max"], ratio.max())
    assert apply_correction("none", inputs.old_logprobs, inputs.sampler_logprobs,
                            inputs.loss_mask, "token") is None  # fmt: skip
    assert correction_range("mask", None, None) == (0.5, 2.0)  # None: the default
    assert correction_range("sequence_mask", None, 3.0) == (0.99, 3.0)
    assert correction_range("mask", 0.0, math.inf) == (0.0, math.inf)  # no bounds
    assert correction_kind(loss_params(truncated_is_cap=2.0)) == "truncate"  # the old setting
    assert correction_kind(loss_params(is_correction="mask")) == "mask"


@pytest.mark.parametrize(
    "params, message",
    [
        ({"is_correction": "clip"}, "is_correction='clip': one of none, truncate, mask"),
        ({"is_correction": "truncate"}, "is_correction='truncate' needs truncated_is_cap > 0"),
        ({"is_correction": "mask", "truncated_is_cap": 2.0}, "the cap belongs to 'truncate'"),
        (
            {"is_correction": "mask", "is_low": 1.2},
            "[1.2, 2.0] of is_correction='mask' must hold a ratio of 1",
        ),
        ({"is_correction": "sequence_mask", "old_logprobs": "sampler"}, "corrects twice"),
    ],
)
def test_correction_settings_are_checked(params, message):
    import re

    validate(rlhf_config("grpo", is_correction="mask", old_logprobs="learner"))
    params = {"old_logprobs": "learner"} | params
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(rlhf_config("grpo", **params))
    with pytest.raises(ConfigError, match="loss 'copg' has no importance ratio"):
        validate(rlhf_config("copg", is_correction="mask", old_logprobs="learner"))


# Glue: when the reference forward runs, and which truncated-IS configs a run accepts.

REFERENCE_NEEDED = {  # name: (needed with kl_coef > 0, needed with kl_coef = 0)
    "online_dpo": (True, True),
    "ipo": (True, True),
    "copg": (True, True),
    "ppo": (True, False),
    "rloo": (True, False),
    "grpo": (True, False),
    "best_of_k": (False, False),
}


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_needs_reference_follows_kl_coef(name):
    spec = get_loss_spec(name)
    needed = (
        spec.needs_reference(loss_params(kl_coef=0.05)),
        spec.needs_reference(loss_params(kl_coef=0.0)),
    )
    assert needed == REFERENCE_NEEDED[name]


def rlhf_config(loss, **params):
    """base_config() (the RLHF stage) with this loss and loss_params."""
    config = base_config()
    config.stage, config.loss = "rlhf", loss
    config.loss_params.update(params)
    return config


def test_truncated_is_needs_the_learner_recompute():
    validate(rlhf_config("rloo", truncated_is_cap=2.0, old_logprobs="learner"))
    validate(rlhf_config("grpo", truncated_is_cap=0.0, old_logprobs="sampler"))
    with pytest.raises(ConfigError, match="corrects twice.*old_logprobs='learner'"):
        validate(rlhf_config("rloo", truncated_is_cap=2.0, old_logprobs="sampler"))


def test_truncated_is_needs_an_importance_ratio():
    with pytest.raises(ConfigError, match="loss 'online_dpo' has no importance ratio"):
        validate(rlhf_config("online_dpo", truncated_is_cap=2.0, old_logprobs="learner"))


@pytest.mark.parametrize(
    ("low", "high", "kept"),
    [
        (None, None, [False, True, True, True, False]),  # the default [0.5, 2.0]
        (0.0, None, [True, True, True, True, False]),  # no lower bound
        (None, math.inf, [False, True, True, True, True]),  # no upper bound
        (0.0, math.inf, [True, True, True, True, True]),  # neither: every token kept
    ],
)
def test_a_mask_can_say_no_bound_and_keeps_its_default(low, high, kept):
    """Ratios r_t = 0.1, 0.6, 1.0, 1.9, 8.0 by hand: None is the default range, 0 no lower and
    inf no upper bound (loss_params.is_low / is_high)."""
    from jaxrlhf.losses import apply_correction

    ratios = np.array([[0.1, 0.6, 1.0, 1.9, 8.0]])
    sampler = np.full_like(ratios, -1.0)
    correction = apply_correction("mask", sampler + np.log(ratios), sampler,
                                  np.ones_like(ratios), "token", low=low, high=high)  # fmt: skip
    assert correction.loss_mask[0].astype(bool).tolist() == kept
