"""Each loss as (host-side batch preparation, jit-able loss function) over the rollout arrays.

`prepare` runs on the host once per step with everything computed before the update (rewards,
reference / old log-probs, old values) and returns fixed-shape arrays; `loss_fn(params, batch)`
is differentiated by the train step. Params are {"policy": ..., ["value": ...]}.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf import losses
from jaxrlhf.models import Transformer, logprobs_from_logits
from jaxrlhf.rl.batch import RolloutArrays


@dataclasses.dataclass
class StepInputs:
    """Per-sample quantities computed before the update; token arrays are [N, T−1]."""

    arrays: RolloutArrays
    scores: np.ndarray  # [N] task/RM score after the missing-EOS penalty
    ref_logprobs: np.ndarray | None
    old_logprobs: np.ndarray  # behaviour policy: sampler's, or the learner's recompute
    importance_weights: np.ndarray | None  # truncated IS (learner recompute vs sampler), or None
    old_values: np.ndarray | None  # PPO


@dataclasses.dataclass(frozen=True)
class Objective:
    name: str
    prepare: Callable[[StepInputs], dict[str, np.ndarray]]
    loss_fn: Callable[[Any, dict[str, jax.Array]], tuple[jax.Array, dict[str, jax.Array]]]


def _logprobs_fn(model: Transformer, temperature: float):
    """(params, batch, prefix) -> policy token log-probs [N, T−1] at the sampling temperature."""

    def fn(params, batch, prefix: str = "") -> jax.Array:
        ids = batch[prefix + "input_ids"]
        logits = model.apply({"params": params["policy"]}, ids, batch[prefix + "attention_mask"])
        return logprobs_from_logits(logits[:, :-1], ids[:, 1:], temperature)

    return fn


def _seq(token_values: np.ndarray | None, mask: np.ndarray) -> np.ndarray:
    return (np.asarray(token_values) * mask).sum(-1).astype(np.float32)


def build_objective(
    name: str,
    policy: Transformer,
    value: Transformer | None,
    k: int,
    cfg: Any,
    temperature: float,
) -> Objective:
    """cfg: the config's `loss` settings (beta, kl_coef, clip, vf_coef, gamma, lam, whiten).

    Policy log-probs use logits / temperature, as the sampler's and the reference's do.
    """
    logprobs = _logprobs_fn(policy, temperature)
    if name in ("online_dpo", "ipo", "copg"):
        return _pairwise(name, logprobs, k, cfg)
    if name == "best_of_k":
        return _best_of_k(logprobs, k)
    if name in ("rloo", "grpo"):
        return _sequence_advantage(name, logprobs, k, cfg)
    if name == "ppo":
        if value is None:
            raise ValueError("loss 'ppo' needs a value model")
        return _ppo(logprobs, value, cfg)
    raise ValueError(f"no objective for loss {name!r}")


def _pairwise(name: str, logprobs, k: int, cfg: Any) -> Objective:
    """Online DPO / IPO: best vs worst of k per prompt. CoPG: every pair within the group."""

    def prepare(inputs: StepInputs) -> dict[str, np.ndarray]:
        a, scores = inputs.arrays, inputs.scores
        if name == "copg":
            first, second = (np.asarray(x) for x in losses.group_pair_indices(len(scores) // k, k))
            valid = np.ones(len(first), np.float32)
        else:
            first, second, valid = (np.asarray(x) for x in losses.select_pairs(scores, k))
        ref_seq = _seq(inputs.ref_logprobs, a.loss_mask)
        batch = {f"first_{key}": v for key, v in a.rows(first).items()}
        batch |= {f"second_{key}": v for key, v in a.rows(second).items()}
        batch |= {
            "ref_first": ref_seq[first],
            "ref_second": ref_seq[second],
            "reward_first": scores[first],
            "reward_second": scores[second],
            "valid": valid.astype(np.float32),
        }
        return batch

    def loss_fn(params, batch):
        def seq(prefix):
            lp = logprobs(params, batch, prefix)
            return (lp * batch[prefix + "loss_mask"]).sum(-1)

        first, second = seq("first_"), seq("second_")
        if name == "copg":
            return losses.copg_loss(
                first,
                second,
                batch["ref_first"],
                batch["ref_second"],
                batch["reward_first"],
                batch["reward_second"],
                cfg.beta,
                valid=batch["valid"],
            )
        loss_type = "ipo" if name == "ipo" else "sigmoid"
        return losses.online_dpo_loss(
            first, second, batch["ref_first"], batch["ref_second"], cfg.beta, loss_type,
            valid=batch["valid"],
        )  # fmt: skip

    return Objective(name, prepare, loss_fn)


def _best_of_k(logprobs, k: int) -> Objective:
    def prepare(inputs: StepInputs) -> dict[str, np.ndarray]:
        best = np.asarray(losses.best_of_k_indices(inputs.scores, k))
        return inputs.arrays.rows(best)

    def loss_fn(params, batch):
        return losses.sft_nll_loss(logprobs(params, batch), batch["loss_mask"])

    return Objective("best_of_k", prepare, loss_fn)


def _sequence_advantage(name: str, logprobs, k: int, cfg: Any) -> Objective:
    """RLOO (sequence-level ratio) and GRPO (token-level ratio), advantages from the group."""

    def prepare(inputs: StepInputs) -> dict[str, np.ndarray]:
        a = inputs.arrays
        batch = a.rows(np.arange(len(inputs.scores)))
        batch["old_logprobs"] = inputs.old_logprobs.astype(np.float32)
        weights = inputs.importance_weights
        if name == "rloo":
            rewards = losses.kl_penalized_rewards(
                inputs.scores, inputs.old_logprobs, inputs.ref_logprobs, a.loss_mask, cfg.kl_coef
            )
            batch["advantages"] = np.asarray(losses.rloo_advantages(rewards, k), np.float32)
            if weights is not None:  # sequence-level: the product of token weights, capped
                weights = np.minimum(np.prod(np.where(a.loss_mask > 0, weights, 1.0), -1), 2.0)
        else:
            batch["advantages"] = np.asarray(losses.grpo_advantages(inputs.scores, k), np.float32)
        if weights is not None:
            batch["importance_weights"] = weights.astype(np.float32)
        return batch

    def loss_fn(params, batch):
        new = logprobs(params, batch)
        mask = batch["loss_mask"]
        weights = batch.get("importance_weights")
        if name == "rloo":
            return losses.rloo_loss(
                (new * mask).sum(-1), (batch["old_logprobs"] * mask).sum(-1),
                batch["advantages"], cfg.clip, importance_weights=weights,
            )  # fmt: skip
        return losses.grpo_loss(
            new, batch["old_logprobs"], batch["advantages"], mask, cfg.clip,
            importance_weights=weights,
        )  # fmt: skip

    return Objective(name, prepare, loss_fn)


def _ppo(logprobs, value: Transformer, cfg: Any) -> Objective:
    """PPO: per-token KL-penalised rewards, GAE on the value model's estimates, whitened."""

    def prepare(inputs: StepInputs) -> dict[str, np.ndarray]:
        a = inputs.arrays
        mask = a.loss_mask
        rewards = losses.ppo_per_token_rewards(
            inputs.scores, inputs.old_logprobs, inputs.ref_logprobs, mask, cfg.kl_coef
        )
        advantages, returns = losses.compute_gae(
            rewards, inputs.old_values, mask, cfg.gamma, cfg.lam
        )
        if cfg.whiten_advantages:
            advantages = losses.masked_whiten(advantages, mask)
        batch = a.rows(np.arange(len(inputs.scores)))
        batch |= {
            "old_logprobs": inputs.old_logprobs.astype(np.float32),
            "old_values": inputs.old_values.astype(np.float32),
            "advantages": np.asarray(advantages, np.float32),
            "returns": np.asarray(returns, np.float32),
        }
        if inputs.importance_weights is not None:
            batch["importance_weights"] = inputs.importance_weights.astype(np.float32)
        return batch

    def loss_fn(params, batch):
        new = logprobs(params, batch)
        values = value.apply(
            {"params": params["value"]}, batch["input_ids"], batch["attention_mask"]
        )[:, :-1]
        return losses.ppo_loss(
            new, batch["old_logprobs"], batch["advantages"], values, batch["old_values"],
            batch["returns"], batch["loss_mask"], cfg.clip, cfg.clip_value, cfg.vf_coef,
            importance_weights=batch.get("importance_weights"),
        )  # fmt: skip

    return Objective("ppo", prepare, loss_fn)


def value_estimates(value: Transformer):
    """jit-able (value_params, input_ids, attention_mask) -> [N, T−1] values aligned with
    token_logprobs (entry t: the value of the state that generates token t+1)."""

    def fn(params, input_ids, attention_mask):
        return value.apply({"params": params}, input_ids, attention_mask)[:, :-1].astype(
            jnp.float32
        )

    return fn
