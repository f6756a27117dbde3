"""Online DPO / IPO against hand-computed values, pair selection, and gradient directions."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numpy.testing import assert_allclose

from jaxrlhf.losses import online_dpo_loss, select_pairs

# Two pairs. h_0 = (−10 − −14) − (−11 − −13) = 4 − 2 = 2;  h_1 = (−12 − −11) − (−12 − −12) = −1.
CHOSEN = np.array([-10.0, -12.0], np.float32)
REJECTED = np.array([-14.0, -11.0], np.float32)
REF_CHOSEN = np.array([-11.0, -12.0], np.float32)
REF_REJECTED = np.array([-13.0, -12.0], np.float32)
BETA = 0.1


def neg_log_sigmoid(x):
    return math.log(1.0 + math.exp(-x))


def test_sigmoid_loss_and_metrics_by_hand():
    loss, metrics = online_dpo_loss(CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, BETA)
    expected = (neg_log_sigmoid(0.1 * 2) + neg_log_sigmoid(0.1 * -1)) / 2
    assert_allclose(loss, expected, rtol=1e-6)
    assert_allclose(metrics["loss"], expected, rtol=1e-6)
    assert_allclose(metrics["accuracy"], 0.5)
    # chosen rewards β(logπ − logπ_ref): 0.1·1, 0.1·0; rejected: 0.1·(−1), 0.1·1.
    assert_allclose(metrics["chosen_rewards"], 0.05, rtol=1e-6)
    assert_allclose(metrics["rejected_rewards"], 0.0, atol=1e-7)
    assert_allclose(metrics["margins"], 0.1 * (2 - 1) / 2, rtol=1e-6)
    assert_allclose(metrics["valid_fraction"], 1.0)


def test_ipo_loss_by_hand():
    loss, _ = online_dpo_loss(CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, BETA, loss_type="ipo")
    # 1/(2β) = 5: (2 − 5)² = 9, (−1 − 5)² = 36.
    assert_allclose(loss, (9 + 36) / 2, rtol=1e-6)


def test_sigmoid_loss_is_stable_for_large_margins():
    loss, _ = online_dpo_loss([-1e4], [0.0], [0.0], [0.0], beta=1.0)
    assert_allclose(loss, 1e4, rtol=1e-6)  # −log σ(−1e4) = 1e4 + log(1 + e^−1e4)
    loss, _ = online_dpo_loss([1e4], [0.0], [0.0], [0.0], beta=1.0)
    assert_allclose(loss, 0.0, atol=1e-6)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_gradient_pushes_chosen_up_and_rejected_down(loss_type):
    def loss_fn(chosen, rejected):
        return online_dpo_loss(chosen, rejected, REF_CHOSEN, REF_REJECTED, BETA, loss_type)[0]

    grad_chosen, grad_rejected = jax.grad(loss_fn, argnums=(0, 1))(
        jnp.asarray(CHOSEN), jnp.asarray(REJECTED)
    )
    assert np.all(np.asarray(grad_chosen) < 0)
    assert np.all(np.asarray(grad_rejected) > 0)
    if loss_type == "sigmoid":
        # d/dc [−log σ(βh)] / N = −β σ(−βh) / N.
        expected = [-BETA / (1 + math.exp(BETA * h)) / 2 for h in (2.0, -1.0)]
        assert_allclose(grad_chosen, expected, rtol=1e-5)
        assert_allclose(grad_rejected, [-g for g in expected], rtol=1e-5)


def test_reference_logprobs_get_no_gradient():
    grad_ref = jax.grad(lambda ref: online_dpo_loss(CHOSEN, REJECTED, ref, REF_REJECTED, BETA)[0])(
        jnp.asarray(REF_CHOSEN)
    )
    assert_allclose(grad_ref, [0.0, 0.0])


def test_invalid_pairs_are_excluded_from_mean_and_gradient():
    valid = np.array([True, False])

    def loss_fn(chosen):
        return online_dpo_loss(chosen, REJECTED, REF_CHOSEN, REF_REJECTED, BETA, valid=valid)

    (loss, metrics), grad = jax.value_and_grad(loss_fn, has_aux=True)(jnp.asarray(CHOSEN))
    assert_allclose(loss, neg_log_sigmoid(0.2), rtol=1e-6)
    assert grad[1] == 0.0 and grad[0] < 0
    assert_allclose(metrics["accuracy"], 1.0)
    assert_allclose(metrics["valid_fraction"], 0.5)


def test_all_ties_give_zero_loss_and_zero_gradient():
    valid = np.zeros(2, bool)
    grads = jax.grad(
        lambda c, r: online_dpo_loss(c, r, REF_CHOSEN, REF_REJECTED, BETA, valid=valid)[0],
        argnums=(0, 1),
    )(jnp.asarray(CHOSEN), jnp.asarray(REJECTED))
    assert_allclose(grads[0], [0.0, 0.0])
    assert_allclose(grads[1], [0.0, 0.0])
    loss, _ = online_dpo_loss(CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, BETA, valid=valid)
    assert loss == 0.0


def test_select_pairs_k2_with_a_tie():
    rewards = np.array([1.0, 3.0, 2.0, 2.0, 5.0, -1.0])
    chosen, rejected, valid = select_pairs(rewards, 2)
    assert chosen.tolist() == [1, 2, 4]
    assert rejected.tolist() == [0, 2, 5]
    assert valid.tolist() == [True, False, True]


def test_select_pairs_k4_takes_argmax_and_argmin_within_each_prompt():
    rewards = np.array([0.1, 0.5, 0.5, -0.2, 7.0, 7.0, 7.0, 7.0, 0.0, -3.0, 4.0, 1.0])
    chosen, rejected, valid = select_pairs(rewards, 4)
    assert chosen.tolist() == [1, 4, 10]  # first of the tied maxima in prompt 0
    assert rejected.tolist() == [3, 4, 9]
    assert valid.tolist() == [True, False, True]


def test_select_pairs_rejects_bad_k():
    with pytest.raises(ValueError, match="k >= 2"):
        select_pairs(np.zeros(4), 1)
    with pytest.raises(ValueError, match="cannot be grouped"):
        select_pairs(np.zeros(5), 2)


def test_unknown_loss_type():
    with pytest.raises(ValueError, match="loss_type 'hinge'"):
        online_dpo_loss(CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, BETA, loss_type="hinge")


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_jit_matches_eager(loss_type):
    valid = np.array([True, False])
    eager = online_dpo_loss(CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, BETA, loss_type, valid)
    jitted = jax.jit(functools.partial(online_dpo_loss, loss_type=loss_type))(
        CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED, BETA, valid=valid
    )
    assert_allclose(jitted[0], eager[0], rtol=1e-6)
    for name in eager[1]:
        assert_allclose(jitted[1][name], eager[1][name], rtol=1e-6)
    pairs = jax.jit(select_pairs, static_argnums=1)(np.array([1.0, 3.0, 2.0, 2.0]), 2)
    assert [p.tolist() for p in pairs] == [[1, 2], [0, 2], [True, False]]
