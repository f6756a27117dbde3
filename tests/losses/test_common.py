"""Masked reductions, whitening and sequence log-probs against numbers worked by hand."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numpy.testing import assert_allclose

from jaxrlhf.losses import (
    group_rewards,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    sequence_logprobs,
)

VALUES = np.array([[1.0, 2.0, 3.0, 100.0], [4.0, 5.0, -7.0, 0.0]], np.float32)
MASK = np.array([[1, 1, 1, 0], [1, 1, 0, 0]], np.int32)


def test_masked_sum_and_mean():
    assert_allclose(masked_sum(VALUES, MASK), 1 + 2 + 3 + 4 + 5)
    assert_allclose(masked_mean(VALUES, MASK), 15 / 5)
    assert_allclose(masked_sum(VALUES, MASK, axis=-1), [6.0, 9.0])
    assert_allclose(masked_mean(VALUES, MASK, axis=-1), [2.0, 4.5])


def test_masked_mean_of_empty_mask_is_zero_with_zero_gradient():
    mask = np.array([[1, 1, 0, 0], [0, 0, 0, 0]])
    assert_allclose(masked_mean(VALUES, mask, axis=-1), [1.5, 0.0])
    grad = jax.grad(lambda v: masked_mean(v, np.zeros_like(mask)))(jnp.asarray(VALUES))
    assert_allclose(grad, np.zeros_like(VALUES))


def test_nan_in_padding_does_not_leak():
    values = VALUES.copy()
    values[0, 3] = np.nan
    values[1, 2] = np.inf
    assert_allclose(masked_mean(values, MASK), 3.0)
    grad = jax.grad(lambda v: masked_mean(v, MASK))(jnp.asarray(values))
    assert np.all(np.isfinite(grad))
    assert_allclose(grad, MASK / 5.0)


def test_masked_var_unbiased_and_biased():
    # Real entries 1, 2, 3, 4, 5: mean 3, squared deviations 4+1+0+1+4 = 10.
    assert_allclose(masked_var(VALUES, MASK), 10 / 4, rtol=1e-6)
    assert_allclose(masked_var(VALUES, MASK, unbiased=False), 10 / 5, rtol=1e-6)


def test_masked_whiten_by_hand():
    scale = 1.0 / math.sqrt(2.5 + 1e-8)
    expected = np.array([[-2, -1, 0, 0], [1, 2, 0, 0]], np.float32) * scale
    assert_allclose(masked_whiten(VALUES, MASK), expected, rtol=1e-6, atol=1e-7)
    shifted = (expected + 3.0) * MASK  # the mean comes back on real entries only
    assert_allclose(masked_whiten(VALUES, MASK, shift_mean=False), shifted, rtol=1e-6)


def test_masked_whiten_matches_numpy_on_random_data():
    rng = np.random.default_rng(0)
    values = rng.normal(3.0, 2.0, (5, 7)).astype(np.float32)
    mask = (rng.random((5, 7)) < 0.6).astype(np.int32)
    real = values[mask.astype(bool)]
    expected = (values - real.mean()) / np.sqrt(real.var(ddof=1) + 1e-8) * mask
    whitened = masked_whiten(values, mask)
    assert_allclose(whitened, expected, rtol=1e-5, atol=1e-5)
    assert_allclose(np.asarray(whitened)[mask.astype(bool)].mean(), 0.0, atol=1e-5)
    assert_allclose(np.asarray(whitened)[mask.astype(bool)].std(ddof=1), 1.0, rtol=1e-5)


def test_sequence_logprobs_sum_over_real_tokens():
    token_logprobs = np.array([[-1.0, -2.0, -3.0, -4.0], [-0.5, -0.25, -9.0, -9.0]])
    mask = np.array([[1, 1, 1, 0], [1, 1, 0, 0]], bool)
    assert_allclose(sequence_logprobs(token_logprobs, mask), [-6.0, -0.75])


def test_group_rewards_rejects_bad_shapes():
    assert group_rewards(np.arange(6.0), 3).shape == (2, 3)
    with pytest.raises(ValueError, match="cannot be grouped"):
        group_rewards(np.arange(5.0), 2)
    with pytest.raises(ValueError, match="positive int"):
        group_rewards(np.arange(4.0), 0)


def test_reductions_jit():
    whiten = jax.jit(masked_whiten, static_argnames=("shift_mean",))
    assert_allclose(whiten(VALUES, MASK), masked_whiten(VALUES, MASK), rtol=1e-6)
    assert_allclose(jax.jit(sequence_logprobs)(VALUES, MASK), [6.0, 9.0])
