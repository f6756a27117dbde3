"""Losses by name: a config string picks the loss, and its spec says what the loss needs.

A trainer looks up `get_loss_spec(config.loss)`, calls `spec.check(...)` once at start-up so a
bad config fails with a clear message before any model is loaded, and calls `spec.loss_fn`
(which always returns `(loss, metrics)`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from types import MappingProxyType

from jaxrlhf.losses.best_of_k import sft_nll_loss
from jaxrlhf.losses.copg import copg_loss
from jaxrlhf.losses.grpo import grpo_loss
from jaxrlhf.losses.online_dpo import online_dpo_loss
from jaxrlhf.losses.ppo import ppo_loss
from jaxrlhf.losses.rloo import rloo_loss


@dataclasses.dataclass(frozen=True)
class LossSpec:
    """What a loss needs from the rest of the trainer.

    min_samples_per_prompt: the smallest K (completions per prompt) it works with.
    needs_reference_logprobs: uses log π_ref of the sampled responses (the KL anchor).
    needs_value_model: trains a value head alongside the policy (PPO).
    needs_old_logprobs: uses log π_old of the behaviour policy in an importance ratio.
    pairwise: consumes pairs of responses to the same prompt rather than single responses.
    """

    name: str
    loss_fn: Callable
    description: str
    min_samples_per_prompt: int
    needs_reference_logprobs: bool
    needs_value_model: bool
    needs_old_logprobs: bool
    pairwise: bool

    def check(self, samples_per_prompt: int, has_value_model: bool = False) -> None:
        """Raise ValueError if a run with these settings cannot train this loss."""
        if samples_per_prompt < self.min_samples_per_prompt:
            raise ValueError(
                f"loss {self.name!r} needs at least {self.min_samples_per_prompt} samples per "
                f"prompt, got {samples_per_prompt}; raise the samples-per-prompt setting"
            )
        if self.needs_value_model and not has_value_model:
            raise ValueError(
                f"loss {self.name!r} trains a value model, but none is configured; set a value "
                "model path (the reward model or the SFT model) or pick a loss without one"
            )


_SPECS = (
    LossSpec(
        name="online_dpo",
        loss_fn=online_dpo_loss,
        description="Online DPO: best vs worst of K samples, −log σ(β h); ties give no gradient",
        min_samples_per_prompt=2,
        needs_reference_logprobs=True,
        needs_value_model=False,
        needs_old_logprobs=False,
        pairwise=True,
    ),
    LossSpec(
        name="ipo",
        loss_fn=functools.partial(online_dpo_loss, loss_type="ipo"),
        description="Online IPO: best vs worst of K samples, (h − 1/(2β))²",
        min_samples_per_prompt=2,
        needs_reference_logprobs=True,
        needs_value_model=False,
        needs_old_logprobs=False,
        pairwise=True,
    ),
    LossSpec(
        name="ppo",
        loss_fn=ppo_loss,
        description="PPO: KL-penalised per-token rewards, GAE, clipped policy and value losses",
        min_samples_per_prompt=1,
        needs_reference_logprobs=True,
        needs_value_model=True,
        needs_old_logprobs=True,
        pairwise=False,
    ),
    LossSpec(
        name="rloo",
        loss_fn=rloo_loss,
        description="RLOO: leave-one-out baseline on KL-penalised rewards, sequence-level clip",
        min_samples_per_prompt=2,
        needs_reference_logprobs=True,
        needs_value_model=False,
        needs_old_logprobs=True,
        pairwise=False,
    ),
    LossSpec(
        name="grpo",
        loss_fn=grpo_loss,
        description="GRPO: group-normalised advantages, token-level clip; reference only if kl",
        min_samples_per_prompt=2,
        needs_reference_logprobs=False,
        needs_value_model=False,
        needs_old_logprobs=True,
        pairwise=False,
    ),
    LossSpec(
        name="copg",
        loss_fn=copg_loss,
        description="CoPG: regress reward gaps on β·log-ratio gaps over pairs, no importance ratio",
        min_samples_per_prompt=2,
        needs_reference_logprobs=True,
        needs_value_model=False,
        needs_old_logprobs=False,
        pairwise=True,
    ),
    LossSpec(
        name="best_of_k",
        loss_fn=sft_nll_loss,
        description="Best-of-K SFT: NLL on each prompt's highest-scored sample",
        min_samples_per_prompt=2,
        needs_reference_logprobs=False,
        needs_value_model=False,
        needs_old_logprobs=False,
        pairwise=False,
    ),
)

LOSSES: Mapping[str, LossSpec] = MappingProxyType({spec.name: spec for spec in _SPECS})


def get_loss_spec(name: str) -> LossSpec:
    """The registered LossSpec called `name`; ValueError listing the known names otherwise."""
    try:
        return LOSSES[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown loss {name!r}; known losses: {', '.join(sorted(LOSSES))}"
        ) from None
