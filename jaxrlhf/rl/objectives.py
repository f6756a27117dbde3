"""The configured loss, bound to the models: its registry entry plus the policy's forward.

`jaxrlhf.losses.registry` owns each loss's batch preparation and loss call; this module only
looks the entry up and gives it `PolicyFunctions` over the run's models: token log-probs at the
sampling temperature (as the sampler's and the reference's are computed) and value estimates.
`prepare` runs on the host once per update; `loss_fn(params, batch)` is differentiated by the
train step. Params are {"policy": ..., ["value": ...]}.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf import losses
from jaxrlhf.losses import LossInputs
from jaxrlhf.models import Transformer, next_token_logprobs


@dataclasses.dataclass(frozen=True)
class Objective:
    name: str
    prepare: Callable[[LossInputs], dict[str, np.ndarray]]
    loss_fn: Callable[[Any, dict[str, jax.Array]], tuple[jax.Array, dict[str, jax.Array]]]


@dataclasses.dataclass(frozen=True)
class ModelFunctions:
    """`losses.PolicyFunctions` over a policy (and value) Flax model."""

    policy: Transformer
    value: Transformer | None
    temperature: float

    def logprobs(self, params, batch, prefix: str = "") -> jax.Array:
        return next_token_logprobs(
            self.policy, params["policy"], batch[prefix + "input_ids"],
            batch[prefix + "attention_mask"], self.temperature,
        )  # fmt: skip

    def values(self, params, batch) -> jax.Array:
        if self.value is None:
            raise ValueError("this loss needs a value model, and the run has none")
        return value_estimates(self.value)(
            params["value"], batch["input_ids"], batch["attention_mask"]
        )


def build_objective(
    name: str, policy: Transformer, value: Transformer | None, cfg: Any, temperature: float
) -> Objective:
    """The registry's loss `name` over these models; cfg: the config's `loss_params`."""
    spec = losses.get_loss_spec(name)
    models = ModelFunctions(policy, value, temperature)
    return Objective(
        name,
        functools.partial(_prepare, spec.prepare, cfg),
        functools.partial(spec.loss, models, cfg),
    )


def _prepare(prepare, cfg, inputs: LossInputs) -> dict[str, np.ndarray]:
    return {key: np.asarray(value) for key, value in prepare(inputs, cfg).items()}


def value_estimates(value: Transformer):
    """jit-able (value_params, input_ids, attention_mask) -> [N, T−1] values aligned with
    token_logprobs (entry t: the value of the state that generates token t+1)."""

    def fn(params, input_ids, attention_mask):
        return value.apply({"params": params}, input_ids, attention_mask)[:, :-1].astype(
            jnp.float32
        )

    return fn
