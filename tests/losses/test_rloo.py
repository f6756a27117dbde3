"""RLOO advantages and the sequence-level clipped loss against hand-computed values."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numpy.testing import assert_allclose

from jaxrlhf.losses import kl_penalized_rewards, rloo_advantages, rloo_loss


def test_advantages_k2():
    # k = 2: the baseline is the other sample's reward.
    assert_allclose(rloo_advantages(np.array([1.0, 3.0, 0.5, 0.5]), 2), [-2.0, 2.0, 0.0, 0.0])


def test_advantages_k4():
    rewards = np.array([1.0, 2.0, 3.0, 6.0, 0.0, 0.0, 0.0, 4.0])
    expected = [
        1 - (2 + 3 + 6) / 3,
        2 - (1 + 3 + 6) / 3,
        3 - (1 + 2 + 6) / 3,
        6 - (1 + 2 + 3) / 3,
        0 - 4 / 3,
        0 - 4 / 3,
        0 - 4 / 3,
        4 - 0,
    ]
    advantages = rloo_advantages(rewards, 4)
    assert_allclose(advantages, expected, rtol=1e-6)
    assert_allclose(np.asarray(advantages).reshape(2, 4).sum(axis=1), [0.0, 0.0], atol=1e-6)


def test_advantages_need_two_samples():
    with pytest.raises(ValueError, match="k >= 2"):
        rloo_advantages(np.zeros(3), 1)


def test_kl_penalized_rewards_by_hand():
    scores = np.array([1.0, 2.0])
    old = np.array([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]])
    ref = np.array([[-1.5, -2.0, -2.0], [-1.0, -2.0, 9.0]])
    mask = np.array([[1, 1, 1], [1, 1, 0]])
    # Row 0: Σ(old − ref) = 0.5 + 0 − 1 = −0.5. Row 1: 0 + 1 (the third token is padding) = 1.
    expected = [1.0 - 0.05 * -0.5, 2.0 - 0.05 * 1.0]
    assert_allclose(kl_penalized_rewards(scores, old, ref, mask, 0.05), expected, rtol=1e-6)


# Four sequences at ratios inside / beyond the 0.2 clip range for both advantage signs.
ADVANTAGES = np.array([1.0, 1.0, -1.0, -1.0], np.float32)
RATIOS = np.array([1.1, 1.5, 1.1, 0.5], np.float32)
OLD = np.array([-20.0, -30.0, -25.0, -12.0], np.float32)
NEW = OLD + np.log(RATIOS)


def test_loss_and_metrics_by_hand():
    loss, metrics = rloo_loss(NEW, OLD, ADVANTAGES, clip=0.2)
    # max(−Aρ, −A clip(ρ)): −1.1 (inside), −1.2 (clipped at 1.2), 1.1 (inside), 0.8 (clipped).
    assert_allclose(loss, (-1.1 - 1.2 + 1.1 + 0.8) / 4, rtol=1e-5, atol=1e-6)
    assert_allclose(metrics["clipfrac"], 0.5)
    assert_allclose(metrics["ratio_mean"], (1.1 + 1.5 + 1.1 + 0.5) / 4, rtol=1e-5)
    assert_allclose(metrics["ratio_max"], 1.5, rtol=1e-5)
    log_ratios = [math.log(r) for r in (1.1, 1.5, 1.1, 0.5)]
    assert_allclose(metrics["approx_kl"], 0.5 * sum(x * x for x in log_ratios) / 4, rtol=1e-4)


def test_gradient_follows_advantage_inside_clip_and_vanishes_when_clipped():
    grad = jax.grad(lambda new: rloo_loss(new, OLD, ADVANTAGES)[0])(jnp.asarray(NEW))
    # d/dlogπ of −Aρ/N is −Aρ/N inside the range; 0 where the clipped term is active.
    assert_allclose(grad, [-1.1 / 4, 0.0, 1.1 / 4, 0.0], rtol=1e-5, atol=1e-7)


def test_pessimistic_side_is_not_clipped():
    # A > 0 with ρ < 1−ε, and A < 0 with ρ > 1+ε: the unclipped term is larger, gradient flows.
    ratios = np.array([0.5, 1.5], np.float32)
    old = np.zeros(2, np.float32)
    advantages = np.array([2.0, -2.0], np.float32)
    (loss, metrics), grad = jax.value_and_grad(
        lambda new: rloo_loss(new, old, advantages), has_aux=True
    )(jnp.log(ratios))
    assert_allclose(loss, (-2.0 * 0.5 + 2.0 * 1.5) / 2, rtol=1e-6)
    assert_allclose(grad, [-2.0 * 0.5 / 2, 2.0 * 1.5 / 2], rtol=1e-6)
    assert metrics["clipfrac"] == 0.0


def test_importance_weights_scale_the_loss():
    weights = np.array([2.0, 1.0, 1.0, 0.5], np.float32)
    loss, _ = rloo_loss(NEW, OLD, ADVANTAGES, importance_weights=weights)
    assert_allclose(loss, (-2.2 - 1.2 + 1.1 + 0.4) / 4, rtol=1e-5)


def test_old_logprobs_and_advantages_get_no_gradient():
    grads = jax.grad(lambda old, adv: rloo_loss(NEW, old, adv)[0], argnums=(0, 1))(
        jnp.asarray(OLD), jnp.asarray(ADVANTAGES)
    )
    assert_allclose(grads[0], np.zeros(4))
    assert_allclose(grads[1], np.zeros(4))


def test_jit_matches_eager():
    eager = rloo_loss(NEW, OLD, ADVANTAGES, 0.2)
    jitted = jax.jit(rloo_loss)(NEW, OLD, ADVANTAGES, 0.2)
    assert_allclose(jitted[0], eager[0], rtol=1e-6)
    advantages = jax.jit(rloo_advantages, static_argnums=1)(np.array([1.0, 3.0]), 2)
    assert_allclose(advantages, [-2.0, 2.0])
