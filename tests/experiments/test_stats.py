"""The experiments' statistics against values computed by hand (Student's t from tables)."""

from __future__ import annotations

import math

import pytest

from jaxrlhf.experiments.stats import compare, compare_paired, holm, seeds_for_half_width


def test_a_paired_comparison_gives_the_95_percent_t_interval_and_p():
    # Differences 1, 2, 3: mean 2, s = 1, s.e. = 1/sqrt(3); t(0.975, 2) = 4.303 (tables), so
    # the interval is 2 ± 2.484; t = 2 / 0.5774 = 3.464 on 2 d.f.: two-sided p = 0.0742.
    c = compare([1.0, 2.0, 3.0])
    assert (c.mean, c.seeds) == (2.0, 3)
    assert c.stderr == pytest.approx(1 / math.sqrt(3))
    assert (c.low, c.high) == pytest.approx((2 - 2.4841, 2 + 2.4841), abs=1e-4)
    assert c.p == pytest.approx(0.0742, abs=1e-4)
    assert not c.excludes_zero
    # 20 seeds of differences 1 and 3 alternating: mean 2, s = 1.026, s.e. = 0.2294;
    # t(0.975, 19) = 2.093: 2 ± 0.480, excluding 0.
    wide = compare([1.0, 3.0] * 10)
    assert (wide.low, wide.high) == pytest.approx((2 - 0.4802, 2 + 0.4802), abs=1e-3)
    assert wide.excludes_zero and wide.p < 1e-6


def test_paired_by_seed_only_over_the_seeds_both_arms_have():
    c = compare_paired({0: 0.5, 1: 0.6, 2: 0.7}, {1: 0.65, 2: 0.75, 3: 0.1})
    assert c.seeds == 2 and c.mean == pytest.approx(0.05) and c.stderr == pytest.approx(0.0)
    assert compare([0.3]).seeds == 1 and math.isnan(compare([0.3]).low)


def test_holm_steps_down_and_stops_at_the_first_it_keeps():
    # Sorted: 0.005 <= 0.05/4, 0.010 <= 0.05/3, 0.030 > 0.05/2: stop; 0.040 is kept too
    # although 0.040 <= 0.05 alone.
    assert holm([0.01, 0.04, 0.03, 0.005]) == [True, False, False, True]
    assert holm([0.04]) == [True] and holm([0.06]) == [False]
    assert holm([0.001, math.nan]) == [True, False]


@pytest.mark.parametrize(("spread", "half", "seeds"), [(10, 2, 99), (5, 2, 27), (3, 2, 12)])
def test_seeds_for_a_half_width(spread, half, seeds):
    # n is the first with t(0.975, n - 1) * spread / sqrt(n) <= half: e.g. 27 seeds at
    # spread 5: 2.056 * 5 / 5.196 = 1.978 <= 2, while 26 give 2.060 * 5 / 5.099 = 2.020.
    assert seeds_for_half_width(spread, half) == seeds
