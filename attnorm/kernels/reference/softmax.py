"""Softmax-type normalizers in differentiable torch: temperature, Scalable-Softmax, top-k, SA-Softmax.

Each function normalises the last axis of ``x`` over the positions ``mask`` allows
(:class:`attnorm.kernels.rules.RowMask`), computes in ``x``'s dtype and differentiates
through plain autograd, to any order, for ``x`` and every tensor parameter.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.autograd import Function

from attnorm.kernels import rules
from attnorm.kernels.reference.rows import Rows, as_param, finish, masked_softmax, row_extremes, rows_of, shifted_scaled

__all__ = [
    "normalized_factor",
    "scalable_softmax",
    "self_adjusted_parts",
    "self_adjusted_softmax",
    "self_adjusted_stats",
    "softmax",
    "ssmax_multiplier",
    "topk_keep",
    "topk_softmax",
]


def softmax(x: Tensor, mask: rules.RowMask = rules.NO_MASK, temperature: float | Tensor = 1.0) -> Tensor:
    """Softmax with temperature over the allowed positions of each row.

    ``y_i = exp(m x_i) / sum_j exp(m x_j)`` with ``m = 1 / temperature``, computed as
    ``softmax(m (x - max x))`` (``m (x - min x)`` for ``m < 0``) so finite scores never overflow.

    Args:
        x: scores ``(..., L)``.
        mask: which positions each row may use.
        temperature: python number or tensor ``(..., 1)`` broadcastable to ``x``.

    Returns:
        Weights shaped like ``x``.
    """
    rows = rows_of(x, mask)
    multiplier = 1 / as_param(temperature, x)
    return finish(masked_softmax(shifted_scaled(rows, multiplier), rows), rows)


def ssmax_multiplier(rows: Rows, s: float | Tensor, bias: float | Tensor) -> tuple[Tensor, Tensor]:
    """Scalable-Softmax's ``(s log n + bias, log n)`` per row ``(..., 1)``, ``n`` the allowed positions (at least 1)."""
    count = rows.allowed.sum(-1, keepdim=True).to(rows.scores.dtype)
    log_count = torch.log(count.clamp_min(1))
    return s * log_count + bias, log_count


def scalable_softmax(
    x: Tensor, mask: rules.RowMask = rules.NO_MASK, s: float | Tensor = 0.43, bias: float | Tensor = 0.0
) -> Tensor:
    """Scalable-Softmax (Nakanishi, 2025, arXiv 2501.19399).

    ``y = softmax((s log n + b) x)`` with ``n`` the number of allowed positions of the row
    (+inf and NaN positions count, -inf ones do not), so attention does not fade as the
    context grows.

    Args:
        x: scores ``(..., L)``.
        mask: which positions each row may use.
        s: scaling parameter, python number or tensor ``(..., 1)``.
        bias: bias parameter, python number or tensor ``(..., 1)``.

    Returns:
        Weights shaped like ``x``.
    """
    rows = rows_of(x, mask)
    multiplier, _ = ssmax_multiplier(rows, as_param(s, x), as_param(bias, x))
    return finish(masked_softmax(shifted_scaled(rows, multiplier), rows), rows)


def topk_keep(x: Tensor, rows: Rows, k: float, is_fraction: bool, count: Tensor | None = None) -> Tensor:
    """Bool like ``x``: the ``min(k, n)`` largest allowed scores (fraction: ``max(1, ceil(k n - 1e-9))``).

    Ranks come from a stable descending sort, so among scores tied at the k-th value
    the lowest index wins.  +inf positions rank first.  ``count`` ``(..., 1)``, when given,
    replaces the number of positions kept (a sink's rule, :mod:`.sinks`).
    """
    key = torch.where(rows.allowed, x.detach(), -math.inf)
    rank = key.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1)
    if count is None:
        count = rules.topk_row_count(k, is_fraction, rules.allowed_count(rows.allowed))
    return rank < count


def topk_softmax(
    x: Tensor,
    mask: rules.RowMask = rules.NO_MASK,
    k: float = 1,
    is_fraction: bool = False,
    temperature: float | Tensor = 1.0,
) -> Tensor:
    """Softmax of ``x / temperature`` over the ``k`` largest allowed scores of each row, exact zeros elsewhere.

    Kept: ``min(k, n)`` positions, or ``max(1, ceil(k n - 1e-9))`` when ``is_fraction``
    (``0 < k < 1``), ``n`` the allowed positions; ties at the k-th value keep the lowest
    index.  A row holding +inf is uniform over its first ``k`` +inf positions.

    Args:
        x: scores ``(..., L)``.
        mask: which positions each row may use.
        k: positions to keep, or the fraction of the allowed ones.
        is_fraction: read ``k`` as a fraction.
        temperature: python number or tensor ``(..., 1)``.

    Returns:
        Weights shaped like ``x``.
    """
    rows = rows_of(x, mask)
    keep = topk_keep(x, rows, k, is_fraction)
    multiplier = 1 / as_param(temperature, x)
    return finish(masked_softmax(shifted_scaled(rows, multiplier), rows, keep), rows)


