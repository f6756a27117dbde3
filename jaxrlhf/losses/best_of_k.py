"""Best-of-K SFT: keep each prompt's highest-scored sample and train on it by NLL.

The paper's control for Online DPO: it sees the same K samples, but learns only from the best.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf.losses.common import group_rewards, masked_count, masked_mean
from jaxrlhf.losses.inputs import LossInputs


def best_of_k_indices(rewards: jax.Array, k: int) -> jax.Array:
    """[num_prompts] indices into the flat prompt-major [num_prompts·k] batch of each prompt's
    highest-reward sample (the first one among equal maxima)."""
    grouped = group_rewards(rewards, k)
    offsets = jnp.arange(grouped.shape[0], dtype=jnp.int32) * k
    return offsets + jnp.argmax(grouped, axis=1).astype(jnp.int32)


def sft_nll_loss(
    token_logprobs: jax.Array, mask: jax.Array
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """loss = −Σ_t m_t log π(y_t | x, y_<t) / Σ_t m_t: mean NLL over every real token of the batch.

    token_logprobs, mask [B, T]. Metrics: loss, num_tokens.
    """
    loss = -masked_mean(token_logprobs, mask)
    return loss, {"loss": loss, "num_tokens": masked_count(mask)}


# The loss's registry entry (jaxrlhf.losses.registry): batch preparation and the loss call.


def prepare_best_of_k(inputs: LossInputs, cfg) -> dict[str, np.ndarray]:
    """The rows of each prompt's highest-scored sample."""
    return inputs.rows(np.asarray(best_of_k_indices(inputs.scores, inputs.samples_per_prompt)))


def best_of_k_objective(models, cfg, params, batch):
    """`sft_nll_loss` on the rows of `prepare_best_of_k`."""
    return sft_nll_loss(models.logprobs(params, batch), batch["loss_mask"])
