"""The measurements of Mudarisov et al., "Limitations of Normalization in Attention Mechanism"
(arXiv 2508.17821), as a library.

* :mod:`~attnorm.diagnostics.weights`: entropy, normalized entropy, support size,
  effective number of tokens, top-N mass of attention rows.
* :mod:`~attnorm.diagnostics.selection`: Theorem 1's selection distance (top-N set
  against a random set) and Theorem 2's separable fraction ``N_s / N``.
* :mod:`~attnorm.diagnostics.stats`: two-sample Kolmogorov-Smirnov test, the critical N.
* :mod:`~attnorm.diagnostics.sensitivity`: exact Jacobian norms and Algorithm 5's
  finite-difference sensitivity ``g(T, eps)``.

Run the experiments from the command line: ``python -m attnorm.diagnostics --help``.
The statistics (numpy, scipy) load on first use, so the package and ``--help`` import
without the ``diagnostics`` extra.
"""

import importlib

from attnorm.diagnostics.selection import (
    random_selection,
    random_selection_distance,
    selection_distance,
    separable_fraction,
    top_n_selection,
    weighted_distances,
)
from attnorm.diagnostics.sensitivity import finite_difference_sensitivity, jacobian, jacobian_norms
from attnorm.diagnostics.weights import (
    allowed_positions,
    effective_tokens,
    entropy,
    normalized_entropy,
    support_size,
    top_n_mass,
)

__all__ = [
    "CriticalTopN",
    "KSResult",
    "allowed_positions",
    "critical_top_n",
    "effective_tokens",
    "entropy",
    "finite_difference_sensitivity",
    "jacobian",
    "jacobian_norms",
    "ks_two_sample",
    "loglog_slope",
    "normalized_entropy",
    "random_selection",
    "random_selection_distance",
    "selection_distance",
    "separable_fraction",
    "support_size",
    "top_n_mass",
    "top_n_selection",
    "weighted_distances",
]

_STATS = ("CriticalTopN", "KSResult", "critical_top_n", "ks_two_sample", "loglog_slope")


def __getattr__(name: str):
    if name in _STATS:
        return getattr(importlib.import_module("attnorm.diagnostics.stats"), name)
    raise AttributeError(f"module 'attnorm.diagnostics' has no attribute {name!r}")
