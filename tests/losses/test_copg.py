"""CoPG against hand-computed values, and its documented links to RLOO and IPO."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numpy.testing import assert_allclose

from jaxrlhf.losses import (
    copg_loss,
    group_pair_indices,
    online_dpo_loss,
    rloo_advantages,
    rloo_loss,
)

BETA = 0.1


def test_loss_by_hand():
    # Pair 0: implicit gap 0.1·((−10 + 11) − (−12 + 11)) = 0.2, Δ = (1 − 0) − 0.2 = 0.8.
    # Pair 1: implicit gap 0, Δ = 0 − 2 = −2.
    loss, metrics = copg_loss(
        first_logps=[-10.0, -5.0],
        second_logps=[-12.0, -5.0],
        ref_first_logps=[-11.0, -5.0],
        ref_second_logps=[-11.0, -5.0],
        first_rewards=[1.0, 0.0],
        second_rewards=[0.0, 2.0],
        beta=BETA,
    )
    assert_allclose(loss, (0.8**2 + 2.0**2) / 2 / (4 * BETA), rtol=1e-5)
    assert_allclose(metrics["reward_gap"], (1.0 + 2.0) / 2)
    assert_allclose(metrics["implicit_gap"], 0.2 / 2, rtol=1e-5)
    assert_allclose(metrics["residual_rms"], np.sqrt((0.64 + 4.0) / 2), rtol=1e-5)
    assert_allclose(metrics["accuracy"], 0.5)  # pair 0 agrees in sign, pair 1 (gap 0) does not


def test_gradient_equals_rloo_k2_on_policy():
    # With π_old = π_θ and kl_coef = β, RLOO's advantage of y is exactly CoPG's Δ.
    rng = np.random.default_rng(0)
    logps = rng.normal(-20.0, 3.0, 6).astype(np.float32)  # 3 prompts × k = 2
    ref = logps + rng.normal(0.0, 0.5, 6).astype(np.float32)
    scores = rng.normal(size=6).astype(np.float32)
    rewards = scores - BETA * (logps - ref)
    advantages = rloo_advantages(rewards, 2)
    rloo_grad = jax.grad(lambda new: rloo_loss(new, logps, advantages)[0])(jnp.asarray(logps))

    first, second = group_pair_indices(3, 2)

    def loss_fn(all_logps):
        pair_args = (all_logps[first], all_logps[second], ref[first], ref[second])
        return copg_loss(*pair_args, scores[first], scores[second], BETA)[0]

    assert_allclose(jax.grad(loss_fn)(jnp.asarray(logps)), rloo_grad, rtol=1e-4, atol=1e-6)


def test_reward_gap_of_one_half_is_ipo_times_beta_over_four():
    args = (np.array([-10.0]), np.array([-14.0]), np.array([-11.0]), np.array([-13.0]))
    copg, _ = copg_loss(*args, np.array([0.5]), np.array([0.0]), BETA)
    ipo, _ = online_dpo_loss(*args, BETA, loss_type="ipo")
    assert_allclose(copg, BETA / 4 * ipo, rtol=1e-5)


def test_gradient_direction_and_invalid_pairs():
    def loss_fn(first):
        zeros, ones = jnp.zeros(2), jnp.ones(2)
        valid = np.array([True, False])
        return copg_loss(first, zeros, zeros, zeros, ones, zeros, BETA, valid=valid)[0]

    grad = jax.grad(loss_fn)(jnp.zeros(2))
    assert grad[0] < 0  # the better sample is under-weighted: push log π(y) up
    assert grad[1] == 0.0


def test_group_pair_indices():
    first, second = group_pair_indices(2, 3)
    assert first.tolist() == [0, 0, 1, 3, 3, 4]
    assert second.tolist() == [1, 2, 2, 4, 5, 5]
    with pytest.raises(ValueError, match="k >= 2"):
        group_pair_indices(2, 1)


def test_jit_matches_eager():
    args = ([-10.0], [-12.0], [-11.0], [-11.0], [1.0], [0.0])
    args = tuple(np.asarray(a, np.float32) for a in args)
    assert_allclose(jax.jit(copg_loss)(*args, BETA)[0], copg_loss(*args, BETA)[0], rtol=1e-6)
