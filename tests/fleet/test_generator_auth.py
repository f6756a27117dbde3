"""The learner's side of the shared secret: the RLHF stage's pool reads the token from the
environment variable `config.generator.auth_token_env` names and sends it with every call;
replicas that enforce a token (the service's own `TokenAuthInterceptor`, on the loopback test
doubles of `weight_receivers`) take the right one and refuse a wrong or missing one at once."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from jaxrlhf.config import base_config
from jaxrlhf.stages.rlhf import generator_pool
from tests.fleet.weight_receivers import WeightReceivers

TOKEN = "fleet-secret-for-tests"
DEFAULT_ENV = "JAXRLHF_GENERATOR_AUTH_TOKEN"
TENSORS = {"model.norm.weight": np.arange(8, dtype=np.float32)}


def pool_config(targets: list[str], auth_token_env: str):
    config = base_config()
    config.generator.addresses = ",".join(targets)
    config.generator.auth_token_env = auth_token_env
    return config


@pytest.mark.timeout(60)
@pytest.mark.parametrize("auth_token_env", [DEFAULT_ENV, "MY_FLEET_TOKEN"])
def test_the_learner_sends_the_token_its_config_names(monkeypatch, auth_token_env):
    monkeypatch.delenv(DEFAULT_ENV, raising=False)
    monkeypatch.setenv(auth_token_env, TOKEN)
    logs: list[str] = []
    with WeightReceivers(2, TENSORS, token=TOKEN) as receivers:
        config = pool_config(receivers.targets, auth_token_env)
        with generator_pool(config, Path("unused"), logs.append) as pool:
            stats = pool.publish_weights(lambda: iter(TENSORS.items()), len(TENSORS), 1)
    assert set(stats.swapped) == set(receivers.targets) and not stats.failed, logs
    assert receivers.versions == [1, 1]
    # Every status probe and update carried it (at least: 2 probes, 2 updates).
    assert len(receivers.auth_headers) >= 4
    assert set(receivers.auth_headers) == {f"Bearer {TOKEN}"}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("token", [None, "wrong-token"])
def test_a_learner_without_the_right_token_is_refused_at_once(monkeypatch, token):
    """Not after the pool's 10 minutes of waiting for replicas to serve: waiting cannot help."""
    if token is None:
        monkeypatch.delenv(DEFAULT_ENV, raising=False)
    else:
        monkeypatch.setenv(DEFAULT_ENV, token)
    with WeightReceivers(1, TENSORS, token=TOKEN) as receivers:
        config = pool_config(receivers.targets, DEFAULT_ENV)
        expected = "missing 'authorization" if token is None else "wrong auth token"
        with pytest.raises(PermissionError, match=expected) as caught:
            with generator_pool(config, Path("unused"), lambda message: None):
                pass
    assert receivers.targets[0] in str(caught.value)
    assert receivers.versions == [0]
