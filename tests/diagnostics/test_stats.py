"""Kolmogorov-Smirnov test against scipy, the critical N on constructed samples, log-log slopes."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.stats

from attnorm.diagnostics import critical_top_n, ks_two_sample, loglog_slope


def test_hand_case_fully_separated_samples():
    # Every value of a below every value of b: D = 1, and only 2 of the C(6, 3) = 20 orderings reach it.
    result = ks_two_sample([1.0, 2.0, 3.0], [4.0, 5.0, 6.0])
    assert result.statistic == 1.0
    assert result.pvalue == pytest.approx(2 / 20)


def test_identical_samples():
    result = ks_two_sample([1.0, 2.0, 3.0], [1.0, 2.0, 3.0])
    assert (result.statistic, result.pvalue) == (0.0, 1.0)


@pytest.mark.parametrize(
    ("n", "m", "shift"), [(5, 7, 0.5), (40, 40, 0.4), (72, 72, 0.3), (144, 100, 0.2), (300, 250, 0.1), (72, 72, 3.0)]
)
def test_against_scipy_exact(n, m, shift):
    rng = np.random.default_rng(n + m)
    a, b = rng.normal(size=n), rng.normal(shift, size=m)
    expected = scipy.stats.ks_2samp(a, b, method="exact")
    result = ks_two_sample(a, b)
    assert result.statistic == pytest.approx(expected.statistic, abs=1e-12)
    # Relative agreement down to tiny p-values (the shift-3 case has p ~ 1e-28).
    assert result.pvalue == pytest.approx(expected.pvalue, rel=1e-6)


def test_nan_values_are_dropped():
    assert ks_two_sample([1.0, math.nan, 2.0], [3.0, 4.0]) == ks_two_sample([1.0, 2.0], [3.0, 4.0])
    with pytest.raises(ValueError, match="sample_a"):
        ks_two_sample([math.nan], [1.0])


def test_critical_top_n_on_constructed_samples():
    rng = np.random.default_rng(0)
    random_heads = [rng.normal(size=72) for _ in range(4)]
    true_heads = [random_heads[0] + 3.0, random_heads[1] + 2.0, rng.normal(size=72), rng.normal(size=72)]
    result = critical_top_n([1, 2, 4, 8], true_heads, random_heads, alpha=0.05)
    pvalues = [scipy.stats.ks_2samp(t, r, method="exact").pvalue for t, r in zip(true_heads, random_heads, strict=True)]
    expected = next(n for n, p in zip([1, 2, 4, 8], pvalues, strict=True) if p > 0.05)
    assert result.n == expected == 4
    assert [test.pvalue for test in result.tests] == pytest.approx(pvalues, rel=1e-6)


def test_critical_top_n_none_and_errors():
    assert critical_top_n([1], [[0.0, 1.0, 2.0]], [[10.0, 11.0, 12.0]], alpha=0.2).n is None
    with pytest.raises(ValueError, match="ascending"):
        critical_top_n([2, 1], [[0.0], [0.0]], [[0.0], [0.0]])
    with pytest.raises(ValueError, match="alpha"):
        critical_top_n([1], [[0.0]], [[0.0]], alpha=1.5)
    with pytest.raises(ValueError, match="one entry per N"):
        critical_top_n([1, 2], [[0.0]], [[0.0]])


def test_loglog_slope():
    x = np.array([1e-3, 1e-2, 1e-1, 1.0])
    slope, intercept = loglog_slope(x, 3.0 / x)
    assert slope == pytest.approx(-1.0)
    assert math.exp(intercept) == pytest.approx(3.0)
    assert all(math.isnan(value) for value in loglog_slope([1.0, -1.0], [1.0, 1.0]))
