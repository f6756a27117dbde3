"""Losses by name: a config string picks the loss, and its entry says what it needs and how to
feed it, so adding a loss is one entry here (plus its module).

Each `LossSpec` owns its batch preparation (`prepare`, host side, once per update) and its loss
call (`loss`, jit-able); `jaxrlhf.rl.objectives` only looks the entry up. A trainer calls
`spec.check(...)` once at start-up, so that a bad config fails with a clear message before any
model is loaded, and runs the reference forward only when `spec.needs_reference(cfg)`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import numpy as np

from jaxrlhf.losses.best_of_k import best_of_k_objective, prepare_best_of_k
from jaxrlhf.losses.copg import copg_objective, prepare_copg
from jaxrlhf.losses.grpo import grpo_objective, prepare_grpo
from jaxrlhf.losses.inputs import LossInputs
from jaxrlhf.losses.online_dpo import online_dpo_objective, pair_rows, prepare_online_dpo
from jaxrlhf.losses.ppo import ppo_objective, prepare_ppo
from jaxrlhf.losses.rloo import prepare_rloo, rloo_objective

REFERENCE_USES = ("always", "kl", "never")
AVERAGED_OVER = ("tokens", "pairs", "sequences")


def _per_prompt(prompts: int, k: int) -> int:
    return prompts


def _per_sample(prompts: int, k: int) -> int:
    return prompts * k


def _all_pairs(prompts: int, k: int) -> int:
    return prompts * k * (k - 1) // 2


@dataclasses.dataclass(frozen=True)
class LossSpec:
    """One loss: how its batch is prepared, how it is called, and what it needs.

    prepare(inputs: LossInputs, cfg) -> batch: numpy arrays of fixed shapes.
    loss(models, cfg, params, batch) -> (loss, metrics): jit-able; `models` gives the policy's
        token log-probs (and the value model's estimates); cfg is config.loss_params.
    min_samples_per_prompt: the smallest K (completions per prompt) it works with.
    reference: when it uses log π_ref of the sampled responses: "always" (its loss is anchored
        to the reference), "kl" (only through a KL penalty: when loss_params.kl_coef != 0),
        "never".
    needs_value_model: trains a value head alongside the policy (PPO).
    importance_ratio: uses π_old in an importance ratio (the sampler's or the learner's
        recompute), so the off-policy corrections (`loss_params.is_correction`) apply to it.
    pairwise: consumes pairs of responses to the same prompt rather than single responses.
    averaged_over: the unit the loss is a mean over, which micro-batches weight their parts by
        (`batch_weight`): "tokens" (response tokens kept), "pairs" (valid pairs), "sequences"
        (kept rows).
    batch_items(prompts, k) -> the leading dimension of the prepared batch (pairs or rows).
    reference_rows(scores, k) -> row indices: the only rows whose reference log-probs the loss
        reads, of a fixed count for a given batch size (None: all rows). The reference forward
        then runs on those rows alone; the others stay NaN, so a read would show.
    """

    name: str
    description: str
    prepare: Callable[[LossInputs, Any], dict[str, np.ndarray]]
    loss: Callable[..., tuple[Any, dict[str, Any]]]
    min_samples_per_prompt: int
    reference: str
    needs_value_model: bool
    importance_ratio: bool
    pairwise: bool
    averaged_over: str
    batch_items: Callable[[int, int], int]
    reference_rows: Callable[[np.ndarray, int], np.ndarray] | None = None
    ratio_per: str = "token"  # its importance ratio: per "token" or per "sequence"

    def __post_init__(self) -> None:
        if self.reference not in REFERENCE_USES:
            raise ValueError(f"LossSpec {self.name!r}: reference must be one of {REFERENCE_USES}")
        if self.averaged_over not in AVERAGED_OVER:
            raise ValueError(
                f"LossSpec {self.name!r}: averaged_over must be one of {AVERAGED_OVER}"
            )

    def batch_weight(self, batch) -> Any:
        """How many of the loss's units (`averaged_over`) a prepared (micro-)batch holds."""
        if self.averaged_over == "pairs":
            return batch["valid"].sum()
        if self.averaged_over == "tokens":
            return batch["loss_mask"].sum()  # kept by an off-policy correction
        if "kept" in batch:  # the rows an off-policy correction kept
            return batch["kept"].sum()
        return next(iter(batch.values())).shape[0]

    @property
    def sequences_per_item(self) -> int:
        """Sequences one item of the prepared batch runs through the policy (a pair: 2)."""
        return 2 if self.pairwise else 1

    def needs_reference(self, loss_params) -> bool:
        """Whether a run with these `config.loss_params` needs the reference log-probs."""
        return self.reference == "always" or (self.reference == "kl" and bool(loss_params.kl_coef))

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
        description="Online DPO: best vs worst of K samples, −log σ(β h); ties give no gradient",
        prepare=prepare_online_dpo,
        loss=online_dpo_objective,
        min_samples_per_prompt=2,
        reference="always",
        needs_value_model=False,
        importance_ratio=False,
        averaged_over="pairs",
        batch_items=_per_prompt,
        pairwise=True,
        reference_rows=pair_rows,
    ),
    LossSpec(
        name="ipo",
        description="Online IPO: best vs worst of K samples, (h − 1/(2β))²",
        prepare=prepare_online_dpo,
        loss=functools.partial(online_dpo_objective, loss_type="ipo"),
        min_samples_per_prompt=2,
        reference="always",
        needs_value_model=False,
        importance_ratio=False,
        averaged_over="pairs",
        batch_items=_per_prompt,
        pairwise=True,
        reference_rows=pair_rows,
    ),
    LossSpec(
        name="ppo",
        description="PPO: KL-penalised per-token rewards, GAE, clipped policy and value losses",
        prepare=prepare_ppo,
        loss=ppo_objective,
        min_samples_per_prompt=1,
        reference="kl",
        needs_value_model=True,
        importance_ratio=True,
        averaged_over="tokens",
        batch_items=_per_sample,
        pairwise=False,
    ),
    LossSpec(
        name="rloo",
        description="RLOO: leave-one-out baseline on KL-penalised rewards, sequence-level clip",
        prepare=prepare_rloo,
        loss=rloo_objective,
        min_samples_per_prompt=2,
        reference="kl",
        needs_value_model=False,
        importance_ratio=True,
        averaged_over="sequences",
        batch_items=_per_sample,
        pairwise=False,
        ratio_per="sequence",
    ),
    LossSpec(
        name="grpo",
        description="GRPO: group-normalised advantages, token-level clip, k3 KL to the reference",
        prepare=prepare_grpo,
        loss=grpo_objective,
        min_samples_per_prompt=2,
        reference="kl",
        needs_value_model=False,
        importance_ratio=True,
        averaged_over="tokens",
        batch_items=_per_sample,
        pairwise=False,
    ),
    LossSpec(
        name="copg",
        description="CoPG: regress reward gaps on β·log-ratio gaps over pairs, no importance ratio",
        prepare=prepare_copg,
        loss=copg_objective,
        min_samples_per_prompt=2,
        reference="always",
        needs_value_model=False,
        importance_ratio=False,
        averaged_over="pairs",
        batch_items=_all_pairs,
        pairwise=True,
    ),
    LossSpec(
        name="best_of_k",
        description="Best-of-K SFT: NLL on each prompt's highest-scored sample",
        prepare=prepare_best_of_k,
        loss=best_of_k_objective,
        min_samples_per_prompt=2,
        reference="never",
        needs_value_model=False,
        importance_ratio=False,
        averaged_over="tokens",
        batch_items=_per_prompt,
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
