"""Row operations of the ``F(x) / sum F(x)`` family and of sigmoid attention, in pure torch.

Mudarisov et al. (arXiv 2508.17821) state their lemmas for any normalisation
``a_i = F(x_i) / sum_j F(x_j)`` with ``F >= 0`` elementwise.  Two forms compute it:

* :func:`ratio_of_values` takes ``F`` itself (any user function: the gradient comes from
  autograd or from a supplied derivative).  Values are divided by the row's largest
  before summing, so the sum cannot overflow.
* :func:`ratio_of_logs` takes ``log F`` (the named maps: relu^p, softplus, Taylor,
  softmax with a sink): ``a = softmax(log F)``, so neither ``F`` nor its sum can
  overflow or underflow, whatever the scores.

Both follow :mod:`attnorm.kernels.rules`: masked and -inf positions get 0; a row whose
``F`` sums to 0 (no allowed position, or relu with every allowed score <= 0) gives zeros;
a row where ``F`` is +inf at an allowed position is uniform over those positions (the
limit of the finite case for an ``F`` growing without bound); NaN makes the row NaN.
Scores are used as given: ``F`` need not be shift-invariant.  Every function here is
differentiable, branch-free (no host synchronisation) and compiles with ``fullgraph=True``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor
from torch.autograd import Function

from attnorm.kernels.rules import RowMask, allowed

__all__ = [
    "log_relu_power",
    "log_softplus",
    "log_taylor_exp",
    "ratio_of_logs",
    "ratio_of_values",
    "sigmoid_attention",
]

Elementwise = Callable[[Tensor], Tensor]


class _WithDerivative(Function):
    """``f(x)`` whose backward is ``grad * derivative(x)`` (differentiable again when ``derivative`` is)."""

    @staticmethod
    def forward(x: Tensor, f: Elementwise, derivative: Elementwise) -> Tensor:
        return f(x)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        x, _, derivative = inputs
        ctx.save_for_backward(x)
        ctx.derivative = derivative

    @staticmethod
    def backward(ctx, grad: Tensor):
        (x,) = ctx.saved_tensors
        return grad * ctx.derivative(x), None, None


def _split_rows(x: Tensor, mask: RowMask) -> tuple[Tensor, Tensor, Tensor]:
    """(allowed positions, allowed +inf positions, rows holding one) of scores ``x``."""
    keep = allowed(x, mask)
    infinite = keep & (x == math.inf)
    return keep, infinite, infinite.any(-1, keepdim=True)


def ratio_of_values(x: Tensor, mask: RowMask, f: Elementwise, derivative: Elementwise | None = None) -> Tensor:
    """``a_i = F(x_i) / sum_j F(x_j)`` over the allowed positions of each row (last axis).

    ``F`` sees only finite allowed scores (others are replaced by 0, and their gradient is 0);
    rows holding a +inf score are uniform over those positions, as for every normalizer, and
    so are rows where ``F`` overflows to +inf at finite scores (:func:`ratio_of_logs` avoids
    the overflow altogether).

    Args:
        x: scores ``(..., L)``.
        mask: which positions each row may use.
        f: the elementwise ``F >= 0`` (a torch function of a tensor).
        derivative: ``F'`` as a torch function, or None to differentiate ``f`` with autograd.

    Returns:
        Weights like ``x``.
    """
    keep, infinite, infinite_row = _split_rows(x, mask)
    finite = keep & ~infinite_row
    safe = torch.where(finite, x, 0.0)
    values = f(safe) if derivative is None else _WithDerivative.apply(safe, f, derivative)
    values = torch.where(infinite_row, infinite.to(x.dtype), torch.where(finite, values, 0.0))
    # F overflowing at a finite score is the same limit as a +inf score: uniform over those positions.
    overflow = torch.isposinf(values.detach())
    values = torch.where(overflow.any(-1, keepdim=True), overflow.to(values.dtype), values)
    largest = values.detach().amax(-1, keepdim=True)
    # Dividing by the row's largest value cannot change the ratio; it keeps the sum finite.
    largest = torch.where(largest > 0, largest, 1.0)
    scaled = values / largest
    total = scaled.sum(-1, keepdim=True)
    return scaled / torch.where(total == 0, 1.0, total)


def ratio_of_logs(x: Tensor, mask: RowMask, log_f: Elementwise, sink: float | None = None) -> Tensor:
    """``a_i = F(x_i) / (sum_j F(x_j) [+ e^sink])`` from ``log F``, as a softmax of ``log F``.

    Args:
        x: scores ``(..., L)``.
        mask: which positions each row may use.
        log_f: ``log F`` elementwise, finite or ``-inf`` (where ``F = 0``) at finite scores.
        sink: the log of an extra term in the denominator (``0`` gives softmax_1's ``1 + sum``),
            or None.

    Returns:
        Weights like ``x``; they sum to 1 (to less than 1 with a sink) unless ``F`` sums to 0.
    """
    keep, infinite, infinite_row = _split_rows(x, mask)
    finite = keep & ~infinite_row
    logs = torch.where(finite, log_f(torch.where(finite, x, 0.0)), -math.inf)
    # A row holding +inf: uniform over those positions, the sink's share vanishing in the limit.
    logs = torch.where(infinite_row, torch.where(infinite, 0.0, -math.inf), logs)
    top = logs.detach().amax(-1, keepdim=True)
    if sink is not None:
        top = torch.where(infinite_row, top, top.clamp_min(sink))  # NaN stays NaN
    top = torch.where(top > -math.inf, top, 0.0)
    exps = torch.exp(logs - top)
    total = exps.sum(-1, keepdim=True)
    if sink is not None:
        total = total + torch.where(infinite_row, 0.0, torch.exp(sink - top))
    return exps / torch.where(total == 0, 1.0, total)


def _log_positive(x: Tensor) -> Tensor:
    """``log x`` for ``x > 0``, ``-inf`` for ``x <= 0``, NaN for NaN; a finite gradient everywhere."""
    positive = x > 0
    return torch.where(positive, torch.log(torch.where(positive, x, 1.0)), torch.where(x <= 0, -math.inf, x))


def log_relu_power(power: float) -> Elementwise:
    """``log(max(x, 0)^p) = p log x`` for ``x > 0``, ``-inf`` elsewhere."""

    def log_f(x: Tensor) -> Tensor:
        return power * _log_positive(x)

    return log_f


def log_softplus(x: Tensor) -> Tensor:
    """``log(log(1 + e^x))`` without underflow: equal to ``x`` to rounding once ``e^x < 1e-17``."""
    small = x < -40.0
    return torch.where(small, x, torch.log(torch.nn.functional.softplus(torch.where(small, 0.0, x))))


def log_taylor_exp(order: int) -> Elementwise:
    """``log T_n(x)``, ``T_n(x) = sum_{m <= n} x^m / m!`` for even ``n`` (positive everywhere).

    For ``|x| > 1`` it is ``n log|x| + log(sum_m x^{m - n} / m!)``: the polynomial in ``1/x``
    has no overflow, so float32 scores near 3e38 stay finite.
    """
    inverse_factorials = [1 / math.factorial(m) for m in range(order + 1)]  # 1/0!, 1/1!, ..., 1/n!

    def horner(y: Tensor, highest_first: list[float]) -> Tensor:
        out = torch.full_like(y, highest_first[0])
        for coefficient in highest_first[1:]:
            out = out * y + coefficient
        return out

    def log_f(x: Tensor) -> Tensor:
        if order == 0:
            return x * 0.0  # 0 that stays on x's graph: an order-0 row's weights get a zero gradient, not none
        large = x.abs() > 1
        near = torch.where(large, 0.0, x)
        far = torch.where(large, x, 2.0)
        # T_n(x) = x^n sum_k y^k / (n - k)!, y = 1/x: y^n's coefficient is 1/0!, the constant 1/n!.
        log_far = order * torch.log(far.abs()) + torch.log(horner(1 / far, inverse_factorials))
        return torch.where(large, log_far, torch.log(horner(near, inverse_factorials[::-1])))

    return log_f


def sigmoid_attention(x: Tensor, mask: RowMask, bias: float | None = None) -> Tensor:
    """Sigmoid attention (Ramapuram et al., 2024, arXiv 2409.04431): ``a_i = sigmoid(x_i + b)``.

    ``b = -log n`` with ``n`` the allowed positions of the row (the paper's choice, which keeps
    the row's total weight of order 1 at initialisation) when ``bias`` is None.  Weights are
    not normalised; masked and -inf positions get 0, and a +inf score gets weight 1.

    Args:
        x: scores ``(..., L)``.
        mask: which positions each row may use.
        bias: a fixed ``b``, or None for ``-log n``.

    Returns:
        Weights like ``x``, each in [0, 1].
    """
    keep = allowed(x, mask)
    if bias is None:
        count = keep.sum(-1, keepdim=True).clamp_min(1).to(x.dtype)
        shift = -torch.log(count)
    else:
        shift = bias
    return torch.where(keep, torch.sigmoid(torch.where(keep, x, 0.0) + shift), 0.0)
