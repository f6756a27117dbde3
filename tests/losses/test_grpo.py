"""GRPO: group-normalised advantages and the token-level loss with its optional k3 KL."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numpy.testing import assert_allclose

from jaxrlhf.losses import grpo_advantages, grpo_loss


def test_advantages_k2():
    # mean 2, unbiased std sqrt((1 + 1)/1) = √2.
    expected = [-1 / (math.sqrt(2) + 1e-6), 1 / (math.sqrt(2) + 1e-6)]
    assert_allclose(grpo_advantages(np.array([1.0, 3.0]), 2), expected, rtol=1e-6)


def test_advantages_k4_and_a_constant_group():
    rewards = np.array([0.0, 1.0, 1.0, 0.0, 5.0, 5.0, 5.0, 5.0])
    std = math.sqrt(4 * 0.25 / 3)  # mean 0.5, unbiased variance 1/3
    a = 0.5 / (std + 1e-6)
    assert_allclose(grpo_advantages(rewards, 4), [-a, a, a, -a, 0, 0, 0, 0], rtol=1e-6)


def test_advantages_need_two_samples():
    with pytest.raises(ValueError, match="k >= 2"):
        grpo_advantages(np.zeros(2), 1)


# Two sequences of three tokens; the second has one real token.
MASK = np.array([[1, 1, 1], [1, 0, 0]], bool)
OLD = np.array([[-1.0, -2.0, -3.0], [-1.0, 0.0, 0.0]], np.float32)
NEW = OLD + np.log(np.array([[1.0, 1.5, 0.9], [1.1, 1.0, 1.0]], np.float32))
ADVANTAGES = np.array([1.0, -2.0], np.float32)


def test_loss_broadcasts_the_sequence_advantage_by_hand():
    loss, metrics = grpo_loss(NEW, OLD, ADVANTAGES, MASK)
    # Row 0 (A = 1): −1.0, max(−1.5, −1.2) = −1.2, −0.9. Row 1 (A = −2): 2·1.1 = 2.2.
    assert_allclose(loss, (-1.0 - 1.2 - 0.9 + 2.2) / 4, rtol=1e-5)
    assert_allclose(metrics["clipfrac"], 1 / 4)
    grad = jax.grad(lambda new: grpo_loss(new, OLD, ADVANTAGES, MASK)[0])(jnp.asarray(NEW))
    assert_allclose(grad, [[-1.0 / 4, 0.0, -0.9 / 4], [2.2 / 4, 0.0, 0.0]], rtol=1e-5, atol=1e-7)


def test_k3_kl_term_by_hand():
    ref = OLD + np.array([[0.5, 0.0, 0.0], [-0.25, 0.0, 0.0]], np.float32)
    base, _ = grpo_loss(NEW, OLD, ADVANTAGES, MASK)
    loss, metrics = grpo_loss(NEW, OLD, ADVANTAGES, MASK, ref_logprobs=ref, kl_coef=0.04)
    q = [0.5, -math.log(1.5), -math.log(0.9), -0.25 - math.log(1.1)]  # log π_ref − log π_θ
    kl = sum(math.exp(x) - x - 1 for x in q) / 4
    assert_allclose(metrics["kl"], kl, rtol=1e-5)
    assert_allclose(loss, float(base) + 0.04 * kl, rtol=1e-5)


def test_kl_without_reference_is_an_error():
    with pytest.raises(ValueError, match="needs ref_logprobs"):
        grpo_loss(NEW, OLD, ADVANTAGES, MASK, kl_coef=0.1)


def test_jit_matches_eager():
    ref = OLD - 0.1
    eager, _ = grpo_loss(NEW, OLD, ADVANTAGES, MASK, 0.2, ref, 0.04)
    jitted, _ = jax.jit(grpo_loss)(NEW, OLD, ADVANTAGES, MASK, 0.2, ref, 0.04)
    assert_allclose(jitted, eager, rtol=1e-6)
    advantages = jax.jit(grpo_advantages, static_argnums=1)(np.array([1.0, 3.0]), 2)
    assert_allclose(advantages, grpo_advantages(np.array([1.0, 3.0]), 2))
