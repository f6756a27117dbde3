"""What every loss is fed: the rollout's rows and what was computed about them before the update.

A loss's registry entry (`jaxrlhf.losses.registry.LossSpec`) has two halves:

- `prepare(inputs, cfg) -> batch`: on the host, once per update, from `LossInputs` (rewards,
  reference / behaviour log-probs, old values) to fixed-shape numpy arrays (pairs picked,
  advantages computed, off-policy corrections applied);
- `loss(models, cfg, params, batch) -> (loss, metrics)`: jit-able, differentiated by the train
  step; `models` (`PolicyFunctions`) gives the policy's token log-probs and the value model's
  estimates of a batch's rows.

Token arrays are [N, T−1] like `token_logprobs` (entry t scores token t+1), rows prompt-major
(the k samples of a prompt adjacent).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax
import numpy as np

from jaxrlhf.losses.importance import Correction, apply_correction, correction_kind


@dataclasses.dataclass
class LossInputs:
    input_ids: np.ndarray  # [N, T]
    attention_mask: np.ndarray  # [N, T]
    loss_mask: np.ndarray  # [N, T−1], 1 on response tokens (through EOS)
    scores: np.ndarray  # [N], task / reward-model score after the missing-EOS penalty
    samples_per_prompt: int
    sampler_logprobs: np.ndarray  # [N, T−1], the generator's (behaviour policy's), 0 off-response
    # π_old of an importance ratio: the sampler's, or the learner's recompute
    # (config loss_params.old_logprobs); 0 off-response.
    old_logprobs: np.ndarray
    # [N, T−1], when the loss needs the reference; NaN on rows it never reads (its spec's
    # reference_rows).
    ref_logprobs: np.ndarray | None = None
    old_values: np.ndarray | None = None  # [N, T−1], PPO's value model before the update

    def rows(self, index: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """The model inputs of the selected rows (all rows when `index` is None)."""
        index = np.arange(len(self.scores)) if index is None else np.asarray(index)
        return {
            "input_ids": self.input_ids[index],
            "attention_mask": self.attention_mask[index],
            "loss_mask": self.loss_mask[index],
        }

    def sequence_sums(self, token_values: np.ndarray) -> np.ndarray:
        """[N] Σ_t m_t v_t over each row's response tokens."""
        return (np.asarray(token_values, np.float32) * self.loss_mask).sum(-1).astype(np.float32)

    def correction(self, cfg, per: str) -> Correction | None:
        """The off-policy correction `cfg.is_correction` (with truncated_is_cap, is_low,
        is_high) of the ratio π_old / π_sampler, π_old the learner's recompute
        (`jaxrlhf.losses.importance`); None for "none". `per`: "token" (PPO, GRPO) or
        "sequence" (RLOO). (With π_old the sampler's own log-probs, the ratio π_θ/π_old
        already corrects for the sampler, so the config forbids a correction there.)"""
        return apply_correction(
            correction_kind(cfg), self.old_logprobs, self.sampler_logprobs, self.loss_mask, per,
            cap=cfg.truncated_is_cap, low=cfg.is_low, high=cfg.is_high,
        )  # fmt: skip


def corrected(inputs: LossInputs, cfg, per: str) -> dict[str, np.ndarray]:
    """The batch entries a correction replaces or adds: "loss_mask" (dropped tokens zeroed:
    they leave every term of the loss and its normaliser), and the weights: "importance_weights"
    (a factor of each term: per token, or per sequence for RLOO's truncation) or, for RLOO under
    "mask", "token_weights" (factors of the token log-probs in its sequence log-probs); none
    for is_correction="none"."""
    correction = inputs.correction(cfg, per)
    if correction is None:
        return {}
    out = {"loss_mask": correction.loss_mask}
    if correction.weights is not None:
        per_token = per == "sequence" and correction.weights.ndim == 2
        out["token_weights" if per_token else "importance_weights"] = correction.weights
    return out


def pair_batch(
    inputs: LossInputs, first: np.ndarray, second: np.ndarray, valid: np.ndarray
) -> dict[str, np.ndarray]:
    """The rows of pairs (first[i], second[i]) with their reference sequence log-probs and
    scores: keys first_* / second_* (model inputs), ref_first, ref_second, reward_first,
    reward_second, valid."""
    first, second = np.asarray(first), np.asarray(second)
    ref = inputs.sequence_sums(inputs.ref_logprobs)
    batch = {f"first_{key}": v for key, v in inputs.rows(first).items()}
    batch |= {f"second_{key}": v for key, v in inputs.rows(second).items()}
    return batch | {
        "ref_first": ref[first],
        "ref_second": ref[second],
        "reward_first": inputs.scores[first].astype(np.float32),
        "reward_second": inputs.scores[second].astype(np.float32),
        "valid": np.asarray(valid, np.float32),
    }


class PolicyFunctions(Protocol):
    """The models a loss runs, bound to their architectures and the sampling temperature."""

    def logprobs(self, params: Any, batch: dict[str, jax.Array], prefix: str = "") -> jax.Array:
        """[B, T−1] policy token log-probs of batch[prefix + "input_ids"] (logits / temperature),
        with params["policy"]."""

    def values(self, params: Any, batch: dict[str, jax.Array]) -> jax.Array:
        """[B, T−1] value estimates with params["value"] (entry t: the state before token t+1)."""


def masked_sequence_logprobs(
    models: PolicyFunctions, params: Any, batch: dict[str, jax.Array], prefix: str = ""
) -> jax.Array:
    """[B] Σ_t m_t log π_θ(y_t) of the rows batch[prefix + ...]."""
    logprobs = models.logprobs(params, batch, prefix)
    return (logprobs * batch[prefix + "loss_mask"]).sum(-1)
