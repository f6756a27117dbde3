"""The offline task: two-digit additions with a verifiable answer.

Prompts are asked in the model's chat template ("What is 37 + 45? Answer with just the number.")
and a response is correct when the last number in it equals the sum. Train and held-out splits
never share a question.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

QUESTION = "What is {a} + {b}? Answer with just the number."
_NUMBER = re.compile(r"-?\d+")


@dataclasses.dataclass(frozen=True)
class Problem:
    id: str
    question: str
    answer: int


def make_problems(count: int, split: str, seed: int = 0, low: int = 10, high: int = 99):
    """`count` distinct problems of `split` ("train" or "eval"); the splits are disjoint.

    Pairs (a, b) are assigned to a split by a hash of the pair, so the split does not depend on
    `count` or `seed`, and the seed only chooses which pairs of that split are drawn.
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    pairs = [(a, b) for a in range(low, high + 1) for b in range(low, high + 1)]
    in_split = [p for p in pairs if ((p[0] * 131 + p[1] * 71) % 10 == 0) == (split == "eval")]
    if count > len(in_split):
        raise ValueError(f"asked for {count} {split} problems, only {len(in_split)} exist")
    order = np.random.default_rng(seed).permutation(len(in_split))[:count]
    return [
        Problem(f"{split}-{a}+{b}", QUESTION.format(a=a, b=b), a + b)
        for a, b in (in_split[i] for i in order)
    ]


def score_answer(text: str, answer: int) -> float:
    """1.0 if the last number in `text` equals `answer`, else 0.0."""
    numbers = _NUMBER.findall(text)
    return float(bool(numbers) and int(numbers[-1]) == answer)
