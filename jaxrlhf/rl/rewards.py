"""Verifiable rewards and the missing-EOS penalty.

A response that ends without EOS (the sampler hit max_tokens) gets the fixed score
`penalty_reward_value` instead of its task score (−1 TLDR, −10 No Robots in the paper).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

from jaxrlhf.data.arithmetic import score_answer

_GSM8K_ANSWER = re.compile(r"####\s*(-?[\d,\.]+)")


def gsm8k_reward(text: str, answer: str) -> float:
    """1.0 when the response's `#### n` equals the reference's `#### n` (commas ignored)."""

    def final(s: str) -> str | None:
        found = _GSM8K_ANSWER.findall(s)
        return found[-1].replace(",", "").rstrip(".") if found else None

    predicted, expected = final(text), final(answer)
    return float(predicted is not None and predicted == expected)


def arithmetic_reward(text: str, answer: int) -> float:
    """1.0 when the last number in the response equals the sum."""
    return score_answer(text, answer)


def apply_eos_penalty(
    scores: np.ndarray, finished_with_eos: Sequence[bool], penalty_reward_value: float | None
) -> np.ndarray:
    """scores with every response lacking EOS replaced by `penalty_reward_value` (None = off)."""
    scores = np.asarray(scores, np.float32)
    if penalty_reward_value is None:
        return scores
    return np.where(np.asarray(finished_with_eos), scores, np.float32(penalty_reward_value))
