"""Sampler/learner mismatch: the off-policy corrections and the log-prob gap health metric.

The samples come from π_sampler: the generator's weights (older than the learner's in
asynchronous runs, and computed with other kernels even at the same version). When the
learner's recompute before the update is π_old of the PPO/RLOO/GRPO ratio
(`loss_params.old_logprobs="learner"`), the mismatch is left to a correction
(`loss_params.is_correction`) on the ratio of each response token y_t,

    r_t = π_learner(y_t) / π_sampler(y_t)          (log r_t = old_logprobs − sampler_logprobs)

- "truncate": each term weighted by min(r_t, cap) (truncated IS; Yao et al. 2025, "Your
  efficient RL framework secretly brings you off-policy RL training"); RLOO, whose ratio is
  per sequence, by min(Π_t r_t, cap).
- "mask": two-sided masked importance sampling (MIS; IcePop; TRL's token_mask). A token's term
  is weighted by M(r_t) = r_t when low ≤ r_t ≤ high, and dropped (M = 0) otherwise. PPO and
  GRPO multiply each token's clipped surrogate by M(r_t). RLOO, whose ratio is per sequence,
  weighs each token's log-prob by M(r_t) inside both sequence log-probs of its ratio,
  ρ = exp(Σ_t M(r_t) (log π_θ(y_t) − log π_old(y_t))), so at the update's start its gradient is
  −A Σ_t M(r_t) ∇log π_θ(y_t), the token-level MIS estimator; a sequence with no token kept
  is dropped.
- "sequence_mask": a sequence is kept whole when its geometric-mean ratio
  exp(Σ_t log r_t / |y|) lies in [low, high], and dropped whole otherwise (SkyRL's first step,
  verl's Geo-RS, slime's OPSM).

A dropped token or sequence leaves the loss mask, so it gets exactly zero gradient, and the
losses' normalisers (response tokens, or RLOO's sequences) count kept ones only, over the whole
batch also under micro-batches (`LossSpec.batch_weight`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf.losses.common import masked_mean

CORRECTIONS = ("none", "truncate", "mask", "sequence_mask")
# The default range [low, high] of each masking correction (loss_params.is_low / is_high None).
DEFAULT_RANGES = {"mask": (0.5, 2.0), "sequence_mask": (0.99, 1.01)}


@dataclasses.dataclass(frozen=True)
class Correction:
    """What a correction does to one batch (host side, numpy).

    loss_mask: [N, T−1] the response tokens whose terms are kept (the batch's own mask with
        dropped tokens and sequences zeroed).
    weights: importance weights: "truncate" min(r, cap) ([N, T−1] per token, or [N] per
        sequence), "mask" M(r_t) ([N, T−1], for every loss), else None.
    metrics: is_kept_fraction (of response tokens for "mask", of sequences for
        "sequence_mask", the share at or below the cap for "truncate"), is_ratio_mean and
        is_ratio_max (of the ratio the correction tests: r_t over response tokens, or per
        sequence: Π_t r_t for RLOO's truncation, the geometric mean for "sequence_mask").
    """

    loss_mask: np.ndarray
    weights: np.ndarray | None
    metrics: dict[str, float]


def correction_kind(cfg) -> str:
    """The correction `loss_params` select: is_correction, where truncated_is_cap > 0 alone
    (the setting before is_correction existed) means "truncate"."""
    kind = cfg.get("is_correction", "none")
    return "truncate" if kind == "none" and cfg.truncated_is_cap else kind


def correction_range(kind: str, low: float | None, high: float | None) -> tuple[float, float]:
    """[low, high] of a masking correction: the given bounds, each None replaced by its
    default. low = 0 keeps every ratio below 1 and high = inf every ratio above it: no bound."""
    default_low, default_high = DEFAULT_RANGES[kind]
    return (default_low if low is None else low, default_high if high is None else high)


def apply_correction(
    kind: str,
    old_logprobs: np.ndarray,
    sampler_logprobs: np.ndarray,
    loss_mask: np.ndarray,
    per: str,
    cap: float = 0.0,
    low: float | None = None,
    high: float | None = None,
) -> Correction | None:
    """The correction `kind` (module docstring) of a batch; None for "none".

    Token arrays [N, T−1], 0 off-response; `per`: "token" for the token-level losses (PPO,
    GRPO), "sequence" for RLOO (truncation then weighs a sequence by its whole ratio; "mask"
    keeps token weights, and a sequence with no token kept has an empty mask, which RLOO
    drops).
    """
    if kind == "none":
        return None
    if kind not in CORRECTIONS:
        raise ValueError(f"unknown is_correction {kind!r}; known: {', '.join(CORRECTIONS)}")
    mask = np.asarray(loss_mask, np.float32)
    real = mask > 0
    old = np.asarray(old_logprobs, np.float32) * mask
    sampler = np.asarray(sampler_logprobs, np.float32) * mask
    if kind == "truncate":
        if per == "sequence":
            old, sampler = old.sum(-1), sampler.sum(-1)
        weights = np.asarray(truncated_importance_weights(old, sampler, cap), np.float32)
        ratio = np.exp(old.astype(np.float64) - sampler)
        if per == "token":
            weights, ratio = weights * mask, ratio[real]
        return Correction(mask, weights, _metrics(ratio <= cap, ratio))
    low, high = correction_range(kind, low, high)
    log_ratio = np.where(real, old.astype(np.float64) - sampler, 0.0)
    if kind == "mask":
        ratio = np.exp(log_ratio)
        inside = real & (ratio >= low) & (ratio <= high)
        weights = np.where(inside, ratio, 0.0).astype(np.float32)
        return Correction(mask * inside, weights, _metrics(inside[real], ratio[real]))
    # "sequence_mask", tested on the mean log-ratio (no product of many ratios to overflow).
    lengths = real.sum(-1)
    mean_log = log_ratio.sum(-1) / np.maximum(lengths, 1)
    with np.errstate(divide="ignore"):  # low = 0: no lower bound
        inside = (mean_log >= np.log(low)) & (mean_log <= np.log(high))
    rows = lengths > 0
    return Correction(mask * inside[:, None], None, _metrics(inside[rows], np.exp(mean_log[rows])))


def _metrics(kept: np.ndarray, ratio: np.ndarray) -> dict[str, float]:
    if ratio.size == 0:
        return {"is_kept_fraction": 1.0, "is_ratio_mean": 1.0, "is_ratio_max": 1.0}
    return {
        "is_kept_fraction": float(np.mean(kept)),
        "is_ratio_mean": float(np.mean(ratio)),
        "is_ratio_max": float(np.max(ratio)),
    }


def truncated_importance_weights(
    learner_logps: jax.Array, sampler_logps: jax.Array, cap: float = 2.0
) -> jax.Array:
    """w = stop_gradient(min(exp(log π_learner − log π_sampler), cap)), element-wise.

    Works per token ([B, T]) or per sequence ([B], summed log-probs). The weight is a constant
    of the loss (no gradient flows through it); multiply it into the per-element surrogate.
    """
    log_ratio = jnp.asarray(learner_logps, jnp.float32) - jnp.asarray(sampler_logps, jnp.float32)
    # Clamping the exponent before exp keeps the weight finite (and its cotangent NaN-free).
    weights = jnp.exp(jnp.minimum(log_ratio, jnp.log(cap)))
    return jax.lax.stop_gradient(weights)


def logprob_gap_metrics(
    learner_logps: jax.Array, sampler_logps: jax.Array, mask: jax.Array
) -> dict[str, jax.Array]:
    """Health metrics of d = log π_learner − log π_sampler over the real tokens.

    mean_abs_gap = mean |d|, max_abs_gap = max |d|, and kl_sampler_learner ≈ KL(sampler‖learner)
    by the k3 estimator mean(exp(d) − 1 − d) (unbiased, ≥ 0 per token; Schulman 2020).
    """
    gap = jnp.asarray(learner_logps, jnp.float32) - jnp.asarray(sampler_logps, jnp.float32)
    real = jnp.asarray(mask).astype(bool)
    abs_gap = jnp.where(real, jnp.abs(gap), 0.0)
    return {
        "mean_abs_gap": masked_mean(abs_gap, real),
        "max_abs_gap": jnp.max(abs_gap),
        "kl_sampler_learner": masked_mean(jnp.expm1(jnp.where(real, gap, 0.0)) - gap, real),
    }
