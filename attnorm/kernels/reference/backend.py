"""The seven backend functions of the kernel contract (``kernels/README.md``), in pure torch.

What devices other than CPU and CUDA run.  Half-precision inputs are computed in
float32 (weights and ``dx`` come back in the input's dtype); per-row outputs have shape
``x.shape[:-1]`` and dtype :func:`attnorm.kernels.rules.accumulation_dtype`.  No
function synchronises with the host or branches on tensor values.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnorm.kernels import rules
from attnorm.kernels.reference.jacobians import (
    entmax_alpha_grad,
    entmax_vjp,
    multiplier_grad,
    self_adjusted_vjp_from,
    softmax_vjp,
    temperature_grad,
)
from attnorm.kernels.reference.rows import Rows, as_param, finish, masked_softmax, per_row, rows_of, shifted_scaled
from attnorm.kernels.reference.softmax import (
    self_adjusted_parts,
    self_adjusted_softmax,
    self_adjusted_stats,
    ssmax_multiplier,
    topk_keep,
)
from attnorm.kernels.reference.sparse import entmax

__all__ = [
    "entmax_backward",
    "entmax_forward",
    "self_adjusted_backward",
    "self_adjusted_forward",
    "softmax_backward",
    "softmax_forward",
    "topk_forward",
]


def _working(x: Tensor) -> Tensor:
    return x.to(rules.accumulation_dtype(x.dtype))


def _column(value: float | Tensor, like: Tensor) -> float | Tensor:
    """A per-row output ``(...,)`` as a column ``(..., 1)`` against rows ``(..., L)``, in ``like``'s dtype."""
    return value.to(like.dtype).unsqueeze(-1) if isinstance(value, Tensor) else value


def _per_row_out(column: Tensor, like: Tensor) -> Tensor:
    """A ``(..., 1)`` result as the contract's per-row output ``like.shape[:-1]``."""
    return column.expand(like.shape[:-1] + (1,)).squeeze(-1)


def _multiplier(rows: Rows, multiplier: float | Tensor) -> Tensor:
    """``m`` per row in the accumulation dtype, 0 in rows holding +inf."""
    return per_row(multiplier, rows.scores, rows.scores.dtype).masked_fill(rows.posinf_row.squeeze(-1), 0.0)


def softmax_forward(
    x: Tensor, mask: rules.RowMask, variant: int, first: float | Tensor, second: float | Tensor
) -> tuple[Tensor, Tensor, Tensor | None]:
    """``y = softmax(m x)`` over the allowed positions; variant 0: ``m = 1 / first``, 1: ``m = first log n + second``.

    Returns:
        ``(y, multiplier, log_count)``: ``log_count = log(max(n, 1))`` for variant 1, None for 0.

    Raises:
        ValueError: ``variant`` not 0 or 1.
    """
    work = _working(x)
    rows = rows_of(work, mask)
    if variant == 0:
        multiplier, log_count = 1 / as_param(first, work), None
    elif variant == 1:
        multiplier, log_count = ssmax_multiplier(rows, as_param(first, work), as_param(second, work))
        log_count = log_count.squeeze(-1)
    else:
        raise ValueError(f"variant must be 0 (temperature) or 1 (Scalable-Softmax), got {variant}")
    y = finish(masked_softmax(shifted_scaled(rows, multiplier), rows), rows)
    return y.to(x.dtype), _multiplier(rows, multiplier), log_count


def softmax_backward(
    y: Tensor, grad: Tensor, multiplier: float | Tensor, x: Tensor | None, param_grad: int
) -> tuple[Tensor, Tensor | None]:
    """``dx = m y (g - sum(y g))`` and, per ``param_grad``, nothing (0), the temperature's (1) or ``m``'s (2) gradient.

    Raises:
        ValueError: ``param_grad`` not 0, 1 or 2, or 2 without ``x``.
    """
    work, grad = _working(y), _working(grad)
    multiplier = _column(multiplier, work)
    dx = softmax_vjp(work, grad, multiplier).to(y.dtype)
    if param_grad == 0:
        return dx, None
    if param_grad == 1:
        return dx, _per_row_out(temperature_grad(work, grad, multiplier), work)
    if param_grad == 2 and x is not None:
        return dx, _per_row_out(multiplier_grad(work, grad, x.to(work.dtype)), work)
    given = "with x" if x is not None else "without x"
    raise ValueError(f"param_grad must be 0, 1 or 2 (2 needs x), got {param_grad} {given}")


