"""Sampler/learner mismatch: truncated importance weights and the log-prob gap health metric.

The generator (vLLM) and the learner compute log-probs of the same tokens with different
kernels, so even at the same policy version π_sampler ≠ π_learner slightly. When the learner's
recompute is used as π_old in the PPO/RLOO/GRPO ratio, the samples still came from π_sampler;
truncated importance sampling (Yao et al. 2025, "Your efficient RL framework secretly brings you
off-policy RL training") reweights each loss term by min(π_learner/π_sampler, cap).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrlhf.losses.common import masked_mean


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
