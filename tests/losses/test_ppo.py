"""PPO: per-token rewards, GAE against a plain loop, clipped policy and value losses."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from numpy.testing import assert_allclose

from jaxrlhf.losses import (
    compute_gae,
    last_token_one_hot,
    ppo_loss,
    ppo_per_token_rewards,
    ppo_policy_loss,
    ppo_value_loss,
)

# Rows: EOS at index 2 then padding; full length; [prompt | response] layout; empty.
MASK = np.array([[1, 1, 1, 0], [1, 1, 1, 1], [0, 1, 1, 0], [0, 0, 0, 0]], np.int32)


def test_last_token_one_hot():
    expected = [[0, 0, 1, 0], [0, 0, 0, 1], [0, 0, 1, 0], [0, 0, 0, 0]]
    assert_allclose(last_token_one_hot(MASK), expected)


def test_per_token_rewards_by_hand():
    score = np.array([1.0, 2.0, 3.0, 4.0])
    old = np.array(
        [[-1.0, -2.0, -3.0, 50.0], [-1.0, -1.0, -1.0, -1.0], [9.0, -2.0, -1.0, 9.0], [1, 1, 1, 1]]
    )
    ref = np.array(
        [[-1.5, -2.0, -2.0, 0.0], [-2.0, -1.0, -0.5, -1.0], [0.0, -1.0, -1.0, 0.0], [0, 0, 0, 0]]
    )
    kl_coef = 0.05
    expected = np.array(
        [
            [-0.05 * 0.5, 0.0, -0.05 * -1.0 + 1.0, 0.0],
            [-0.05 * 1.0, 0.0, -0.05 * -0.5, 2.0],
            [0.0, -0.05 * -1.0, 0.0 + 3.0, 0.0],
            [0.0, 0.0, 0.0, 0.0],  # no real token: the score has nowhere to go
        ]
    )
    assert_allclose(ppo_per_token_rewards(score, old, ref, MASK, kl_coef), expected, atol=1e-7)


def gae_loop(rewards, values, mask, gamma, lam):
    """Reference GAE: per row, over the real tokens only, bootstrap 0 after the last one."""
    advantages = np.zeros_like(rewards, dtype=np.float64)
    for row in range(rewards.shape[0]):
        real = [t for t in range(rewards.shape[1]) if mask[row, t]]
        next_advantage, next_value = 0.0, 0.0
        for t in reversed(real):
            delta = rewards[row, t] + gamma * next_value - values[row, t]
            next_advantage = delta + gamma * lam * next_advantage
            advantages[row, t] = next_advantage
            next_value = values[row, t]
    returns = (advantages + values) * mask
    return advantages, returns


def test_gae_small_case_by_hand():
    rewards = np.array([[0.0, 1.0, 7.0]])
    values = np.array([[0.5, 0.2, 9.0]])
    mask = np.array([[1, 1, 0]])
    advantages, returns = compute_gae(rewards, values, mask, gamma=1.0, lam=0.95)
    # δ_1 = 1 + 0 − 0.2 = 0.8 = A_1;  δ_0 = 0 + 0.2 − 0.5 = −0.3, A_0 = −0.3 + 0.95·0.8 = 0.46.
    assert_allclose(advantages, [[0.46, 0.8, 0.0]], rtol=1e-6)
    assert_allclose(returns, [[0.96, 1.0, 0.0]], rtol=1e-6)


def test_gae_matches_loop_with_padding_holding_garbage():
    rng = np.random.default_rng(0)
    mask = np.array(
        [[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1], [1, 0, 0, 0, 0, 0], [0, 0, 1, 1, 1, 0]], np.int32
    )
    rewards = rng.normal(size=mask.shape).astype(np.float32)
    values = rng.normal(size=mask.shape).astype(np.float32)
    rewards[mask == 0] = 100.0
    values[mask == 0] = -50.0
    for gamma, lam in [(1.0, 0.95), (0.9, 0.8)]:
        advantages, returns = compute_gae(rewards, values, mask, gamma, lam)
        expected_advantages, expected_returns = gae_loop(rewards, values, mask, gamma, lam)
        assert_allclose(advantages, expected_advantages, rtol=1e-5, atol=1e-6)
        assert_allclose(returns, expected_returns, rtol=1e-5, atol=1e-6)


def test_gae_jit():
    rewards = np.array([[0.0, 1.0, 7.0]], np.float32)
    values = np.array([[0.5, 0.2, 9.0]], np.float32)
    mask = np.array([[1, 1, 0]])
    advantages, _ = jax.jit(compute_gae)(rewards, values, mask, 1.0, 0.95)
    assert_allclose(advantages, [[0.46, 0.8, 0.0]], rtol=1e-6)


# One row of four tokens, last one padding (holding NaN on purpose); ε = 0.2.
POLICY_MASK = np.array([[1, 1, 1, 0]], bool)
POLICY_OLD = np.array([[-1.0, -2.0, -3.0, 0.0]], np.float32)
POLICY_ADV = np.array([[1.0, 1.0, -1.0, 5.0]], np.float32)
POLICY_NEW = POLICY_OLD + np.log(np.array([[1.1, 1.5, 0.9, 1.0]], np.float32))
POLICY_NEW[0, 3] = np.nan


def test_policy_loss_by_hand():
    loss, metrics = ppo_policy_loss(POLICY_NEW, POLICY_OLD, POLICY_ADV, POLICY_MASK, clip=0.2)
    # −1.1 (inside), max(−1.5, −1.2) = −1.2 (clipped), max(0.9, 0.9) = 0.9 (inside).
    assert_allclose(loss, (-1.1 - 1.2 + 0.9) / 3, rtol=1e-5)
    assert_allclose(metrics["clipfrac"], 1 / 3, rtol=1e-6)
    assert_allclose(metrics["ratio_max"], 1.5, rtol=1e-5)
    assert_allclose(metrics["ratio_mean"], (1.1 + 1.5 + 0.9) / 3, rtol=1e-5)


def test_policy_gradient_sign_follows_advantage_and_vanishes_when_clipped():
    grad = jax.grad(lambda new: ppo_policy_loss(new, POLICY_OLD, POLICY_ADV, POLICY_MASK)[0])(
        jnp.asarray(POLICY_NEW)
    )
    assert np.all(np.isfinite(grad))
    assert_allclose(grad, [[-1.1 / 3, 0.0, 0.9 / 3, 0.0]], rtol=1e-5, atol=1e-7)


def test_value_loss_by_hand():
    new = np.array([[1.0, 0.5, 2.0, 0.5, 3.0]], np.float32)
    old = np.array([[0.9, 0.0, 2.0, 0.0, 3.0]], np.float32)
    returns = np.array([[1.5, 1.0, 0.0, 0.0, 8.0]], np.float32)
    mask = np.array([[1, 1, 1, 1, 0]])
    # t0: v inside [0.7, 1.1]: (1 − 1.5)² = 0.25.
    # t1: clip(0.5) = 0.2: max((0.5 − 1)², (0.2 − 1)²) = 0.64 from the clipped term (no gradient).
    # t2: v = v_old: (2 − 0)² = 4.
    # t3: clip(0.5) = 0.2: max(0.25, 0.04) = 0.25 from the unclipped term (gradient flows).
    (loss, metrics), grad = jax.value_and_grad(
        lambda v: ppo_value_loss(v, old, returns, mask, clip_value=0.2), has_aux=True
    )(jnp.asarray(new))
    assert_allclose(loss, 0.5 * (0.25 + 0.64 + 4.0 + 0.25) / 4, rtol=1e-5)
    assert_allclose(metrics["value_clipfrac"], 1 / 4)
    # d/dv ½(v − R)²/n = (v − R)/n on unclipped terms.
    assert_allclose(grad, [[-0.5 / 4, 0.0, 2.0 / 4, 0.5 / 4, 0.0]], rtol=1e-5, atol=1e-7)


def test_combined_loss_and_jit():
    values = np.array([[0.1, 0.2, 0.3, 0.0]], np.float32)
    returns = np.array([[1.0, 0.5, -0.5, 0.0]], np.float32)
    new = np.nan_to_num(POLICY_NEW)
    policy, _ = ppo_policy_loss(new, POLICY_OLD, POLICY_ADV, POLICY_MASK)
    value, _ = ppo_value_loss(values + 0.1, values, returns, POLICY_MASK)
    args = (new, POLICY_OLD, POLICY_ADV, values + 0.1, values, returns, POLICY_MASK)
    loss, metrics = ppo_loss(*args, vf_coef=0.1)
    assert_allclose(loss, float(policy) + 0.1 * float(value), rtol=1e-6)
    assert {"loss", "policy_loss", "value_loss", "clipfrac", "value_clipfrac"} <= set(metrics)
    jitted, _ = jax.jit(functools.partial(ppo_loss, vf_coef=0.1))(*args)
    assert_allclose(jitted, loss, rtol=1e-6)
