"""Seed statistics for the experiments: mean ± standard error, paired differences.

One seed is an anecdote: every figure an experiment reports is a mean over seeds with its
standard error s / sqrt(n) (s the sample standard deviation, ddof = 1). Comparisons of two
settings run with the same seeds are paired: the seed fixes the prompts, the generation seeds
and the evaluation prompts, so the difference per seed cancels what they share.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def mean_stderr(values: Sequence[float]) -> tuple[float, float]:
    """(mean, standard error of the mean); the error is NaN for fewer than two values."""
    values = [float(v) for v in values]
    if not values:
        return math.nan, math.nan
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, math.nan
    variance = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return mean, math.sqrt(variance / len(values))


def paired_difference(a: dict[int, float], b: dict[int, float]) -> tuple[float, float, int]:
    """b − a over the seeds both have: (mean, standard error, number of seeds)."""
    seeds = sorted(set(a) & set(b))
    mean, stderr = mean_stderr([b[s] - a[s] for s in seeds])
    return mean, stderr, len(seeds)


def within(mean: float, stderr: float, multiple: float = 2.0) -> bool:
    """Whether |mean| ≤ multiple · stderr (a difference indistinguishable from zero)."""
    return math.isfinite(stderr) and abs(mean) <= multiple * stderr


def format_mean_stderr(mean: float, stderr: float, scale: float = 1.0, digits: int = 1) -> str:
    """ "m ± s" with both scaled (e.g. 100 for percentages); "m" alone without an error."""
    if not math.isfinite(mean):
        return "-"
    if not math.isfinite(stderr):
        return f"{mean * scale:.{digits}f}"
    return f"{mean * scale:.{digits}f} ± {stderr * scale:.{digits}f}"


def zero_if_nan(value: float) -> float:
    """An error bar's half-width: 0 where there is no error (one seed)."""
    return value if math.isfinite(value) else 0.0
