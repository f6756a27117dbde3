"""RLOO: REINFORCE with a leave-one-out baseline (Ahmadian et al. 2024), PPO-clipped per sequence.

As in the paper's reference code (TRL's RLOOTrainer): the KL penalty is folded into a sequence
reward, the baseline of a sample is the mean reward of the other k−1 samples of its prompt, and
the update clips the sequence-level importance ratio.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf.losses.common import clipped_surrogate, group_rewards, masked_mean, masked_sum
from jaxrlhf.losses.inputs import LossInputs, corrected


def kl_penalized_rewards(
    scores: jax.Array,
    logprobs_old: jax.Array,
    ref_logprobs: jax.Array,
    mask: jax.Array,
    kl_coef: float,
) -> jax.Array:
    """R_i = score_i − kl_coef · Σ_t m_t (log π_old(y_t) − log π_ref(y_t)).

    scores [B]; logprobs_old, ref_logprobs, mask [B, T] (per token). Returns [B].
    """
    kl = jnp.asarray(logprobs_old, jnp.float32) - jnp.asarray(ref_logprobs, jnp.float32)
    return jnp.asarray(scores, jnp.float32) - kl_coef * masked_sum(kl, mask, axis=-1)


def rloo_advantages(rewards: jax.Array, k: int) -> jax.Array:
    """A_i = R_i − (1/(k−1)) Σ_{j≠i} R_j within each prompt's group of k samples.

    rewards [num_prompts·k], prompt-major (a prompt's k samples adjacent). Returns the same
    shape. Equivalently A_i = k/(k−1) · (R_i − mean_group R). Needs k ≥ 2.
    """
    grouped = group_rewards(rewards, k)
    if k < 2:
        raise ValueError(f"RLOO needs k >= 2 samples per prompt for its baseline, got k={k}")
    baseline = (jnp.sum(grouped, axis=1, keepdims=True) - grouped) / (k - 1)
    return (grouped - baseline).reshape(-1)


def rloo_loss(
    new_seq_logps: jax.Array,
    old_seq_logps: jax.Array,
    advantages: jax.Array,
    clip: float = 0.2,
    importance_weights: jax.Array | None = None,
    kept: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Sequence-level clipped surrogate on [N] summed log-probs.

        ρ_i = exp(Σ_t log π_θ − Σ_t log π_old)
        loss = Σ_i k_i w_i · max(−A_i ρ_i, −A_i clip(ρ_i, 1−ε, 1+ε)) / Σ_i k_i

    with w the optional truncated importance weights (constant, default 1) and k the rows kept
    by an off-policy mask (default all; a dropped row gets zero gradient). Old log-probs and
    advantages are constants (stop_gradient). The metrics are over the kept rows.

    Metrics: clipfrac (fraction of sequences whose clipped term is active, zero gradient),
    ratio_mean, ratio_max, approx_kl = ½ mean((log ρ)²) (as TRL).
    """
    new_seq_logps = jnp.asarray(new_seq_logps, jnp.float32)
    old_seq_logps = jax.lax.stop_gradient(jnp.asarray(old_seq_logps, jnp.float32))
    advantages = jax.lax.stop_gradient(jnp.asarray(advantages, jnp.float32))
    log_ratio = new_seq_logps - old_seq_logps
    losses, is_clipped, ratio = clipped_surrogate(log_ratio, advantages, clip)
    if importance_weights is not None:
        losses = losses * jax.lax.stop_gradient(importance_weights)
    kept = jnp.ones_like(losses) if kept is None else jnp.asarray(kept)
    loss = masked_mean(losses, kept)
    log_ratio = jax.lax.stop_gradient(log_ratio)
    ratio = jax.lax.stop_gradient(ratio)
    metrics = {
        "loss": loss,
        "clipfrac": masked_mean(is_clipped, kept),
        "ratio_mean": masked_mean(ratio, kept),
        "ratio_max": jnp.max(jnp.where(kept > 0, ratio, 0.0)),
        "approx_kl": 0.5 * masked_mean(log_ratio**2, kept),
        "advantages_mean": masked_mean(advantages, kept),
    }
    return loss, metrics


# The loss's registry entry (jaxrlhf.losses.registry): batch preparation and the loss call.


def prepare_rloo(inputs: LossInputs, cfg) -> dict[str, np.ndarray]:
    """Every row with its leave-one-out advantage of the KL-penalised reward (the plain score
    when kl_coef is 0: no reference then), π_old's token log-probs, the off-policy correction
    cfg.is_correction (`jaxrlhf.losses.importance`: a sequence-level truncated weight
    min(Π_t π_old/π_sampler, cap); a loss mask without the dropped tokens or sequences; and
    under "mask", token weights M(r_t) on the sequence log-probs), and `kept`: 1 for a row
    with a token left in its mask (the rows the loss averages)."""
    rewards = inputs.scores
    if cfg.kl_coef:
        rewards = kl_penalized_rewards(
            inputs.scores, inputs.old_logprobs, inputs.ref_logprobs, inputs.loss_mask, cfg.kl_coef
        )
    batch = inputs.rows()
    batch["old_logprobs"] = inputs.old_logprobs.astype(np.float32)
    batch["advantages"] = np.asarray(rloo_advantages(rewards, inputs.samples_per_prompt))
    batch |= corrected(inputs, cfg, per="sequence")
    batch["kept"] = (batch["loss_mask"].sum(-1) > 0).astype(np.float32)
    return batch


def rloo_objective(models, cfg, params, batch):
    """`rloo_loss` on the rows of `prepare_rloo`, with cfg.clip: the sequence log-probs
    Σ_t w_t log π(y_t), w_t the loss mask times the token weights (under "mask")."""
    weights = batch["loss_mask"]
    if "token_weights" in batch:
        weights = weights * batch["token_weights"]
    return rloo_loss(
        (models.logprobs(params, batch) * weights).sum(-1),
        (batch["old_logprobs"] * weights).sum(-1),
        batch["advantages"], cfg.clip, importance_weights=batch.get("importance_weights"),
        kept=batch.get("kept"),
    )  # fmt: skip
