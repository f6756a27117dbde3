"""Truncated importance weights and the sampler/learner log-prob gap metrics."""

import math

import jax
import jax.numpy as jnp
import numpy as np
from numpy.testing import assert_allclose

from jaxrlhf.losses import logprob_gap_metrics, truncated_importance_weights

LEARNER = np.array([[-1.0, -2.0, -0.5, 7.0]], np.float32)
SAMPLER = np.array([[-1.5, -2.0, -3.0, 0.0]], np.float32)
MASK = np.array([[1, 1, 1, 0]])


def test_weights_are_truncated_ratios():
    weights = truncated_importance_weights(LEARNER[0, :3], SAMPLER[0, :3], cap=2.0)
    assert_allclose(weights, [math.exp(0.5), 1.0, 2.0], rtol=1e-6)  # exp(2.5) capped at 2


def test_weights_carry_no_gradient():
    grad = jax.grad(lambda lp: jnp.sum(truncated_importance_weights(lp, SAMPLER)))(
        jnp.asarray(LEARNER)
    )
    assert_allclose(grad, np.zeros_like(LEARNER))


def test_gap_metrics_by_hand():
    metrics = logprob_gap_metrics(LEARNER, SAMPLER, MASK)
    gaps = [0.5, 0.0, 2.5]  # the padding token (gap 7) is ignored
    assert_allclose(metrics["mean_abs_gap"], sum(gaps) / 3, rtol=1e-6)
    assert_allclose(metrics["max_abs_gap"], 2.5, rtol=1e-6)
    kl = sum(math.exp(d) - 1 - d for d in gaps) / 3
    assert_allclose(metrics["kl_sampler_learner"], kl, rtol=1e-5)
    jitted = jax.jit(logprob_gap_metrics)(LEARNER, SAMPLER, MASK)
    assert_allclose(jitted["mean_abs_gap"], metrics["mean_abs_gap"])
