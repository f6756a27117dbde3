"""Best-of-K selection and the SFT NLL loss."""

import jax
import jax.numpy as jnp
import numpy as np
from numpy.testing import assert_allclose

from jaxrlhf.losses import best_of_k_indices, sft_nll_loss


def test_best_of_k_indices():
    rewards = np.array([1.0, 5.0, 5.0, 0.0, -1.0, -2.0])
    assert best_of_k_indices(rewards, 3).tolist() == [1, 3]  # first of tied maxima
    assert best_of_k_indices(rewards, 2).tolist() == [1, 2, 4]
    jitted = jax.jit(best_of_k_indices, static_argnums=1)(rewards, 3)
    assert jitted.tolist() == [1, 3]


def test_sft_nll_loss_by_hand():
    token_logprobs = np.array([[-1.0, -2.0, np.nan], [-3.0, -9.0, -9.0]], np.float32)
    mask = np.array([[1, 1, 0], [1, 0, 0]])
    (loss, metrics), grad = jax.value_and_grad(lambda lp: sft_nll_loss(lp, mask), has_aux=True)(
        jnp.asarray(token_logprobs)
    )
    assert_allclose(loss, (1.0 + 2.0 + 3.0) / 3, rtol=1e-6)
    assert metrics["num_tokens"] == 3
    assert_allclose(grad, -mask / 3)
    assert_allclose(jax.jit(sft_nll_loss)(token_logprobs, mask)[0], 2.0, rtol=1e-6)
