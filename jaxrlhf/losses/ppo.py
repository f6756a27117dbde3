"""PPO for RLHF (Ouyang et al. 2022; as in the paper's reference code, TRL's PPOv2Trainer).

Per-token rewards are the KL penalty with the reward model's score added at the last real
token; advantages come from GAE over the response; the loss is the token-level clipped
surrogate plus a clipped value loss. Whitening (`common.masked_whiten`) is left to the caller,
once per batch, before minibatching.

All [B, T] arrays share the response mask convention: 1 on real tokens (up to and including EOS),
0 elsewhere; the real tokens of a row must be contiguous.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf.losses.common import clipped_surrogate, masked_mean, masked_whiten
from jaxrlhf.losses.inputs import LossInputs, corrected


def last_token_one_hot(mask: jax.Array) -> jax.Array:
    """[B, T] float32: 1 at each row's last real token, 0 elsewhere (all 0 for an empty row)."""
    mask = jnp.asarray(mask).astype(bool)
    length = mask.shape[-1]
    last = length - 1 - jnp.argmax(mask[..., ::-1], axis=-1)
    one_hot = jnp.arange(length) == last[..., None]
    return (one_hot & mask).astype(jnp.float32)


def ppo_per_token_rewards(
    score: jax.Array,
    logprobs_old: jax.Array,
    ref_logprobs: jax.Array,
    mask: jax.Array,
    kl_coef: float,
) -> jax.Array:
    """r_t = −kl_coef · (log π_old(y_t) − log π_ref(y_t)) · m_t, plus score at the last real token.

    score [B]; the rest [B, T]. The last real token is the EOS (or the final token of a
    response cut at max length). Zero where the mask is 0.
    """
    mask = jnp.asarray(mask).astype(bool)
    kl = jnp.asarray(logprobs_old, jnp.float32) - jnp.asarray(ref_logprobs, jnp.float32)
    non_score = jnp.where(mask, -kl_coef * kl, 0.0)
    return non_score + jnp.asarray(score, jnp.float32)[:, None] * last_token_one_hot(mask)


