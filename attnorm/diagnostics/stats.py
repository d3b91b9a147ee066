"""Statistics for the diagnostics: the two-sample Kolmogorov-Smirnov test, the critical top-N, log-log slopes."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["CriticalTopN", "KSResult", "critical_top_n", "ks_two_sample", "loglog_slope"]


@dataclass(frozen=True)
class KSResult:
    """Outcome of a two-sample Kolmogorov-Smirnov test.

    Attributes:
        statistic: ``D = sup_t |F_a(t) - F_b(t)|`` of the two empirical distribution functions.
        pvalue: two-sided exact p-value, ``P(D' >= D)`` under the null of equal distributions.
    """

    statistic: float
    pvalue: float


def _as_sample(name: str, values) -> np.ndarray:
    sample = np.asarray(values, dtype=np.float64).ravel()
    sample = sample[~np.isnan(sample)]
    if sample.size == 0:
        raise ValueError(f"{name} must hold at least one non-NaN value")
    return sample


def ks_two_sample(sample_a, sample_b) -> KSResult:
    """Two-sample Kolmogorov-Smirnov test with the exact two-sided p-value.

    ``scipy.stats.ks_2samp(a, b, method="exact")``: the p-value counts the lattice paths
    of the pooled ordering whose empirical distribution functions come at least the
    observed ``D`` apart (Hodges, 1958), ``p = #paths(max |i/n - j/m| >= D) / C(n + m, n)``.
    It is exact for samples without ties (continuous data); NaN values are dropped.

    Args:
        sample_a: 1-D array-like of n values.
        sample_b: 1-D array-like of m values.

    Returns:
        The statistic ``D`` and the p-value.

    Raises:
        ValueError: a sample has no non-NaN value.
    """
    from scipy.stats import ks_2samp

    result = ks_2samp(_as_sample("sample_a", sample_a), _as_sample("sample_b", sample_b), method="exact")
    return KSResult(float(result.statistic), float(result.pvalue))


@dataclass(frozen=True)
class CriticalTopN:
    """Where the top-N selection stops being distinguishable from a random one.

    Attributes:
        n: the smallest tested N whose KS p-value exceeds ``alpha`` (None if every N was distinguishable).
        tests: the KS result for every tested N, in the order of ``ns``.
        alpha: the significance level used.
    """

    n: int | None
    tests: tuple[KSResult, ...]
    alpha: float


def critical_top_n(
    ns: Sequence[int],
    true_distances: Sequence,
    random_distances: Sequence,
    alpha: float = 0.05,
) -> CriticalTopN:
    """The critical N: the first N at which true and random-set distances become indistinguishable.

    For each N, ``true_distances[k]`` and ``random_distances[k]`` hold one value per
    head (e.g. the head's mean :func:`~attnorm.diagnostics.selection_distance` and
    :func:`~attnorm.diagnostics.random_selection_distance`).  A two-sample KS test
    compares the two distributions across heads; the critical N is the smallest N
    whose p-value exceeds ``alpha`` (the null of equal distributions is not rejected).

    Args:
        ns: the tested set sizes, ascending.
        true_distances: per N, the per-head distances of the top-N set.
        random_distances: per N, the per-head distances of random N-sets.
        alpha: significance level in (0, 1).

    Returns:
        The critical N (or None) and every test.

    Raises:
        ValueError: lengths differ, ``ns`` not ascending, or ``alpha`` outside (0, 1).
    """
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    if not len(ns) == len(true_distances) == len(random_distances):
        raise ValueError(
            f"ns, true_distances and random_distances must have one entry per N, got lengths "
            f"{len(ns)}, {len(true_distances)}, {len(random_distances)}"
        )
    if list(ns) != sorted(ns):
        raise ValueError(f"ns must be ascending, got {list(ns)}")
    tests = tuple(ks_two_sample(true, rand) for true, rand in zip(true_distances, random_distances, strict=True))
    critical = next((n for n, test in zip(ns, tests, strict=True) if test.pvalue > alpha), None)
    return CriticalTopN(critical, tests, alpha)


def loglog_slope(x, y) -> tuple[float, float]:
    """Least-squares fit of ``log y = intercept + slope * log x`` over the positive, finite pairs.

    Args:
        x: 1-D array-like.
        y: 1-D array-like of the same length.

    Returns:
        ``(slope, intercept)``; both NaN when fewer than two usable pairs remain.
    """
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    if x.ndim != 1 or y.ndim != 1 or len(x) != len(y):
        raise ValueError(f"x and y must be 1-D of one length, got shapes {x.shape} and {y.shape}")
    usable = (x > 0) & (y > 0) & np.isfinite(x) & np.isfinite(y)
    if usable.sum() < 2:
        return math.nan, math.nan
    slope, intercept = np.polyfit(np.log(x[usable]), np.log(y[usable]), 1)
    return float(slope), float(intercept)