def topk_forward(
    x: Tensor, mask: rules.RowMask, k: float, is_fraction: bool, temperature: float | Tensor
) -> tuple[Tensor, Tensor]:
    """Softmax of ``x / temperature`` over the kept positions (ties: lowest index), exact 0 elsewhere.

    Returns:
        ``(y, multiplier)``, ``multiplier = 1 / temperature`` per row (0 in rows holding +inf).
    """
    work = _working(x)
    rows = rows_of(work, mask)
    keep = topk_keep(work, rows, k, is_fraction)
    multiplier = 1 / as_param(temperature, work)
    y = finish(masked_softmax(shifted_scaled(rows, multiplier), rows, keep), rows)
    return y.to(x.dtype), _multiplier(rows, multiplier)


def entmax_forward(x: Tensor, mask: rules.RowMask, alpha: float | Tensor) -> tuple[Tensor, Tensor]:
    """alpha-entmax for any ``alpha >= 1`` per row.

    Returns:
        ``(y, gate)``, ``gate`` 1 per row, 0 in rows holding +inf.
    """
    work = _working(x)
    rows = rows_of(work, mask)
    gate = (~rows.posinf_row).squeeze(-1).to(work.dtype)
    return entmax(work, mask, alpha).to(x.dtype), gate


def entmax_backward(
    y: Tensor, grad: Tensor, gate: Tensor, alpha: float | Tensor, alpha_grad: bool
) -> tuple[Tensor, Tensor | None]:
    """``dx = gate (s g - s sum(s g) / sum(s))``, ``s = y^(2 - alpha)``; with ``alpha_grad`` also alpha's per row."""
    work, grad = _working(y), _working(grad)
    gate = _column(gate, work)
    alpha = alpha.to(work.dtype) if isinstance(alpha, Tensor) else alpha
    dx = entmax_vjp(work, grad, gate, alpha).to(y.dtype)
    if not alpha_grad:
        return dx, None
    return dx, _per_row_out(entmax_alpha_grad(work, grad, gate, alpha), work)


def self_adjusted_forward(x: Tensor, mask: rules.RowMask, normalized: bool) -> tuple[Tensor, Tensor]:
    """SA-Softmax ``y = phi(x) softmax(x)`` and its stats ``(..., 5)``: ``(c0, c1, low, high, gate)``.

    The softmax weights are ``exp((x - c0) - c1)``; ``gate`` is 0 in rows holding +inf or fully masked.
    """
    work = _working(x)
    rows = rows_of(work, mask)
    _, low, high = self_adjusted_parts(rows)
    return self_adjusted_softmax(work, mask, normalized).to(x.dtype), self_adjusted_stats(rows, low, high)


def self_adjusted_backward(x: Tensor, mask: rules.RowMask, grad: Tensor, stats: Tensor, normalized: bool) -> Tensor:
    """SA-Softmax's ``dx``, recomputing the softmax weights from ``x`` and ``stats`` (NaN rows give NaN)."""
    work, grad_work = _working(x), _working(grad)
    rows = rows_of(work, mask)
    top, log_sum, low, high, gate = stats.to(work.dtype).unsqueeze(-2).unbind(-1)
    used = rows.active & (gate > 0)
    weights = torch.where(used, torch.exp(torch.where(used, (rows.scores - top) - log_sum, 0.0)), 0.0)
    dx = self_adjusted_vjp_from(rows.scores, rows.active, weights, low, high, gate, grad_work, normalized)
    return finish(dx, rows).to(x.dtype)
