"""Closed-form vector-Jacobian products of the row normalizers, and the JVPs forward mode needs, in torch.

Per-row arguments (``multiplier``, ``gate``, ``alpha``) are python numbers or tensors
``(..., 1)`` broadcastable to ``y``; per-row results have shape ``y.shape[:-1] + (1,)``.
Every function is written so that autograd can differentiate it again (double
backward): ``pow``, ``log`` and division stay off zeros through ``torch.where``, so no
``0 * inf`` appears; none synchronises with the host, so all are ``vmap``-safe.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from attnorm.kernels import rules
from attnorm.kernels.reference.rows import Rows, rows_of
from attnorm.kernels.reference.softmax import normalized_factor, self_adjusted_parts

__all__ = [
    "entmax_alpha_direction",
    "entmax_alpha_grad",
    "entmax_jvp",
    "entmax_slopes",
    "entmax_vjp",
    "multiplier_grad",
    "self_adjusted_jvp",
    "self_adjusted_vjp",
    "self_adjusted_vjp_from",
    "softmax_vjp",
    "temperature_grad",
]


def _off_zeros(y: Tensor) -> Tensor:
    """``y`` with its zeros replaced by 1, so ``log`` and ``pow`` (and their derivatives) stay finite there."""
    return torch.where(y > 0, y, 1.0)


def _safe_log(y: Tensor) -> Tensor:
    """``log y`` where ``y > 0``, 0 elsewhere, with a finite derivative everywhere."""
    return torch.where(y > 0, _off_zeros(y).log(), 0.0)


def _safe_divide(numerator: Tensor, denominator: Tensor) -> Tensor:
    return numerator / torch.where(denominator != 0, denominator, 1.0)


def _softmax_direction(y: Tensor, grad: Tensor) -> Tensor:
    """``dz = y (g - sum(y g))``: the vector-Jacobian product of softmax with respect to its logits."""
    return y * (grad - (y * grad).sum(-1, keepdim=True))


def softmax_vjp(y: Tensor, grad: Tensor, multiplier: float | Tensor) -> Tensor:
    """``dx = m y (g - sum(y g))`` for ``y = softmax(m x)``: shared by softmax, Scalable-Softmax and top-k.

    Args:
        y: weights ``(..., L)`` (0 off the support).
        grad: incoming gradient, shaped like ``y``.
        multiplier: ``m`` per row (0 in rows holding +inf).

    Returns:
        ``dx`` shaped like ``y``.
    """
    return multiplier * _softmax_direction(y, grad)


def temperature_grad(y: Tensor, grad: Tensor, multiplier: float | Tensor) -> Tensor:
    """Gradient of a per-row temperature ``T = 1 / m``: ``-m sum(dz log y)`` over ``y > 0``.

    On the support ``log y = m x - logsumexp(m x)`` and ``sum(dz) = 0``, so this is
    ``d/dT sum(g softmax(x / T)) = -m^2 sum(dz x)`` without needing ``x``.

    Returns:
        Per-row gradient of shape ``y.shape[:-1] + (1,)``.
    """
    dz = _softmax_direction(y, grad)
    return -multiplier * (dz * _safe_log(y)).sum(-1, keepdim=True)


def multiplier_grad(y: Tensor, grad: Tensor, x: Tensor) -> Tensor:
    """Gradient of the per-row multiplier ``m`` of ``y = softmax(m x)``: ``sum(dz x)`` over ``y > 0``.

    Only finite ``x`` count, so rows holding +inf (whose support is their +inf positions)
    get 0.  The scores are taken relative to the row's largest finite support score
    (``sum(dz) = 0`` makes this exact) to avoid cancellation on large scores.

    Returns:
        Per-row gradient of shape ``y.shape[:-1] + (1,)``.
    """
    used = (y > 0) & x.isfinite()
    top = torch.where(used, x, -math.inf).amax(-1, keepdim=True).detach()
    shifted = torch.where(used, x - torch.where(top.isfinite(), top, 0.0), 0.0)
    return (_softmax_direction(y, grad) * shifted).sum(-1, keepdim=True)


def entmax_slopes(y: Tensor, alpha: float | Tensor) -> Tensor:
    """``s = y^(2 - alpha)`` on the support, 0 elsewhere: the diagonal of entmax's Jacobian (``y`` for alpha = 1).

    ``pow`` stays off the zeros, where its derivative is infinite for ``alpha > 1``.
    """
    support = y > 0
    return torch.where(support, _off_zeros(y).pow(2 - alpha), 0.0)


def entmax_vjp(y: Tensor, grad: Tensor, gate: float | Tensor, alpha: float | Tensor) -> Tensor:
    """alpha-entmax's ``dx = gate (s g - s sum(s g) / sum(s))``, ``s = y^(2 - alpha)`` on the support.

    The Jacobian of alpha-entmax (Peters, Niculae & Martins, 2019) is
    ``diag(s) - s s^T / sum(s)``: alpha = 2 gives sparsemax's (Martins & Astudillo, 2016),
    alpha = 1 softmax's.

    Args:
        y: entmax weights ``(..., L)``.
        grad: incoming gradient, shaped like ``y``.
        gate: per row, 1 (0 in rows holding +inf).
        alpha: per row, ``>= 1``.

    Returns:
        ``dx`` shaped like ``y``.
    """
    slopes = entmax_slopes(y, alpha)
    weighted = slopes * grad
    correction = _safe_divide(weighted.sum(-1, keepdim=True), slopes.sum(-1, keepdim=True))
    return _nan_rows(y, gate * (weighted - correction * slopes))


def entmax_alpha_direction(y: Tensor, gate: float | Tensor, alpha: float | Tensor) -> Tensor:
    """alpha-entmax's ``dy/dalpha = gate beta (S - s sum(S) / sum(s))``, like ``y``.

    ``beta = 1 / (alpha - 1)``, ``S = y (beta - log y)`` and ``s = y^(2 - alpha)`` on the
    support; from ``y_i^(alpha - 1) = (alpha - 1) x_i - tau(alpha)`` with ``sum(y) = 1``
    (Peters, Niculae & Martins, 2019).  Rows with alpha = 1 get 0.
    """
    alpha = torch.as_tensor(alpha, dtype=y.dtype, device=y.device)
    is_softmax = alpha == 1
    alpha = torch.where(is_softmax, 2.0, alpha)
    beta = 1 / (alpha - 1)
    slopes = entmax_slopes(y, alpha)
    entropic = torch.where(y > 0, y * (beta - _safe_log(y)), 0.0)
    ratio = _safe_divide(entropic.sum(-1, keepdim=True), slopes.sum(-1, keepdim=True))
    return _nan_rows(y, gate * torch.where(is_softmax, 0.0, beta * (entropic - ratio * slopes)))


def entmax_alpha_grad(y: Tensor, grad: Tensor, gate: float | Tensor, alpha: float | Tensor) -> Tensor:
    """Per-row gradient of alpha: ``sum(g dy/dalpha)`` (:func:`entmax_alpha_direction`).

    Returns:
        Per-row gradient of shape ``y.shape[:-1] + (1,)``.
    """
    return (grad * entmax_alpha_direction(y, gate, alpha)).sum(-1, keepdim=True)


def entmax_jvp(y: Tensor, tangent: Tensor | None, alpha_tangent: Tensor | None, gate: float | Tensor,
               alpha: float | Tensor) -> Tensor:
    """alpha-entmax's Jacobian-vector product: ``J t + dy/dalpha t_alpha`` (either tangent may be None).

    ``J = diag(s) - s s^T / sum(s)`` is symmetric, so ``J t`` is :func:`entmax_vjp` of ``t``.
    """
    out = torch.zeros_like(y) if tangent is None else entmax_vjp(y, tangent, gate, alpha)
    if alpha_tangent is not None:
        out = out + alpha_tangent * entmax_alpha_direction(y, gate, alpha)
    return out


def _nan_rows(y: Tensor, value: Tensor) -> Tensor:
    """``value`` (per position or per row) with NaN in rows whose weights ``y`` hold NaN: their gradients are NaN."""
    return torch.where(y.isnan().any(-1, keepdim=True), math.nan, value)


def self_adjusted_vjp_from(
    scores: Tensor,
    active: Tensor,
    weights: Tensor,
    low: Tensor,
    high: Tensor,
    gate: Tensor,
    grad: Tensor,
    normalized: bool,
) -> Tensor:
    """SA-Softmax's ``dx`` from its parts: softmax weights ``w`` and ``low``, ``high``, ``gate`` as ``(..., 1)``.

    Plain, ``y = x w``: ``dx = w (g + (g x - sum(g y)))``.  Normalized, ``y = phi w`` with
    ``phi = (x - low) / span``: ``dx = w (g phi - sum(g y)) + (g w - e_low sum(g w (1 - phi))
    - e_high sum(g w phi)) / span``, where ``e_low`` (``e_high``) splits 1 over the
    positions holding the row minimum (maximum) when that is at most (at least) 0 (at exactly 0, the kink of
    ``min(x, 0)``, as autograd of ``clamp``), and 0 where
    ``span = 0``.
    """
    if not normalized:
        # g + (g x - sum(g y)), not g (1 + x) - sum(g y): with one key of 1e200 the latter lost g to rounding.
        # Where the weight underflows to 0 the bracket may overflow: 0, not 0 * inf.
        bracket = grad + (grad * scores - (grad * scores * weights).sum(-1, keepdim=True))
        out = torch.where(weights > 0, weights * bracket, 0.0)
        return torch.where(active, gate * out, 0.0)
    phi, span, scale = normalized_factor(scores, low, high)
    gw = grad * weights
    direct = weights * (grad * phi) - weights * (gw * phi).sum(-1, keepdim=True)
    e_low, e_high = _extreme_shares(scores, active, low, high)
    through_span = gw - e_low * (gw * (1 - phi)).sum(-1, keepdim=True) - e_high * (gw * phi).sum(-1, keepdim=True)
    return torch.where(active, gate * (direct + _over_span(through_span, span, scale)), 0.0)


def _over_span(value: Tensor, span: Tensor, scale: Tensor) -> Tensor:
    """``value * scale / span`` (``phi``'s derivative factor, :func:`normalized_factor`), 0 where ``span = 0``."""
    return torch.where(span > 0, value * scale / torch.where(span > 0, span, 1.0), 0.0)


def _self_adjusted_setup(x: Tensor, mask: rules.RowMask) -> tuple[Rows, Tensor, Tensor, Tensor, Tensor]:
    """SA-Softmax's rows, softmax weights, ``low``, ``high`` and ``gate`` (0 in rows holding +inf or nothing)."""
    rows = rows_of(x, mask)
    weights, low, high = self_adjusted_parts(rows)
    return rows, weights, low, high, (rows.any_active & ~rows.posinf_row).to(x.dtype)


def _extreme_shares(scores: Tensor, active: Tensor, low: Tensor, high: Tensor) -> tuple[Tensor, Tensor]:
    """``e_low``, ``e_high``: 1 split over the positions holding ``low`` (``high``), 0 where none does.

    A min of exactly 0 counts (the kink of ``min(x, 0)``), as autograd of ``clamp`` and ``amin`` share it.
    """
    values = scores.detach()
    at_low = active & (values == low.detach())
    at_high = active & (values == high.detach())
    e_low = at_low.to(scores.dtype) / at_low.sum(-1, keepdim=True).clamp_min(1)
    e_high = at_high.to(scores.dtype) / at_high.sum(-1, keepdim=True).clamp_min(1)
    return e_low, e_high


def self_adjusted_jvp(x: Tensor, mask: rules.RowMask, tangent: Tensor, normalized: bool) -> Tensor:
    """SA-Softmax's Jacobian-vector product ``dy`` for a tangent ``t`` of ``x`` (:func:`self_adjusted_vjp` transposed).

    Plain, ``y = x w``: ``dy = w (t + x (t - sum(w t)))``.  Normalized, ``y = phi w``:
    ``dy = phi w (t - sum(w t)) + w (t - (1 - phi) dlow - phi dhigh) / span`` with
    ``dlow = sum(e_low t)``, ``dhigh = sum(e_high t)`` (the second term 0 where ``span = 0``).
    0 in rows holding +inf or no allowed position, NaN in rows holding NaN.
    """
    rows, weights, low, high, gate = _self_adjusted_setup(x, mask)
    scores, active = rows.scores, rows.active
    tangent = torch.where(active & x.isfinite(), tangent, 0.0)
    wt = (weights * tangent).sum(-1, keepdim=True)
    if normalized:
        phi, span, scale = normalized_factor(scores, low, high)
        e_low, e_high = _extreme_shares(scores, active, low, high)
        d_low, d_high = (e_low * tangent).sum(-1, keepdim=True), (e_high * tangent).sum(-1, keepdim=True)
        dy = phi * weights * (tangent - wt) + _over_span(weights * (tangent - (1 - phi) * d_low - phi * d_high),
                                                         span, scale)
    else:
        # t + x (t - sum(w t)): the form whose second term is 0 in a row of one key, whatever x.
        # Where the weight underflows to 0 the bracket may overflow: 0, not 0 * inf.
        dy = torch.where(weights > 0, weights * (tangent + scores * (tangent - wt)), 0.0)
    return torch.where(rows.nan_row, math.nan, torch.where(active, gate * dy, 0.0))


def self_adjusted_vjp(x: Tensor, mask: rules.RowMask, grad: Tensor, normalized: bool) -> Tensor:
    """SA-Softmax's ``dx`` for ``grad``, recomputing its parts from ``x`` (differentiable in ``x`` and ``grad``).

    Equals autograd of :func:`attnorm.kernels.reference.self_adjusted_softmax`; 0 in rows
    holding +inf or no allowed position.  See :func:`self_adjusted_vjp_from` for the formula.
    """
    rows, weights, low, high, gate = _self_adjusted_setup(x, mask)
    dx = self_adjusted_vjp_from(rows.scores, rows.active, weights, low, high, gate, grad, normalized)
    return torch.where(rows.nan_row, math.nan, dx)
