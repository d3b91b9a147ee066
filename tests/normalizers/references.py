"""Independent float64 references for every normalizer, written from the formulas.

Each reference normalises the LAST axis of an unmasked float64 tensor.  None of
them calls attnorm: softmax-type maps use ``torch.softmax``, sparse maps use the
``entmax`` package, top-k sorts explicitly.  :data:`CASES` pairs each normalizer
configuration under test with its reference, for the shared-rule tests.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction

import entmax
import torch
from torch import Tensor

import attnorm
from attnorm import functional as F

Reference = Callable[[Tensor], Tensor]


def softmax_reference(x: Tensor, temperature: float = 1.0) -> Tensor:
    """``exp(x / T) / sum exp(x / T)`` in float64."""
    return torch.softmax(x.double() / temperature, dim=-1)


def scalable_softmax_reference(x: Tensor, s: float = 0.43, bias: float = 0.0) -> Tensor:
    """``softmax((s log n + bias) x)`` with n the row length, in float64."""
    multiplier = s * math.log(x.shape[-1]) + bias
    return torch.softmax(multiplier * x.double(), dim=-1)


def self_adjusted_reference(x: Tensor, normalized: bool = True) -> Tensor:
    """``x * softmax(x)``, or ``(x - min(x_min, 0)) / (max(x_max, 0) - min(x_min, 0)) * softmax(x)``."""
    x = x.double()
    weights = torch.softmax(x, dim=-1)
    if not normalized:
        return x * weights
    low = x.amin(-1, keepdim=True).clamp_max(0)
    high = x.amax(-1, keepdim=True).clamp_min(0)
    span = high - low
    factor = torch.where(span > 0, (x - low) / torch.where(span > 0, span, 1.0), 0.0)
    return factor * weights


def sparsemax_reference(x: Tensor) -> Tensor:
    """Sparsemax from the ``entmax`` package, in float64."""
    return entmax.sparsemax(x.double(), dim=-1)


def entmax_reference(x: Tensor, alpha: float) -> Tensor:
    """alpha-entmax from the ``entmax`` package (exact for 1.5 and 2, bisection otherwise), in float64."""
    x = x.double()
    if alpha == 1:
        return torch.softmax(x, dim=-1)
    if alpha == 1.5:
        return entmax.entmax15(x, dim=-1)
    if alpha == 2:
        return entmax.sparsemax(x, dim=-1)
    return entmax.entmax_bisect(x, alpha, dim=-1, n_iter=100)


def topk_count(k: float, n: int) -> int:
    """Positions top-k keeps among n: ``min(k, n)``, or ``max(1, ceil(k n))`` for a fraction (exact rational math)."""
    if isinstance(k, int):
        return min(k, n)
    return min(n, max(1, math.ceil(Fraction(str(k)) * n)))


def topk_softmax_reference(x: Tensor, k: float, temperature: float = 1.0) -> Tensor:
    """Softmax over the ``k`` largest entries of each row (distinct values assumed), zeros elsewhere."""
    x = x.double()
    kept = topk_count(k, x.shape[-1])
    kth_largest = x.sort(dim=-1, descending=True).values[..., kept - 1 : kept]
    return torch.softmax((x / temperature).masked_fill(x < kth_largest, -math.inf), dim=-1)


def ratio_reference(values: Tensor) -> Tensor:
    """``F / sum F`` over the last axis from the values of ``F`` (rows summing to 0 give zeros)."""
    total = values.sum(-1, keepdim=True)
    return torch.where(total > 0, values / torch.where(total > 0, total, 1.0), 0.0)


def relu_reference(x: Tensor, power: float = 1.0) -> Tensor:
    """``max(x, 0)^p / sum max(x, 0)^p`` in float64."""
    return ratio_reference(x.double().clamp_min(0) ** power)


def softplus_reference(x: Tensor) -> Tensor:
    """``log(1 + e^x) / sum log(1 + e^x)`` in float64."""
    return ratio_reference(torch.log1p(torch.exp(x.double())))


def softmax1_reference(x: Tensor) -> Tensor:
    """``e^x / (1 + sum e^x)`` in float64 (moderate scores only: no shift)."""
    exps = torch.exp(x.double())
    return exps / (1 + exps.sum(-1, keepdim=True))


def sigmoid_reference(x: Tensor, bias: float | None = None) -> Tensor:
    """``1 / (1 + e^{-(x - log n)})``, n the row length, in float64."""
    shift = -math.log(x.shape[-1]) if bias is None else bias
    return 1 / (1 + torch.exp(-(x.double() + shift)))


def taylor_reference(x: Tensor, order: int = 2) -> Tensor:
    """``T_n(x) / sum T_n(x)``, ``T_n(x) = sum_{m <= n} x^m / m!``, scores used as given, in float64."""
    x = x.double()
    return ratio_reference(sum(x**m / math.factorial(m) for m in range(order + 1)))


def square_plus_one(x: Tensor) -> Tensor:
    """A user's ``F(x) = x^2 + 1`` for :class:`attnorm.Normalized`."""
    return x * x + 1


def hypot_one(x: Tensor) -> Tensor:
    """A user's ``F(x) = sqrt(x^2 + 1)`` (no overflow at any finite float32 score), for the shared-rule cases."""
    return torch.hypot(x, torch.ones((), dtype=x.dtype, device=x.device))