def self_adjusted_parts(rows: Rows) -> tuple[Tensor, Tensor, Tensor]:
    """SA-Softmax's softmax weights and ``(low, high)`` per row ``(..., 1)``, differentiable in the scores.

    ``low = min(min x, 0)`` and ``high = max(max x, 0)`` over the active finite scores (0 in rows with none).
    """
    weights = masked_softmax(shifted_scaled(rows, 1.0), rows)
    low = torch.where(rows.active, rows.scores, math.inf).amin(-1, keepdim=True).clamp_max(0)
    high = torch.where(rows.active, rows.scores, -math.inf).amax(-1, keepdim=True).clamp_min(0)
    low = torch.where(rows.any_active, low, 0.0)
    high = torch.where(rows.any_active, high, 0.0)
    return weights, low, high


def span_scale(low: Tensor, high: Tensor) -> Tensor:
    """1, or 1/2 in rows whose span ``high - low`` overflows: ``phi`` is then computed on halved scores."""
    return torch.where((high - low).detach().isfinite(), 1.0, 0.5).to(low.dtype)


def normalized_factor(scores: Tensor, low: Tensor, high: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``phi = (x - low) / (high - low)`` (0 where ``high = low``), the scaled span, and the scale.

    Dividing (not multiplying by ``1 / span``) keeps denormal spans finite; halving both
    sides keeps a span beyond the dtype's range finite.
    """
    scale = span_scale(low, high)
    span = high * scale - low * scale
    positive = span > 0
    phi = torch.where(positive, (scores * scale - low * scale) / torch.where(positive, span, 1.0), 0.0)
    return phi, span, scale


def self_adjusted_softmax(x: Tensor, mask: rules.RowMask = rules.NO_MASK, normalized: bool = True) -> Tensor:
    """SA-Softmax (Zheng et al., 2025, arXiv 2502.18277): ``y = phi(x) * softmax(x)``.

    ``phi(x) = x`` (plain) or ``(x - low) / (high - low)`` with ``low = min(min x, 0)``,
    ``high = max(max x, 0)`` over the allowed finite scores (normalized; ``phi = 0`` when
    ``high = low``).  A row holding +inf is the limit of the finite case: the softmax mass is
    uniform over the +inf positions, whose factor is 1 (normalized) or +inf (plain).

    Args:
        x: scores ``(..., L)``.
        mask: which positions each row may use.
        normalized: use the normalized factor.

    Its gradient is the closed form of :func:`attnorm.kernels.reference.jacobians.self_adjusted_vjp`,
    in which the paths through ``low`` and ``high`` cancel before dividing by the span (autograd of
    the forward would divide by ``span**2``, which underflows for denormal scores).

    Returns:
        Weights shaped like ``x`` (plain: possibly negative, not summing to 1).
    """
    function = _SelfAdjustedSoftmaxTraced if torch.compiler.is_compiling() else _SelfAdjustedSoftmax
    return function.apply(x, *mask, normalized)


def _self_adjusted_values(x: Tensor, mask: rules.RowMask, normalized: bool) -> Tensor:
    rows = rows_of(x, mask)
    weights, low, high = self_adjusted_parts(rows)
    if normalized:
        factor = normalized_factor(rows.scores, low, high)[0]
        limit = weights
    else:
        factor = rows.scores
        limit = torch.where(rows.active, math.inf, 0.0).to(x.dtype)
    return finish(torch.where(rows.posinf_row, limit, factor * weights), rows)


class _SelfAdjustedSoftmax(Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x, mask, diagonal, key_lengths, normalized):
        return _self_adjusted_values(x, rules.RowMask(mask, diagonal, key_lengths), normalized)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, mask, ctx.diagonal, key_lengths, ctx.normalized = inputs
        ctx.save_for_backward(x, mask, key_lengths)
        ctx.save_for_forward(x, mask, key_lengths)

    @staticmethod
    def jvp(ctx, tangent, _mask, _diagonal, _key_lengths, _normalized):
        from attnorm.kernels.reference.jacobians import self_adjusted_jvp

        x, mask, key_lengths = ctx.saved_tensors
        return self_adjusted_jvp(x, rules.RowMask(mask, ctx.diagonal, key_lengths), tangent, ctx.normalized)

    @staticmethod
    def backward(ctx, grad):
        from attnorm.kernels.reference.jacobians import self_adjusted_vjp  # jacobians builds on this module

        x, mask, key_lengths = ctx.saved_tensors
        dx = self_adjusted_vjp(x, rules.RowMask(mask, ctx.diagonal, key_lengths), grad, ctx.normalized)
        return dx, None, None, None, None


class _SelfAdjustedSoftmaxTraced(_SelfAdjustedSoftmax):
    """:class:`_SelfAdjustedSoftmax` without its ``jvp``, for ``torch.compile``: Dynamo traces no Function that
    defines one (it broke the graph of every compiled call needing a gradient; forward mode runs eagerly)."""

    jvp = Function.jvp


def self_adjusted_stats(rows: Rows, low: Tensor, high: Tensor) -> Tensor:
    """``(c0, c1, low, high, gate)`` per row, shape ``(..., 5)``: softmax weights are ``exp((x - c0) - c1)``."""
    top, _ = row_extremes(rows.scores, rows)
    gate = rows.any_active & ~rows.posinf_row
    shifted = torch.where(rows.active, rows.scores - top, -math.inf)
    log_sum = torch.where(gate, torch.logsumexp(torch.where(gate, shifted, 0.0), dim=-1, keepdim=True), 0.0)
    top = torch.where(gate, top, 0.0)
    return torch.cat([top, log_sum, low, high, gate.to(low.dtype)], dim=-1)
