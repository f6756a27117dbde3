"""The loss registry: names, frozen specs, what each entry says it needs, its start-up check,
the IPO entry, and that every entry's prepare + loss runs.

A trainer decides from these fields which forwards to run (reference, value model, learner
recompute) and which configs to refuse, so a wrong flag silently changes what a run trains.
Exact values and gradients of each loss are tested in tests/losses/test_objectives.py.
"""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from numpy.testing import assert_allclose

from jaxrlhf.config import base_config
from jaxrlhf.losses import LOSSES, LossSpec, get_loss_spec
from tests.losses.table_model import TableModel, make_inputs, table_params

NAMES = {"online_dpo", "ipo", "ppo", "rloo", "grpo", "copg", "best_of_k"}


def test_known_names():
    assert set(LOSSES) == NAMES
    for name in NAMES:
        assert get_loss_spec(name).name == name


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown loss 'dpo'") as error:
        get_loss_spec("dpo")
    for name in NAMES:
        assert name in str(error.value)


def test_specs_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        get_loss_spec("ppo").needs_value_model = False
    with pytest.raises(TypeError):
        LOSSES["new"] = get_loss_spec("ppo")


def test_spec_rejects_an_unknown_reference_use():
    spec = get_loss_spec("rloo")
    with pytest.raises(ValueError, match="reference must be one of"):
        dataclasses.replace(spec, reference="sometimes")


# name: (reference, importance_ratio, pairwise, needs_value_model, min_samples_per_prompt)
REQUIREMENTS = {
    "online_dpo": ("always", False, True, False, 2),
    "ipo": ("always", False, True, False, 2),
    "copg": ("always", False, True, False, 2),
    "ppo": ("kl", True, False, True, 1),
    "rloo": ("kl", True, False, False, 2),
    "grpo": ("kl", True, False, False, 2),
    "best_of_k": ("never", False, False, False, 2),
}


@pytest.mark.parametrize("name", sorted(NAMES))
def test_requirements(name):
    spec = get_loss_spec(name)
    fields = (
        spec.reference,
        spec.importance_ratio,
        spec.pairwise,
        spec.needs_value_model,
        spec.min_samples_per_prompt,
    )
    assert fields == REQUIREMENTS[name]


def test_check_rejects_bad_configs():
    get_loss_spec("rloo").check(samples_per_prompt=4)
    with pytest.raises(ValueError, match="at least 2 samples per prompt, got 1"):
        get_loss_spec("online_dpo").check(samples_per_prompt=1)
    with pytest.raises(ValueError, match="value model"):
        get_loss_spec("ppo").check(samples_per_prompt=1)
    get_loss_spec("ppo").check(samples_per_prompt=1, has_value_model=True)


class SequenceStub:
    """`PolicyFunctions` that returns the batch's own "<prefix>token_logprobs"."""

    def logprobs(self, params, batch, prefix=""):
        """The log-probs stored in the batch."""
        return batch[prefix + "token_logprobs"]


def test_ipo_entry_is_online_dpo_with_ipo_loss():
    assert get_loss_spec("ipo").prepare is get_loss_spec("online_dpo").prepare
    cfg = base_config().loss_params  # beta 0.1
    one = jnp.ones((1, 2))
    batch = {
        "first_token_logprobs": jnp.array([[-4.0, -6.0]]),  # log π(y⁺) = −10
        "second_token_logprobs": jnp.array([[-7.0, -7.0]]),  # log π(y⁻) = −14
        "first_loss_mask": one,
        "second_loss_mask": one,
        "ref_first": jnp.array([-11.0]),
        "ref_second": jnp.array([-13.0]),
        "valid": jnp.array([1.0]),
    }
    h = (-10.0 + 11.0) - (-14.0 + 13.0)  # 2
    ipo, _ = get_loss_spec("ipo").loss(SequenceStub(), cfg, None, batch)
    dpo, _ = get_loss_spec("online_dpo").loss(SequenceStub(), cfg, None, batch)
    assert_allclose(ipo, (h - 1 / (2 * 0.1)) ** 2, rtol=1e-6)
    assert_allclose(dpo, np.logaddexp(0.0, -0.1 * h), rtol=1e-6)


@pytest.mark.parametrize("name", sorted(NAMES))
def test_every_entry_prepares_and_returns_loss_and_metrics(name):
    spec = get_loss_spec(name)
    assert isinstance(spec, LossSpec) and spec.description
    cfg = base_config().loss_params
    inputs = make_inputs([1.0, 0.0, 0.5, 2.0], 2, with_ref=spec.needs_reference(cfg))
    loss, metrics = spec.loss(TableModel(), cfg, table_params(), spec.prepare(inputs, cfg))
    assert np.shape(loss) == () and np.isfinite(loss)
    assert_allclose(metrics["loss"], loss)
