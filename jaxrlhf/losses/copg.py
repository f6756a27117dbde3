"""CoPG: Contrastive Policy Gradient (Flet-Berliac et al. 2024, arXiv:2406.19185).

An off-policy policy gradient without importance ratios: on pairs (y, y′) of responses to the
same prompt, sampled by any behaviour policy μ (here: the possibly stale generator), regress the
reward difference against the policy's implicit-reward difference. With k = 2 and on-policy
samples its gradient is RLOO's (see `copg_loss`); with r(y⁺) − r(y⁻) = ½ it is β/4 times IPO.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf.losses.common import masked_count, masked_mean
from jaxrlhf.losses.inputs import LossInputs, masked_sequence_logprobs, pair_batch


def group_pair_indices(num_prompts: int, k: int) -> tuple[jax.Array, jax.Array]:
    """(first_idx, second_idx), each [num_prompts · k(k−1)/2]: every unordered pair i < j of
    samples within a prompt's group, as indices into the flat prompt-major [num_prompts·k] batch.

    All pairs of independent samples keep the CoPG estimate unbiased (picking best/worst would
    not). k = 2 gives one pair per prompt: (0, 1), (2, 3), ...
    """
    if k < 2:
        raise ValueError(f"CoPG needs k >= 2 samples per prompt to form a pair, got k={k}")
    first, second = np.triu_indices(k, 1)
    offsets = np.arange(num_prompts)[:, None] * k
    return (
        jnp.asarray((offsets + first).reshape(-1), jnp.int32),
        jnp.asarray((offsets + second).reshape(-1), jnp.int32),
    )


def copg_loss(
    first_logps: jax.Array,
    second_logps: jax.Array,
    ref_first_logps: jax.Array,
    ref_second_logps: jax.Array,
    first_rewards: jax.Array,
    second_rewards: jax.Array,
    beta: float,
    valid: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """CoPG on [N] pairs (y, y′) of sequence log-probs and scalar rewards.

        Δ_i = [r(y) − r(y′)] − β [(log π(y) − log π_ref(y)) − (log π(y′) − log π_ref(y′))]
        loss = Σ_i valid_i Δ_i² / (4β Σ_i valid_i)

    Δ² is the paper's sample loss ℓ(y, y′; π) (the squared difference of the regularised
    rewards R^π_β(y) = r(y) − β log π(y)/π_ref(y)). Dividing by 4β makes the gradient exactly
    −½ Δ (∇log π(y) − ∇log π(y′)), the paper's contrastive policy gradient of the pair, whose
    scale does not depend on β: with k = 2, on-policy samples and kl_coef = β, it equals the
    RLOO gradient at the same learning rate. The minimiser is unchanged by the constant. No
    importance ratio: the samples may come from a stale policy. Reference log-probs and
    rewards are constants; `valid` [N] (bool) drops pairs.

    Metrics (means over valid pairs): reward_gap = |r(y) − r(y′)|, implicit_gap =
    |β Δ log π/π_ref|, residual_rms = sqrt(mean Δ²), and accuracy = frac of pairs with
    r(y) ≠ r(y′) whose implicit gap has the reward gap's sign; `weight/accuracy` = the count of
    those pairs, which a micro-batched step (`jaxrlhf.train_state.build_train_step`) weights
    accuracy by (residual_rms it combines as a root mean square).
    """
    first_logps = jnp.asarray(first_logps, jnp.float32)
    second_logps = jnp.asarray(second_logps, jnp.float32)
    ref_first = jax.lax.stop_gradient(jnp.asarray(ref_first_logps, jnp.float32))
    ref_second = jax.lax.stop_gradient(jnp.asarray(ref_second_logps, jnp.float32))
    first_rewards = jax.lax.stop_gradient(jnp.asarray(first_rewards, jnp.float32))
    second_rewards = jax.lax.stop_gradient(jnp.asarray(second_rewards, jnp.float32))
    valid = jnp.ones(first_logps.shape, bool) if valid is None else jnp.asarray(valid, bool)

    reward_gap = first_rewards - second_rewards
    implicit_gap = beta * ((first_logps - ref_first) - (second_logps - ref_second))
    residual = reward_gap - implicit_gap
    loss = masked_mean(residual**2, valid) / (4.0 * beta)

    implicit_gap = jax.lax.stop_gradient(implicit_gap)
    ordered = valid & (reward_gap != 0)
    metrics = {
        "loss": loss,
        "reward_gap": masked_mean(jnp.abs(reward_gap), valid),
        "implicit_gap": masked_mean(jnp.abs(implicit_gap), valid),
        "residual_rms": jnp.sqrt(masked_mean(jax.lax.stop_gradient(residual) ** 2, valid)),
        "accuracy": masked_mean(jnp.sign(implicit_gap) == jnp.sign(reward_gap), ordered),
        "weight/accuracy": masked_count(ordered),
    }
    return loss, metrics


# The loss's registry entry (jaxrlhf.losses.registry): batch preparation and the loss call.


def prepare_copg(inputs: LossInputs, cfg) -> dict[str, np.ndarray]:
    """Every pair of samples within each prompt's group (`group_pair_indices`)."""
    k = inputs.samples_per_prompt
    first, second = group_pair_indices(len(inputs.scores) // k, k)
    return pair_batch(inputs, np.asarray(first), np.asarray(second), np.ones(len(first)))


def copg_objective(models, cfg, params, batch):
    """`copg_loss` on the pairs of `prepare_copg`, with cfg.beta."""
    return copg_loss(
        masked_sequence_logprobs(models, params, batch, "first_"),
        masked_sequence_logprobs(models, params, batch, "second_"),
        batch["ref_first"], batch["ref_second"], batch["reward_first"], batch["reward_second"],
        cfg.beta, valid=batch["valid"],
    )  # fmt: skip