@dataclass(frozen=True)
class Case:
    """A normalizer configuration, how to build it, its functional form and its reference.

    Attributes:
        name: test id.
        build: ``build(dim=..., backend=...)`` returns the module.
        functional: ``functional(x, dim=..., mask=...)`` calls the functional API.
        reference: float64 reference on unmasked rows (last axis).
        nonnegative: weights are >= 0.
        sparse: outputs exact zeros on finite rows (its support can change under a small perturbation).
        shift_invariant: adding a constant to a row leaves the weights unchanged.
    """

    name: str
    build: Callable[..., attnorm.Normalizer]
    functional: Callable[..., Tensor]
    reference: Reference
    nonnegative: bool = True
    sparse: bool = False
    shift_invariant: bool = True

    def __repr__(self) -> str:
        return self.name


CASES = [
    Case(
        "softmax_T0.7",
        lambda **kw: attnorm.Softmax(temperature=0.7, **kw),
        lambda x, **kw: F.softmax(x, temperature=0.7, **kw),
        lambda x: softmax_reference(x, 0.7),
    ),
    Case(
        "ssmax_s0.6_b0.1",
        lambda **kw: attnorm.ScalableSoftmax(s=0.6, bias=0.1, **kw),
        lambda x, **kw: F.scalable_softmax(x, s=0.6, bias=0.1, **kw),
        lambda x: scalable_softmax_reference(x, 0.6, 0.1),
    ),
    Case(
        "sa_softmax",
        lambda **kw: attnorm.SelfAdjustedSoftmax(**kw),
        lambda x, **kw: F.self_adjusted_softmax(x, **kw),
        self_adjusted_reference,
        shift_invariant=False,
    ),
    Case(
        "sa_softmax_plain",
        lambda **kw: attnorm.SelfAdjustedSoftmax(normalized=False, **kw),
        lambda x, **kw: F.self_adjusted_softmax(x, normalized=False, **kw),
        lambda x: self_adjusted_reference(x, normalized=False),
        nonnegative=False,
        shift_invariant=False,
    ),
    Case(
        "sparsemax",
        lambda **kw: attnorm.Sparsemax(**kw),
        lambda x, **kw: F.sparsemax(x, **kw),
        sparsemax_reference,
        sparse=True,
    ),
    Case(
        "entmax1.5",
        lambda **kw: attnorm.Entmax(alpha=1.5, **kw),
        lambda x, **kw: F.entmax(x, alpha=1.5, **kw),
        lambda x: entmax_reference(x, 1.5),
        sparse=True,
    ),
    Case(
        "entmax1.3",
        lambda **kw: attnorm.Entmax(alpha=1.3, **kw),
        lambda x, **kw: F.entmax(x, alpha=1.3, **kw),
        lambda x: entmax_reference(x, 1.3),
        sparse=True,
    ),
    Case(
        "topk3",
        lambda **kw: attnorm.TopKSoftmax(k=3, **kw),
        lambda x, **kw: F.topk_softmax(x, 3, **kw),
        lambda x: topk_softmax_reference(x, 3),
        sparse=True,
    ),
    Case(
        "topk0.4_T2",
        lambda **kw: attnorm.TopKSoftmax(k=0.4, temperature=2.0, **kw),
        lambda x, **kw: F.topk_softmax(x, 0.4, temperature=2.0, **kw),
        lambda x: topk_softmax_reference(x, 0.4, 2.0),
        sparse=True,
    ),
    Case(
        "relu",
        lambda **kw: attnorm.make("relu", **kw),
        lambda x, **kw: F.relu_normalized(x, **kw),
        relu_reference,
        sparse=True,
        shift_invariant=False,
    ),
    Case(
        "relu2",
        lambda **kw: attnorm.make("relu2", **kw),
        lambda x, **kw: F.relu_normalized(x, power=2.0, **kw),
        lambda x: relu_reference(x, 2.0),
        sparse=True,
        shift_invariant=False,
    ),
    Case(
        "softplus",
        lambda **kw: attnorm.make("softplus", **kw),
        lambda x, **kw: F.softplus_normalized(x, **kw),
        softplus_reference,
        shift_invariant=False,
    ),
    Case(
        "softmax1",
        lambda **kw: attnorm.make("softmax1", **kw),
        lambda x, **kw: F.softmax1(x, **kw),
        softmax1_reference,
        shift_invariant=False,
    ),
    Case(
        "taylor2",
        lambda **kw: attnorm.make("taylor", **kw),
        lambda x, **kw: F.taylor_softmax(x, **kw),
        taylor_reference,
        shift_invariant=False,
    ),
    Case(
        "taylor4",
        lambda **kw: attnorm.make("taylor:n=4", **kw),
        lambda x, **kw: F.taylor_softmax(x, 4, **kw),
        lambda x: taylor_reference(x, 4),
        shift_invariant=False,
    ),
    Case(
        "normalized_hypot",
        lambda **kw: attnorm.Normalized(hypot_one, **kw),
        lambda x, **kw: F.normalized(x, hypot_one, **kw),
        lambda x: ratio_reference(torch.hypot(x.double(), torch.ones((), dtype=torch.float64))),
        shift_invariant=False,
    ),
]


def reference_masked(case: Case, x: Tensor, allowed: Tensor) -> Tensor:
    """The reference applied to the allowed positions of each row alone (last axis), zeros elsewhere."""
    rows = x.double().reshape(-1, x.shape[-1])
    keep = allowed.expand(x.shape).reshape(-1, x.shape[-1])
    out = torch.zeros_like(rows)
    for row, (values, row_allowed) in enumerate(zip(rows, keep, strict=True)):
        if row_allowed.any():
            out[row, row_allowed] = case.reference(values[row_allowed])
    return out.reshape(x.shape)