def compute_gae(
    rewards: jax.Array,
    values: jax.Array,
    mask: jax.Array,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[jax.Array, jax.Array]:
    """Generalised advantage estimation (Schulman et al. 2016) over [B, T], raw (not whitened).

        δ_t = r_t + γ V_{t+1} − V_t,       A_t = δ_t + γλ A_{t+1},       R_t = A_t + V_t

    with r and V taken as 0 wherever the mask is 0, so the value after a row's last real token
    is 0 (the episode ends at EOS: bootstrap 0) and padding contributes nothing. Returns
    (advantages, returns), both 0 where the mask is 0. Runs as a reverse-time `lax.scan`.
    """
    mask = jnp.asarray(mask).astype(bool)
    rewards = jnp.where(mask, jnp.asarray(rewards, jnp.float32), 0.0)
    values = jnp.where(mask, jnp.asarray(values, jnp.float32), 0.0)
    next_values = jnp.concatenate([values[:, 1:], jnp.zeros_like(values[:, :1])], axis=1)
    deltas = rewards + gamma * next_values - values

    def step(next_advantage, delta_t):
        advantage = delta_t + gamma * lam * next_advantage
        return advantage, advantage

    _, advantages_time_major = jax.lax.scan(
        step, jnp.zeros(deltas.shape[0], jnp.float32), deltas.T, reverse=True
    )
    advantages = jnp.where(mask, advantages_time_major.T, 0.0)
    returns = jnp.where(mask, advantages + values, 0.0)
    return advantages, returns


def ppo_policy_loss(
    new_logprobs: jax.Array,
    old_logprobs: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    clip: float = 0.2,
    importance_weights: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Token-level clipped surrogate, masked mean over every real token of the batch.

        ρ_t = exp(log π_θ(y_t) − log π_old(y_t))
        loss = Σ m_t w_t max(−A_t ρ_t, −A_t clip(ρ_t, 1−ε, 1+ε)) / Σ m_t

    All arrays [B, T]; w the optional truncated importance weights (default 1). Old log-probs
    and advantages are constants. Metrics: clipfrac, ratio_mean, ratio_max (over real tokens),
    approx_kl = ½ mean_m((log ρ)²).
    """
    mask = jnp.asarray(mask).astype(bool)
    old_logprobs = jax.lax.stop_gradient(jnp.asarray(old_logprobs, jnp.float32))
    advantages = jax.lax.stop_gradient(jnp.asarray(advantages, jnp.float32))
    # Padding may hold anything (the model's logits past EOS); zero it before exp.
    log_ratio = jnp.where(mask, jnp.asarray(new_logprobs, jnp.float32) - old_logprobs, 0.0)
    losses, is_clipped, ratio = clipped_surrogate(log_ratio, advantages, clip)
    if importance_weights is not None:
        losses = losses * jax.lax.stop_gradient(importance_weights)
    loss = masked_mean(losses, mask)
    log_ratio = jax.lax.stop_gradient(log_ratio)
    ratio = jax.lax.stop_gradient(ratio)
    metrics = {
        "policy_loss": loss,
        "clipfrac": masked_mean(is_clipped, mask),
        "ratio_mean": masked_mean(ratio, mask),
        "ratio_max": jnp.max(jnp.where(mask, ratio, 0.0)),
        "approx_kl": 0.5 * masked_mean(log_ratio**2, mask),
    }
    return loss, metrics


def ppo_value_loss(
    new_values: jax.Array,
    old_values: jax.Array,
    returns: jax.Array,
    mask: jax.Array,
    clip_value: float = 0.2,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Clipped value loss, masked mean over real tokens:

        V_clip = clip(V_θ, V_old − ε_v, V_old + ε_v)
        loss = ½ Σ m_t max((V_θ − R_t)², (V_clip − R_t)²) / Σ m_t

    All arrays [B, T]; old values and returns are constants. Metrics: value_clipfrac (fraction
    of tokens where the clipped term is strictly larger), value_mean.
    """
    mask = jnp.asarray(mask).astype(bool)
    new_values = jnp.asarray(new_values, jnp.float32)
    old_values = jax.lax.stop_gradient(jnp.asarray(old_values, jnp.float32))
    returns = jax.lax.stop_gradient(jnp.asarray(returns, jnp.float32))
    clipped_values = jnp.clip(new_values, old_values - clip_value, old_values + clip_value)
    unclipped_losses = (new_values - returns) ** 2
    clipped_losses = (clipped_values - returns) ** 2
    loss = 0.5 * masked_mean(jnp.maximum(unclipped_losses, clipped_losses), mask)
    metrics = {
        "value_loss": loss,
        "value_clipfrac": masked_mean(clipped_losses > unclipped_losses, mask),
        "value_mean": masked_mean(jax.lax.stop_gradient(new_values), mask),
    }
    return loss, metrics


def ppo_loss(
    new_logprobs: jax.Array,
    old_logprobs: jax.Array,
    advantages: jax.Array,
    new_values: jax.Array,
    old_values: jax.Array,
    returns: jax.Array,
    mask: jax.Array,
    clip: float = 0.2,
    clip_value: float = 0.2,
    vf_coef: float = 0.1,
    importance_weights: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """loss = policy_loss + vf_coef · value_loss (see `ppo_policy_loss`, `ppo_value_loss`).

    `advantages` are expected whitened already (`masked_whiten` over the whole batch). Metrics
    are the union of both parts plus the total `loss`.
    """
    policy_loss, policy_metrics = ppo_policy_loss(
        new_logprobs, old_logprobs, advantages, mask, clip, importance_weights
    )
    value_loss, value_metrics = ppo_value_loss(new_values, old_values, returns, mask, clip_value)
    loss = policy_loss + vf_coef * value_loss
    return loss, {"loss": loss, **policy_metrics, **value_metrics}


# The loss's registry entry (jaxrlhf.losses.registry): batch preparation and the loss call.


def prepare_ppo(inputs: LossInputs, cfg) -> dict[str, np.ndarray]:
    """Every row with GAE advantages (whitened over the whole batch when
    cfg.whiten_advantages) and returns of the per-token KL-penalised rewards (the score alone
    when kl_coef is 0: no reference then), on the value model's estimates before the update;
    π_old's token log-probs, and the per-token off-policy correction cfg.is_correction
    (`jaxrlhf.losses.importance`; a dropped token leaves the policy and the value loss)."""
    mask = inputs.loss_mask
    ref = inputs.ref_logprobs if cfg.kl_coef else inputs.old_logprobs  # no KL term without it
    rewards = ppo_per_token_rewards(inputs.scores, inputs.old_logprobs, ref, mask, cfg.kl_coef)
    advantages, returns = compute_gae(rewards, inputs.old_values, mask, cfg.gamma, cfg.lam)
    if cfg.whiten_advantages:
        advantages = masked_whiten(advantages, mask)
    batch = inputs.rows()
    batch |= {
        "old_logprobs": inputs.old_logprobs.astype(np.float32),
        "old_values": inputs.old_values.astype(np.float32),
        "advantages": np.asarray(advantages, np.float32),
        "returns": np.asarray(returns, np.float32),
    }
    return batch | corrected(inputs, cfg, per="token")


def ppo_objective(models, cfg, params, batch):
    """`ppo_loss` on the rows of `prepare_ppo`: the policy's and the value model's forward."""
    return ppo_loss(
        models.logprobs(params, batch), batch["old_logprobs"], batch["advantages"],
        models.values(params, batch), batch["old_values"], batch["returns"],
        batch["loss_mask"], cfg.clip, cfg.clip_value, cfg.vf_coef,
        importance_weights=batch.get("importance_weights"),
    )  # fmt: skip
