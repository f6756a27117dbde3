"""Response budgets per prompt: a length law gives each prompt of the schedule its own
`max_tokens` (`rollout.length_law`), for long-tailed workloads on the generator."""

from __future__ import annotations

import math

import numpy as np


def parse_length_law(law: str, max_tokens: int):
    """None for "" (every prompt gets max_tokens), else (seed, position) -> a budget:
    "pareto:A:M" = min(max_tokens, ⌈M · U^(−1/A)⌉), U uniform on (0, 1] from (seed, position):
    a Pareto law of shape A and minimum M (heavy-tailed: A ≤ 2 has infinite variance)."""
    if not law:
        return None
    name, *params = law.split(":")
    try:
        shape, minimum = (float(params[0]), int(params[1])) if name == "pareto" else (0, 0)
    except (IndexError, ValueError):
        shape = minimum = 0
    if name != "pareto" or len(params) != 2 or shape <= 0 or not 1 <= minimum <= max_tokens:
        raise ValueError(f"length law {law!r}: expected pareto:SHAPE:MIN with SHAPE > 0 and "
                         f"1 <= MIN <= max_response_tokens ({max_tokens})")  # fmt: skip

    def budget(seed: int, position: int) -> int:
        uniform = 1.0 - np.random.default_rng([seed, position, 7]).random()  # in (0, 1]
        return int(min(max_tokens, math.ceil(minimum * uniform ** (-1.0 / shape))))

    return budget
