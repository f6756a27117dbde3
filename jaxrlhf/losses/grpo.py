"""GRPO (Shao et al. 2024, DeepSeekMath): group-normalised sequence advantages, no value model.

Each prompt's k samples form a group; a sample's advantage is its reward standardised within
the group, broadcast to every token of the response, and trained with PPO's token-level clipped
surrogate. An optional KL penalty to the reference policy uses the k3 estimator, as GRPO does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf.losses.common import group_rewards, masked_mean
from jaxrlhf.losses.inputs import LossInputs, corrected
from jaxrlhf.losses.ppo import ppo_policy_loss


def grpo_advantages(rewards: jax.Array, k: int, eps: float = 1e-6) -> jax.Array:
    """A_i = (R_i − mean_g R) / (std_g R + eps) within each prompt's group g of k samples.

    rewards [num_prompts·k], prompt-major. std is the unbiased (Bessel, ddof=1) sample standard
    deviation, as `torch.std` in TRL's GRPOTrainer. A group whose rewards are all equal gets
    advantage 0 for every sample. Needs k ≥ 2.
    """
    grouped = group_rewards(rewards, k)
    if k < 2:
        raise ValueError(f"GRPO needs k >= 2 samples per prompt to normalise, got k={k}")
    mean = jnp.mean(grouped, axis=1, keepdims=True)
    std = jnp.std(grouped, axis=1, keepdims=True, ddof=1)
    return ((grouped - mean) / (std + eps)).reshape(-1)


def grpo_loss(
    new_logprobs: jax.Array,
    old_logprobs: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    clip: float = 0.2,
    ref_logprobs: jax.Array | None = None,
    kl_coef: float = 0.0,
    importance_weights: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Token-level clipped surrogate with the sequence advantage broadcast, plus optional KL.

        loss = Σ m_t w_t max(−A ρ_t, −A clip(ρ_t, 1−ε, 1+ε)) / Σ m_t
               + kl_coef · Σ m_t (exp(q_t) − q_t − 1) / Σ m_t,   q_t = log π_ref − log π_θ

    new/old/ref log-probs and mask [B, T]; advantages [B] (from `grpo_advantages`). The
    normalisation is over every real token of the batch (token-level, as TRL's current default
    and DAPO) rather than GRPO's original per-sequence mean. The KL term is added when
    `ref_logprobs` is given (kl_coef may then be traced). Metrics: those of `ppo_policy_loss`,
    plus kl (the k3 estimate) when computed.
    """
    advantages = jnp.asarray(advantages, jnp.float32)
    token_advantages = jnp.broadcast_to(advantages[:, None], jnp.shape(new_logprobs))
    loss, metrics = ppo_policy_loss(
        new_logprobs, old_logprobs, token_advantages, mask, clip, importance_weights
    )
    if ref_logprobs is None:
        if isinstance(kl_coef, int | float) and kl_coef != 0:
            raise ValueError(f"grpo_loss with kl_coef={kl_coef} needs ref_logprobs")
    else:
        mask = jnp.asarray(mask).astype(bool)
        ref_logprobs = jax.lax.stop_gradient(jnp.asarray(ref_logprobs, jnp.float32))
        log_ref_ratio = jnp.where(mask, ref_logprobs - jnp.asarray(new_logprobs, jnp.float32), 0.0)
        kl = masked_mean(jnp.expm1(log_ref_ratio) - log_ref_ratio, mask)
        loss = loss + kl_coef * kl
        metrics["kl"] = jax.lax.stop_gradient(kl)
    metrics["loss"] = loss
    return loss, metrics


# The loss's registry entry (jaxrlhf.losses.registry): batch preparation and the loss call.


def prepare_grpo(inputs: LossInputs, cfg) -> dict[str, np.ndarray]:
    """Every row with its group-normalised advantage, π_old's token log-probs, the reference's
    when cfg.kl_coef > 0 (the k3 KL term), and the per-token off-policy correction
    cfg.is_correction (`jaxrlhf.losses.importance`): truncated weights min(π_old/π_sampler,
    cap), or a loss mask without the dropped tokens."""
    batch = inputs.rows()
    batch["old_logprobs"] = inputs.old_logprobs.astype(np.float32)
    batch["advantages"] = np.asarray(grpo_advantages(inputs.scores, inputs.samples_per_prompt))
    if cfg.kl_coef:
        batch["ref_logprobs"] = inputs.ref_logprobs.astype(np.float32)
    return batch | corrected(inputs, cfg, per="token")


def grpo_objective(models, cfg, params, batch):
    """`grpo_loss` on the rows of `prepare_grpo`, with cfg.clip and cfg.kl_coef."""
    ref = batch.get("ref_logprobs")
    return grpo_loss(
        models.logprobs(params, batch), batch["old_logprobs"], batch["advantages"],
        batch["loss_mask"], cfg.clip, ref_logprobs=ref,
        kl_coef=cfg.kl_coef if ref is not None else 0.0,
        importance_weights=batch.get("importance_weights"),
    )  # fmt: skip
