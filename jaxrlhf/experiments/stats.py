"""Seed statistics for the experiments: mean ± standard error, paired differences, 95% t
intervals, Holm's correction, and the seeds an interval of a given width needs.

One seed is an anecdote: every figure an experiment reports is a mean over seeds with its
standard error s / sqrt(n) (s the sample standard deviation, ddof = 1). Comparisons of two
settings run with the same seeds are paired: the seed fixes the prompts, the generation seeds
and the evaluation prompts, so the difference per seed cancels what they share.

A paired comparison of n seeds gives the 95% t interval mean ± t(0.975, n − 1) · s.e. and the
two-sided p of H0 "no difference" (Student's t, n − 1 degrees of freedom). A section that makes
k comparisons calls a difference beyond noise only if Holm's step-down procedure rejects it at
family-wise level 0.05: the p-values in increasing order p(1) ≤ ... ≤ p(k), each compared with
0.05 / (k − i + 1), stopping at the first that fails (`holm`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from scipy import stats as _scipy_stats


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


def t_quantile(probability: float, degrees: int) -> float:
    """The `probability` quantile of Student's t with `degrees` degrees of freedom."""
    return float(_scipy_stats.t.ppf(probability, degrees))


@dataclasses.dataclass(frozen=True)
class Comparison:
    """A paired difference b − a over seeds: mean, standard error, its 95% t interval, the
    two-sided p of no difference, and the number of seeds (module docstring)."""

    mean: float
    stderr: float
    low: float
    high: float
    p: float
    seeds: int

    @property
    def excludes_zero(self) -> bool:
        return self.low > 0 or self.high < 0


def compare(differences: Sequence[float], level: float = 0.95) -> Comparison:
    """The `Comparison` of per-seed paired differences (NaN interval and p below 2 seeds; a
    zero spread gives a point interval and p 0 or 1)."""
    mean, stderr = mean_stderr(differences)
    n = len(differences)
    if n < 2:
        return Comparison(mean, math.nan, math.nan, math.nan, math.nan, n)
    half = t_quantile(0.5 + level / 2, n - 1) * stderr
    if stderr == 0:
        p = 1.0 if mean == 0 else 0.0
    else:
        p = float(2 * _scipy_stats.t.sf(abs(mean) / stderr, n - 1))
    return Comparison(mean, stderr, mean - half, mean + half, p, n)


def compare_paired(a: dict[int, float], b: dict[int, float], level: float = 0.95) -> Comparison:
    """`compare` of b − a over the seeds both have."""
    seeds = sorted(set(a) & set(b))
    return compare([b[s] - a[s] for s in seeds], level)


def holm(p_values: Sequence[float], alpha: float = 0.05) -> list[bool]:
    """Which of k hypotheses Holm's step-down procedure rejects at family-wise level `alpha`
    (module docstring); a NaN p is never rejected and stops nothing after it."""
    order = sorted(range(len(p_values)), key=lambda i: (math.isnan(p_values[i]), p_values[i]))
    rejected = [False] * len(p_values)
    k = len(p_values)
    for rank, index in enumerate(order):
        p = p_values[index]
        if math.isnan(p) or p > alpha / (k - rank):
            break
        rejected[index] = True
    return rejected


def seeds_for_half_width(spread: float, half_width: float, level: float = 0.95,
                         at_least: int = 2, at_most: int = 10_000) -> int:  # fmt: skip
    """The fewest seeds n whose `level` t interval of a mean, with seed-to-seed standard
    deviation `spread`, has half-width t(·, n − 1) · spread / sqrt(n) ≤ `half_width`."""
    for n in range(max(2, at_least), at_most + 1):
        if t_quantile(0.5 + level / 2, n - 1) * spread / math.sqrt(n) <= half_width:
            return n
    raise ValueError(f"more than {at_most} seeds for half-width {half_width} at spread {spread}")
