"""The missing-EOS penalty (task rewards: `jaxrlhf.data.task_registry.verifier`, reward models:
`jaxrlhf.stages.reward`).

A response that ends without EOS (the sampler hit max_tokens) gets the fixed score
`penalty_reward_value` instead of its task score (−1 TLDR, −10 No Robots in the paper).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def apply_eos_penalty(
    scores: np.ndarray, finished_with_eos: Sequence[bool], penalty_reward_value: float | None
) -> np.ndarray:
    """scores with every response lacking EOS replaced by `penalty_reward_value` (None = off)."""
    scores = np.asarray(scores, np.float32)
    if penalty_reward_value is None:
        return scores
    return np.where(np.asarray(finished_with_eos), scores, np.float32(penalty_reward_value))
