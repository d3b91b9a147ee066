"""Sparsemax and alpha-entmax on masked rows, with closed-form backward passes.

All functions take finite scores ``x`` (masked positions hold any finite value)
and a bool ``allowed`` mask of the same shape, normalise over the last axis and
return exact zeros outside ``allowed`` (all-zero rows where nothing is allowed).
Backward passes save only the output (and alpha), as in the ``entmax`` package.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.autograd import Function

__all__ = [
    "entmax15_rows",
    "entmax_alpha_vjp",
    "entmax_bisect_rows",
    "entmax_slopes",
    "entmax_vjp",
    "save_output",
    "saved_output",
    "sparsemax_rows",
    "sum_to_shape",
]


def sum_to_shape(grad: Tensor, shape: torch.Size) -> Tensor:
    """Reduce a broadcast gradient back to ``shape``."""
    while grad.ndim > len(shape):
        grad = grad.sum(0)
    for axis, size in enumerate(shape):
        if size == 1 and grad.shape[axis] != 1:
            grad = grad.sum(axis, keepdim=True)
    return grad


def save_output(ctx, out: Tensor, bad: Tensor, parameter: float | Tensor) -> tuple[Tensor, Tensor]:
    """Save a row kernel's output and parameter for backward; returns ``(out, bad)``.

    A tensor parameter goes through autograd's saved tensors, a number onto ``ctx``;
    the ``bad`` row flags are marked non-differentiable.
    """
    ctx.save_for_backward(out, parameter if isinstance(parameter, Tensor) else None)
    ctx.parameter = parameter
    ctx.mark_non_differentiable(bad)
    return out, bad


def saved_output(ctx) -> tuple[Tensor, float | Tensor]:
    """``(out, parameter)`` as :func:`save_output` saved them."""
    out, parameter = ctx.saved_tensors
    return out, ctx.parameter if parameter is None else parameter


def entmax_slopes(out: Tensor, alpha: float | Tensor) -> Tensor:
    """``out^(2 - alpha)`` on the support, 0 elsewhere: the diagonal of entmax's Jacobian.

    ``pow`` stays off the zeros, where its derivative is infinite for ``alpha > 1``
    (a double backward would meet ``0 * inf``).
    """
    support = out > 0
    return torch.where(support, out.clamp_min(torch.finfo(out.dtype).tiny).pow(2 - alpha), 0.0)


def _subtract_row_max(x: Tensor, allowed: Tensor) -> Tensor:
    """``x`` minus its largest allowed score per row (0 for rows with none).

    The maps are shift-invariant; working next to 0 keeps cumulative sums (and
    entmax-1.5's variance) from cancelling catastrophically on large scores.
    """
    top = x.masked_fill(~allowed, -math.inf).amax(-1, keepdim=True)
    return x - top.masked_fill(~allowed.any(-1, keepdim=True), 0.0)


def _sorted_allowed(z: Tensor, allowed: Tensor) -> tuple[Tensor, Tensor]:
    """Allowed scores sorted in decreasing order (zeros after them) and the validity mask."""
    count = allowed.sum(-1, keepdim=True)
    ordered = z.masked_fill(~allowed, -math.inf).sort(dim=-1, descending=True).values
    valid = torch.arange(z.shape[-1], device=z.device) < count
    return ordered.masked_fill(~valid, 0.0), valid


def _support_threshold(cumulative: Tensor, support: Tensor) -> tuple[Tensor, Tensor]:
    size = support.sum(-1, keepdim=True).clamp_min(1)
    return cumulative.gather(-1, size - 1), size


def entmax_vjp(grad: Tensor, gppr: Tensor) -> Tensor:
    """J^T grad for entmax-type maps whose Jacobian is diag(g) - g g^T / sum(g)."""
    weighted = grad * gppr
    total = gppr.sum(-1, keepdim=True)
    correction = weighted.sum(-1, keepdim=True) / torch.where(total > 0, total, 1.0)
    return weighted - correction * gppr


class _Sparsemax(Function):
    @staticmethod
    def forward(ctx, x: Tensor, allowed: Tensor) -> Tensor:
        x = _subtract_row_max(x, allowed)
        ordered, valid = _sorted_allowed(x, allowed)
        cumulative = ordered.cumsum(-1) - 1
        rank = torch.arange(1, x.shape[-1] + 1, device=x.device, dtype=x.dtype)
        support = (rank * ordered > cumulative) & valid
        threshold, size = _support_threshold(cumulative, support)
        out = (x - threshold / size).clamp_min(0).masked_fill(~allowed, 0.0)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        (out,) = ctx.saved_tensors
        return entmax_vjp(grad, (out > 0).to(grad.dtype)), None


class _Entmax15(Function):
    @staticmethod
    def forward(ctx, x: Tensor, allowed: Tensor) -> Tensor:
        z = _subtract_row_max(x, allowed) / 2
        ordered, valid = _sorted_allowed(z, allowed)
        rank = torch.arange(1, x.shape[-1] + 1, device=x.device, dtype=x.dtype)
        mean = ordered.cumsum(-1) / rank
        mean_sq = (ordered**2).cumsum(-1) / rank
        spread = rank * (mean_sq - mean**2)
        delta = ((1 - spread) / rank).clamp_min(0)
        tau = mean - torch.sqrt(delta)
        support = (tau <= ordered) & valid
        threshold, _ = _support_threshold(tau, support)
        out = (z - threshold).clamp_min(0).pow(2).masked_fill(~allowed, 0.0)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        (out,) = ctx.saved_tensors
        # sqrt has an infinite derivative at 0: keep it off the zeros so double backward has no 0 * inf.
        gppr = torch.where(out > 0, out.clamp_min(torch.finfo(out.dtype).tiny).sqrt(), 0.0)
        return entmax_vjp(grad, gppr), None


def bisect_iterations(dtype: torch.dtype) -> int:
    """Halvings of the initial bracket (width <= 1) to reach the dtype's resolution."""
    return 60 if dtype == torch.float64 else 32


class _EntmaxBisect(Function):
    @staticmethod
    def forward(ctx, x: Tensor, allowed: Tensor, alpha: Tensor) -> Tensor:
        exponent = 1 / (alpha - 1)
        z = (_subtract_row_max(x, allowed) * (alpha - 1)).masked_fill(~allowed, -math.inf)
        count = allowed.sum(-1, keepdim=True).clamp_min(1).to(x.dtype)
        top = z.amax(-1, keepdim=True).masked_fill(~allowed.any(-1, keepdim=True), 0.0)
        low = top - 1
        width = (top - count.pow(1 - alpha)) - low

        def mass(tau: Tensor) -> Tensor:
            return (z - tau).clamp_min(0).pow(exponent)

        for _ in range(bisect_iterations(x.dtype)):
            width = width / 2
            middle = low + width
            low = torch.where(mass(middle).sum(-1, keepdim=True) >= 1, middle, low)
        out = mass(low)
        out = out / out.sum(-1, keepdim=True).clamp_min(torch.finfo(x.dtype).tiny)
        out = out.masked_fill(~allowed, 0.0)
        ctx.save_for_backward(out, alpha)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        out, alpha = ctx.saved_tensors
        gppr = entmax_slopes(out, alpha)
        grad_x = entmax_vjp(grad, gppr)
        grad_alpha = entmax_alpha_vjp(grad, out, alpha, gppr) if ctx.needs_input_grad[2] else None
        return grad_x, None, grad_alpha


def entmax_alpha_vjp(grad: Tensor, out: Tensor, alpha: Tensor, gppr: Tensor) -> Tensor:
    """``sum_i grad_i d out_i / d alpha`` per row, summed to ``alpha``'s shape.

    ``d out_i / d alpha = beta (S_i - gppr_i sum(S) / sum(gppr))`` with
    ``S_i = out_i (beta - log out_i)``, ``beta = 1 / (alpha - 1)`` and ``gppr = out^(2 - alpha)``
    on the support; derived from ``out_i^(alpha-1) = (alpha-1) x_i - tau(alpha)`` with
    ``sum(out) = 1``.  Differentiable (torch ops only).
    """
    support = out > 0
    beta = 1 / (alpha - 1)
    log_out = torch.where(support, out.clamp_min(torch.finfo(out.dtype).tiny).log(), 0.0)
    entropy_term = torch.where(support, out * (beta - log_out), 0.0)
    total = gppr.sum(-1, keepdim=True)
    ratio = entropy_term.sum(-1, keepdim=True) / torch.where(total > 0, total, 1.0)
    d_out = beta * (entropy_term - gppr * ratio)
    return sum_to_shape((grad * d_out).sum(-1, keepdim=True), alpha.shape)


def sparsemax_rows(x: Tensor, allowed: Tensor) -> Tensor:
    """Sparsemax (Martins & Astudillo, 2016): ``argmin_{p in simplex} ||p - x||^2``."""
    return _Sparsemax.apply(x, allowed)


def entmax15_rows(x: Tensor, allowed: Tensor) -> Tensor:
    """Exact 1.5-entmax (Peters et al., 2019) by sorting."""
    return _Entmax15.apply(x, allowed)


def entmax_bisect_rows(x: Tensor, allowed: Tensor, alpha: float | Tensor) -> Tensor:
    """alpha-entmax for alpha > 1 by bisection on the threshold, then renormalised."""
    alpha = torch.as_tensor(alpha, dtype=x.dtype, device=x.device)
    if alpha.ndim == 0:
        alpha = alpha.reshape((1,) * x.ndim)
    return _EntmaxBisect.apply(x, allowed, alpha)
