"""Masked reductions, whitening, sequence log-probs and PPO's clipped surrogate.

Masks follow the repo convention: 1 for a real response token (up to and including EOS), 0 after
it (and, in the [prompt | response] layout, 0 on the prompt). Masks may be bool, int or float;
masked-out entries are never read through arithmetic (`jnp.where`, not `values * mask`), so a
NaN or inf sitting in padding cannot leak into a loss.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def _as_bool(mask: jax.Array) -> jax.Array:
    return jnp.asarray(mask).astype(bool)


def _safe_divide(numerator: jax.Array, denominator: jax.Array) -> jax.Array:
    """numerator / denominator, 0 where denominator is 0 (no inf in either branch: safe grads)."""
    safe = jnp.where(denominator > 0, denominator, 1.0)
    return jnp.where(denominator > 0, numerator / safe, 0.0)


def masked_sum(values: jax.Array, mask: jax.Array, axis: int | None = None) -> jax.Array:
    """Σ_i m_i v_i over `axis` (all axes when None), in float32."""
    values = jnp.asarray(values, jnp.float32)
    return jnp.sum(jnp.where(_as_bool(mask), values, 0.0), axis=axis)


def masked_count(mask: jax.Array, axis: int | None = None) -> jax.Array:
    """Σ_i m_i over `axis`: the number of real entries, as float32."""
    return jnp.sum(_as_bool(mask).astype(jnp.float32), axis=axis)


def masked_mean(values: jax.Array, mask: jax.Array, axis: int | None = None) -> jax.Array:
    """Σ m v / Σ m over `axis`; 0 (with zero gradient) where the mask is empty.

    An empty mask returns 0 rather than NaN so that a batch with nothing to learn from (e.g.
    every Online DPO pair a tie) is a no-op update instead of poisoning the parameters.
    """
    return _safe_divide(masked_sum(values, mask, axis), masked_count(mask, axis))


def masked_var(values: jax.Array, mask: jax.Array, unbiased: bool = True) -> jax.Array:
    """Variance of the real entries: mean_m((v − mean_m v)²), times n/(n−1) when `unbiased`.

    Matches TRL's `masked_var` (Bessel-corrected by default). With n ≤ 1 the variance is 0.
    """
    centered = jnp.asarray(values, jnp.float32) - masked_mean(values, mask)
    variance = masked_mean(centered**2, mask)
    if unbiased:
        count = masked_count(mask)
        variance = variance * count / jnp.maximum(count - 1.0, 1.0)
    return variance


def masked_whiten(
    values: jax.Array, mask: jax.Array, shift_mean: bool = True, eps: float = 1e-8
) -> jax.Array:
    """(v − μ) / sqrt(σ² + eps) with μ, σ² over the real entries only (σ² Bessel-corrected).

    As TRL's `masked_whiten` (used by the paper's PPO for advantages): with `shift_mean=False`
    the mean is added back, v ↦ (v − μ)/sqrt(σ² + eps) + μ (used for rewards). Statistics come
    from every real entry of the whole array (batch-wide, not per row). Unlike TRL, masked-out
    entries are returned as 0 rather than left for the caller to fill.
    """
    values = jnp.asarray(values, jnp.float32)
    mean = masked_mean(values, mask)
    whitened = (values - mean) * jax.lax.rsqrt(masked_var(values, mask) + eps)
    if not shift_mean:
        whitened = whitened + mean
    return jnp.where(_as_bool(mask), whitened, 0.0)


def sequence_logprobs(token_logprobs: jax.Array, mask: jax.Array) -> jax.Array:
    """log π(y|x) = Σ_t m_t log π(y_t | x, y_<t): [..., T] token log-probs → [...]."""
    return masked_sum(token_logprobs, mask, axis=-1)


def clipped_surrogate(
    log_ratio: jax.Array, advantages: jax.Array, clip: float
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """PPO's clipped surrogate, element-wise: max(−A ρ, −A clip(ρ, 1−ε, 1+ε)), ρ = exp(log_ratio).

    Returns (losses, is_clipped, ratio). `is_clipped` marks elements where the clipped term is
    strictly larger, i.e. where the gradient is zero (TRL's `pg_clipfrac` numerator).
    `log_ratio` = log π_θ − log π_old, per token (PPO, GRPO) or per sequence (RLOO).
    """
    ratio = jnp.exp(jnp.asarray(log_ratio, jnp.float32))
    advantages = jnp.asarray(advantages, jnp.float32)
    unclipped = -advantages * ratio
    clipped = -advantages * jnp.clip(ratio, 1.0 - clip, 1.0 + clip)
    return jnp.maximum(unclipped, clipped), clipped > unclipped, ratio


def group_rewards(rewards: jax.Array, k: int) -> jax.Array:
    """[num_prompts·k] prompt-major rewards (a prompt's k samples adjacent) → [num_prompts, k].

    Raises ValueError (at trace time: shapes are static) when k is not an int ≥ 1 or does not
    divide the number of rewards.
    """
    rewards = jnp.asarray(rewards, jnp.float32)
    if isinstance(k, bool) or not isinstance(k, int | np.integer) or k < 1:
        raise ValueError(f"samples per prompt k must be a positive int, got {k!r}")
    if rewards.ndim != 1 or rewards.shape[0] % k:
        raise ValueError(
            f"rewards of shape {rewards.shape} cannot be grouped into prompts of k={k} samples; "
            "expected a 1-D array of num_prompts*k rewards, the k samples of a prompt adjacent"
        )
    return rewards.reshape(-1, k)
