"""Held-out splits by a hash of each example's key: train, validation and test.

Every task has three splits (hyper-parameters are chosen on one and reported on another):

- train: what the learner trains on;
- validation: evaluations during a run and the choice of hyper-parameters;
- test: the final reported figure only.

Where a dataset ships a split the task uses it (TL;DR's validation and test, the test split of
GSM8k and No Robots). Where it does not, the split is carved out of another one by a hash of the
example's key (`hash_fraction`): a key's place depends on nothing else (not on the seed, the
count asked for, or the order of the rows), and, the hash being a real one (SHA-256), every
property of the examples falls into each part in proportion.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import TypeVar

SPLITS = ("train", "validation", "test")

T = TypeVar("T")


def hash_fraction(key: str) -> float:
    """A uniform number in [0, 1) fixed by `key` (the first 64 bits of its SHA-256)."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2.0**64


def carve(items: Sequence[T], key: Callable[[T], str], fraction: float, held_out: bool) -> list[T]:
    """The items whose key hashes below `fraction` (`held_out`), or the others (not held out)."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"a held-out fraction must lie in (0, 1), got {fraction}")
    return [item for item in items if (hash_fraction(key(item)) < fraction) == held_out]
