"""The loss registry: names, specs, config checks, and that every entry runs."""

import dataclasses

import numpy as np
import pytest
from numpy.testing import assert_allclose

from jaxrlhf.losses import LOSSES, LossSpec, get_loss_spec, online_dpo_loss

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


def test_requirements():
    assert get_loss_spec("ppo").needs_value_model
    assert not any(LOSSES[n].needs_value_model for n in NAMES - {"ppo"})
    assert get_loss_spec("online_dpo").needs_reference_logprobs
    assert get_loss_spec("online_dpo").pairwise and get_loss_spec("copg").pairwise
    assert get_loss_spec("rloo").needs_old_logprobs and not get_loss_spec("copg").needs_old_logprobs
    for name in NAMES - {"ppo"}:
        assert LOSSES[name].min_samples_per_prompt == 2


def test_check_rejects_bad_configs():
    get_loss_spec("rloo").check(samples_per_prompt=4)
    with pytest.raises(ValueError, match="at least 2 samples per prompt, got 1"):
        get_loss_spec("online_dpo").check(samples_per_prompt=1)
    with pytest.raises(ValueError, match="value model"):
        get_loss_spec("ppo").check(samples_per_prompt=1)
    get_loss_spec("ppo").check(samples_per_prompt=1, has_value_model=True)


def test_ipo_entry_is_online_dpo_with_ipo_loss():
    args = (np.array([-10.0]), np.array([-14.0]), np.array([-11.0]), np.array([-13.0]), 0.1)
    loss, _ = get_loss_spec("ipo").loss_fn(*args)
    assert_allclose(loss, online_dpo_loss(*args, loss_type="ipo")[0])
    assert_allclose(loss, (2.0 - 5.0) ** 2, rtol=1e-6)


def _example_args(name):
    seq = np.array([-3.0, -4.0], np.float32)
    tokens = np.array([[-1.0, -2.0], [-1.5, -0.5]], np.float32)
    mask = np.ones((2, 2), bool)
    return {
        "online_dpo": (seq, seq - 1, seq, seq, 0.1),
        "ipo": (seq, seq - 1, seq, seq, 0.1),
        "ppo": (tokens, tokens, tokens, tokens, tokens, tokens, mask),
        "rloo": (seq, seq, np.array([1.0, -1.0])),
        "grpo": (tokens, tokens, np.array([1.0, -1.0]), mask),
        "copg": (seq, seq - 1, seq, seq, np.ones(2), np.zeros(2), 0.1),
        "best_of_k": (tokens, mask),
    }[name]


@pytest.mark.parametrize("name", sorted(NAMES))
def test_every_entry_returns_loss_and_metrics(name):
    spec = get_loss_spec(name)
    assert isinstance(spec, LossSpec) and spec.description
    loss, metrics = spec.loss_fn(*_example_args(name))
    assert np.shape(loss) == () and np.isfinite(loss)
    assert_allclose(metrics["loss"], loss)
