"""Online DPO (Guo et al. 2024; the asynchronous-RLHF paper's most off-policy-robust loss).

For each prompt, K samples are scored; the best and worst form a preference pair and the
DPO/IPO loss is applied to the policy's sequence log-probs against the reference model's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf.losses.common import group_rewards, masked_mean
from jaxrlhf.losses.inputs import LossInputs, masked_sequence_logprobs, pair_batch

LOSS_TYPES = ("sigmoid", "ipo")


def select_pairs(rewards: jax.Array, k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(chosen_idx, rejected_idx, valid), each [num_prompts], for prompt-major rewards [P·k].

    chosen = argmax, rejected = argmin of each prompt's k rewards, as indices into the flat
    [P·k] batch; valid = max > min. When all k rewards are equal both indices are the group's
    first sample and valid is False: a tie carries no preference, so it must give no gradient.
    Among equal maxima (or minima) the first is taken.
    """
    grouped = group_rewards(rewards, k)
    if k < 2:
        raise ValueError(f"Online DPO needs k >= 2 samples per prompt to form a pair, got k={k}")
    offsets = jnp.arange(grouped.shape[0], dtype=jnp.int32) * k
    chosen = offsets + jnp.argmax(grouped, axis=1).astype(jnp.int32)
    rejected = offsets + jnp.argmin(grouped, axis=1).astype(jnp.int32)
    valid = jnp.max(grouped, axis=1) > jnp.min(grouped, axis=1)
    return chosen, rejected, valid


def online_dpo_loss(
    chosen_logps: jax.Array,
    rejected_logps: jax.Array,
    ref_chosen_logps: jax.Array,
    ref_rejected_logps: jax.Array,
    beta: float,
    loss_type: str = "sigmoid",
    valid: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """DPO/IPO loss on [N] sequence log-probs of N (chosen y⁺, rejected y⁻) pairs.

        h = [log π(y⁺) − log π(y⁻)] − [log π_ref(y⁺) − log π_ref(y⁻)]
        sigmoid (DPO):  ℓ = −log σ(β h)            (computed as −log_sigmoid(β h))
        ipo:            ℓ = (h − 1/(2β))²
        loss = Σ_i valid_i ℓ_i / Σ_i valid_i       (0 if no pair is valid)

    `valid` [N] (bool) drops pairs, e.g. ties from `select_pairs`; they get exactly zero gradient.
    Reference log-probs are constants (stop_gradient).

    Metrics (means over valid pairs): accuracy = frac(h > 0); chosen_rewards / rejected_rewards =
    β(log π − log π_ref) of y⁺ / y⁻ (DPO's implicit reward); margins = chosen − rejected = β h;
    valid_fraction = frac of pairs kept, a mean over all N pairs: `weight/valid_fraction` = N
    says so to a micro-batched step (`jaxrlhf.train_state.build_train_step`), which weights the
    others by the valid pairs.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(
            f"unknown Online DPO loss_type {loss_type!r}; expected one of {LOSS_TYPES}"
        )
    chosen_logps = jnp.asarray(chosen_logps, jnp.float32)
    rejected_logps = jnp.asarray(rejected_logps, jnp.float32)
    ref_chosen = jax.lax.stop_gradient(jnp.asarray(ref_chosen_logps, jnp.float32))
    ref_rejected = jax.lax.stop_gradient(jnp.asarray(ref_rejected_logps, jnp.float32))
    valid = jnp.ones(chosen_logps.shape, bool) if valid is None else jnp.asarray(valid, bool)

    chosen_logratio = chosen_logps - ref_chosen
    rejected_logratio = rejected_logps - ref_rejected
    h = chosen_logratio - rejected_logratio
    if loss_type == "sigmoid":
        losses = -jax.nn.log_sigmoid(beta * h)
    else:
        losses = (h - 1.0 / (2.0 * beta)) ** 2
    loss = masked_mean(losses, valid)

    chosen_rewards = jax.lax.stop_gradient(beta * chosen_logratio)
    rejected_rewards = jax.lax.stop_gradient(beta * rejected_logratio)
    metrics = {
        "loss": loss,
        "accuracy": masked_mean(h > 0, valid),
        "margins": masked_mean(chosen_rewards - rejected_rewards, valid),
        "chosen_rewards": masked_mean(chosen_rewards, valid),
        "rejected_rewards": masked_mean(rejected_rewards, valid),
        "valid_fraction": jnp.mean(valid.astype(jnp.float32)),
        "weight/valid_fraction": jnp.float32(valid.shape[0]),
    }
    return loss, metrics


# The loss's registry entry (jaxrlhf.losses.registry): batch preparation and the loss call.


def prepare_online_dpo(inputs: LossInputs, cfg) -> dict[str, np.ndarray]:
    """Each prompt's best and worst sample (`select_pairs`) as a pair; ties are not valid."""
    chosen, rejected, valid = select_pairs(inputs.scores, inputs.samples_per_prompt)
    return pair_batch(inputs, np.asarray(chosen), np.asarray(rejected), np.asarray(valid))


def pair_rows(scores: np.ndarray, k: int) -> np.ndarray:
    """[2·num_prompts] the chosen rows, then the rejected ones: all the loss reads of the
    reference (with K > 2 samples per prompt, the others are never compared)."""
    chosen, rejected, _ = select_pairs(scores, k)
    return np.concatenate([np.asarray(chosen), np.asarray(rejected)])


def online_dpo_objective(models, cfg, params, batch, loss_type: str = "sigmoid"):
    """`online_dpo_loss` on the pairs of `prepare_online_dpo`, with cfg.beta."""
    return online_dpo_loss(
        masked_sequence_logprobs(models, params, batch, "first_"),
        masked_sequence_logprobs(models, params, batch, "second_"),
        batch["ref_first"], batch["ref_second"], cfg.beta, loss_type, valid=batch["valid"],
    )  # fmt: skip
