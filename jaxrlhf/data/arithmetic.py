"""The offline task: two-digit additions with a verifiable answer.

Prompts are asked in the model's chat template ("What is 37 + 45? Answer with just the number.")
and a response is correct when the last number in it equals the sum. The 8,100 pairs (a, b) with
10 <= a, b <= 99 are split by a hash of the unordered pair (`jaxrlhf.data.splits.hash_fraction`
of "min+max"): 80% train, 10% validation, 10% test, so carries, sums of three digits and sums
ending in 0 fall into every split in proportion, and no two splits share a question. "a + b" and
"b + a" are one question with one answer, so they always fall into the same split (hashing the
ordered pair put about 80% of the test questions' swapped twins in train).
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from jaxrlhf.data.splits import SPLITS, hash_fraction
from jaxrlhf.data.task_spec import TaskSpec
from jaxrlhf.data.types import PromptExample, SFTExample

QUESTION = "What is {a} + {b}? Answer with just the number."
_NUMBER = re.compile(r"-?\d+")
# Upper ends of each split's share of [0, 1) under the pair's hash.
_BOUNDS = {"train": (0.0, 0.8), "validation": (0.8, 0.9), "test": (0.9, 1.0)}


@dataclasses.dataclass(frozen=True)
class Problem:
    id: str
    question: str
    answer: int


def split_of(a: int, b: int) -> str:
    """The split the pair (a, b) belongs to: a fixed function of the unordered pair alone."""
    point = hash_fraction(f"{min(a, b)}+{max(a, b)}")
    return next(name for name, (low, high) in _BOUNDS.items() if low <= point < high)


def make_problems(count: int, split: str, seed: int = 0, low: int = 10, high: int = 99):
    """`count` distinct problems of `split` ("train", "validation" or "test"; 0 = all of it).

    The splits are disjoint and fixed (module docstring); the seed only chooses which pairs of
    the split are drawn, and in which order.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    pairs = [(a, b) for a in range(low, high + 1) for b in range(low, high + 1)]
    in_split = [p for p in pairs if split_of(*p) == split]
    count = count or len(in_split)
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


def prompt_examples(source: None, split: str, limit: int | None, seed: int) -> list[PromptExample]:
    """The problems of `split` as chat prompts, each with its sum as reference and answer."""
    return [
        PromptExample(
            p.id, [{"role": "user", "content": p.question}], None, str(p.answer), str(p.answer)
        )  # fmt: skip
        for p in make_problems(limit or 0, split, seed)
    ]


def sft_examples(source: None, split: str, limit: int | None, seed: int) -> list[SFTExample]:
    return [SFTExample(p, p.reference) for p in prompt_examples(source, split, limit, seed)]


def verify(answer: str, text: str) -> float:
    return score_answer(text, int(answer))


SPEC = TaskSpec(
    name="arithmetic",
    description="generated two-digit additions (offline), verifiable reward",
    splits={"train": "train", "validation": "validation", "test": "test"},
    prompts=prompt_examples,
    sft=sft_examples,
    verify=verify,
)
