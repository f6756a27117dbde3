"""RLHF losses and advantage estimators as pure, jit-able functions (arrays in, arrays out).

Every loss returns `(loss, metrics)`; `registry.get_loss_spec(name)` picks one by config name.
Sequence log-probs are sums over response tokens under a mask that is 1 up to and including EOS.
"""

from jaxrlhf.losses.best_of_k import best_of_k_indices, sft_nll_loss
from jaxrlhf.losses.common import (
    clipped_surrogate,
    group_rewards,
    masked_count,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    sequence_logprobs,
)
from jaxrlhf.losses.copg import copg_loss, group_pair_indices
from jaxrlhf.losses.grpo import grpo_advantages, grpo_loss
from jaxrlhf.losses.importance import (
    CORRECTIONS,
    apply_correction,
    logprob_gap_metrics,
    truncated_importance_weights,
)
from jaxrlhf.losses.inputs import LossInputs, PolicyFunctions
from jaxrlhf.losses.online_dpo import online_dpo_loss, select_pairs
from jaxrlhf.losses.ppo import (
    compute_gae,
    last_token_one_hot,
    ppo_loss,
    ppo_per_token_rewards,
    ppo_policy_loss,
    ppo_value_loss,
)
from jaxrlhf.losses.registry import LOSSES, LossSpec, get_loss_spec
from jaxrlhf.losses.rloo import kl_penalized_rewards, rloo_advantages, rloo_loss

__all__ = [
    "CORRECTIONS",
    "LOSSES",
    "LossInputs",
    "LossSpec",
    "PolicyFunctions",
    "apply_correction",
    "best_of_k_indices",
    "clipped_surrogate",
    "compute_gae",
    "copg_loss",
    "get_loss_spec",
    "group_pair_indices",
    "group_rewards",
    "grpo_advantages",
    "grpo_loss",
    "kl_penalized_rewards",
    "last_token_one_hot",
    "logprob_gap_metrics",
    "masked_count",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "online_dpo_loss",
    "ppo_loss",
    "ppo_per_token_rewards",
    "ppo_policy_loss",
    "ppo_value_loss",
    "rloo_advantages",
    "rloo_loss",
    "select_pairs",
    "sequence_logprobs",
    "sft_nll_loss",
    "truncated_importance_weights",
]
