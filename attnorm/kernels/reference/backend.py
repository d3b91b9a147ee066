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
from attnorm.kernels.reference.rows import (
    Rows,
    as_param,
    cap_slope,
    capped,
    finish,
    masked_softmax,
    per_row,
    rows_of,
    shifted_scaled,
)
from attnorm.kernels.reference.sinks import append, extend, weights_of
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
    x: Tensor, mask: rules.RowMask, variant: int, first: float | Tensor, second: float | Tensor,
    sink: Tensor | None = None, softcap: float | None = None, weights_only: bool = False,
) -> tuple[Tensor, ...]:
    """``y = softmax(m x)`` over the allowed positions; variant 0: ``m = 1 / first``, 1: ``m = first log n + second``.

    Returns:
        ``(y, multiplier, log_count)``: ``log_count = log(max(n, 1))`` for variant 1, None for 0;
        with a ``sink``, its weight per row last.

    Raises:
        ValueError: ``variant`` not 0 or 1.
    """
    if softcap is not None:
        return _as_input(softmax_forward(_capped(x, softcap), mask, variant, first, second, sink), x)
    if sink is not None:
        return _sunk_softmax_forward(x, mask, variant, first, second, sink)
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
    y: Tensor, grad: Tensor, multiplier: float | Tensor, x: Tensor | None, param_grad: int,
    sink_weight: Tensor | None = None, sink: Tensor | None = None, softcap: float | None = None,
) -> tuple[Tensor, ...]:
    """``dx = m y (g - sum(y g))`` and, per ``param_grad``, nothing (0), the temperature's (1) or ``m``'s (2) gradient.

    With ``sink_weight``: the same on ``[y, sink_weight]`` and ``[g, 0]`` (``[x, sink]``), and
    the sink's gradient per row last.

    Raises:
        ValueError: ``param_grad`` not 0, 1 or 2, or 2 without ``x`` (or ``sink``).
    """
    if softcap is not None:
        if x is None:
            raise ValueError("softcap needs the raw scores x")
        scores = _capped(x, softcap) if param_grad == 2 else None  # the capped scores m multiplies
        out = softmax_backward(y, grad, multiplier, scores, param_grad, sink_weight, sink)
        return _through_cap(out, x, softcap, y)
    if sink_weight is not None:
        if param_grad == 2 and (x is None or sink is None):
            raise ValueError("param_grad 2 with a sink needs x and sink")
        extended, grad, x = _extended_backward_inputs(y, grad, sink_weight, x, sink)
        dx, per_row = softmax_backward(extended, grad, multiplier, x, param_grad)
        return _real(dx, y), per_row, _sink_grad(dx)
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
    x: Tensor, mask: rules.RowMask, k: float, is_fraction: bool, temperature: float | Tensor,
    sink: Tensor | None = None, softcap: float | None = None, weights_only: bool = False,
) -> tuple[Tensor, ...]:
    """Softmax of ``x / temperature`` over the kept positions (ties: lowest index), exact 0 elsewhere.

    Returns:
        ``(y, multiplier)``, ``multiplier = 1 / temperature`` per row (0 in rows holding +inf);
        with a ``sink``, its weight per row last.
    """
    if softcap is not None:
        return _as_input(topk_forward(_capped(x, softcap), mask, k, is_fraction, temperature, sink), x)
    if sink is not None:
        work, rows, _, weights = _sunk(x, mask, sink, "topk_softmax", k=k, is_fraction=is_fraction,
                                       temperature=temperature)
        multiplier = _multiplier(rows, 1 / as_param(temperature, work))
        return _real(weights, x), multiplier, _sink_weight(weights)
    work = _working(x)
    rows = rows_of(work, mask)
    keep = topk_keep(work, rows, k, is_fraction)
    multiplier = 1 / as_param(temperature, work)
    y = finish(masked_softmax(shifted_scaled(rows, multiplier), rows, keep), rows)
    return y.to(x.dtype), _multiplier(rows, multiplier)


def entmax_forward(
    x: Tensor, mask: rules.RowMask, alpha: float | Tensor, sink: Tensor | None = None, softcap: float | None = None,
    weights_only: bool = False,
) -> tuple[Tensor, ...]:
    """alpha-entmax for any ``alpha >= 1`` per row.

    Returns:
        ``(y, gate)``, ``gate`` 1 per row, 0 in rows holding +inf; with a ``sink``, its weight per row last.
    """
    if softcap is not None:
        return _as_input(entmax_forward(_capped(x, softcap), mask, alpha, sink), x)
    if sink is not None:
        work, rows, _, weights = _sunk(x, mask, sink, "entmax", alpha=alpha)
        gate = (~rows.posinf_row).squeeze(-1).to(work.dtype)
        return _real(weights, x), gate, _sink_weight(weights)
    work = _working(x)
    rows = rows_of(work, mask)
    gate = (~rows.posinf_row).squeeze(-1).to(work.dtype)
    return entmax(work, mask, alpha).to(x.dtype), gate


def entmax_backward(
    y: Tensor, grad: Tensor, gate: Tensor, alpha: float | Tensor, alpha_grad: bool, sink_weight: Tensor | None = None,
    x: Tensor | None = None, softcap: float | None = None,
) -> tuple[Tensor, ...]:
    """``dx = gate (s g - s sum(s g) / sum(s))``, ``s = y^(2 - alpha)``; with ``alpha_grad`` also alpha's per row.

    With ``sink_weight``: the same on ``[y, sink_weight]`` and ``[g, 0]``, and the sink's gradient per row last.
    """
    if softcap is not None:
        if x is None:
            raise ValueError("softcap needs the raw scores x")
        return _through_cap(entmax_backward(y, grad, gate, alpha, alpha_grad, sink_weight), x, softcap, y)
    if sink_weight is not None:
        extended, grad, _ = _extended_backward_inputs(y, grad, sink_weight, None, None)
        dx, per_row = entmax_backward(extended, grad, gate, alpha, alpha_grad)
        return _real(dx, y), per_row, _sink_grad(dx)
    work, grad = _working(y), _working(grad)
    gate = _column(gate, work)
    alpha = alpha.to(work.dtype) if isinstance(alpha, Tensor) else alpha
    dx = entmax_vjp(work, grad, gate, alpha).to(y.dtype)
    if not alpha_grad:
        return dx, None
    return dx, _per_row_out(entmax_alpha_grad(work, grad, gate, alpha), work)


def self_adjusted_forward(
    x: Tensor, mask: rules.RowMask, normalized: bool, sink: Tensor | None = None, softcap: float | None = None,
    weights_only: bool = False,
) -> tuple[Tensor, ...]:
    """SA-Softmax ``y = phi(x) softmax(x)`` and its stats ``(..., 5)``: ``(c0, c1, low, high, gate)``.

    The softmax weights are ``exp((x - c0) - c1)``; ``gate`` is 0 in rows holding +inf or fully masked.
    With a ``sink``, the stats are the extended row's and the sink's weight per row comes last.
    """
    if softcap is not None:
        return _as_input(self_adjusted_forward(_capped(x, softcap), mask, normalized, sink), x)
    if sink is not None:
        _, rows, _, weights = _sunk(x, mask, sink, "self_adjusted_softmax", normalized=normalized)
        _, low, high = self_adjusted_parts(rows)
        return _real(weights, x), self_adjusted_stats(rows, low, high), _sink_weight(weights)
    work = _working(x)
    rows = rows_of(work, mask)
    _, low, high = self_adjusted_parts(rows)
    return self_adjusted_softmax(work, mask, normalized).to(x.dtype), self_adjusted_stats(rows, low, high)


def self_adjusted_backward(
    x: Tensor, mask: rules.RowMask, grad: Tensor, stats: Tensor, normalized: bool, sink: Tensor | None = None,
    softcap: float | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """SA-Softmax's ``dx``, recomputing the softmax weights from ``x`` and ``stats`` (NaN rows give NaN).

    With a ``sink``: the same on ``[x, sink]`` and ``[g, 0]``, returning ``(dx, dsink)``.
    """
    if softcap is not None:
        out = self_adjusted_backward(_capped(x, softcap), mask, grad, stats, normalized, sink)
        return _through_cap(out, x, softcap, x)
    if sink is not None:
        extended, keep, _ = extend(_working(x), mask, sink)
        dx = self_adjusted_backward(extended, keep, append(_working(grad)), stats, normalized)
        return _real(dx, x), _sink_grad(dx)
    work, grad_work = _working(x), _working(grad)
    rows = rows_of(work, mask)
    top, log_sum, low, high, gate = stats.to(work.dtype).unsqueeze(-2).unbind(-1)
    used = rows.active & (gate > 0)
    weights = torch.where(used, torch.exp(torch.where(used, (rows.scores - top) - log_sum, 0.0)), 0.0)
    dx = self_adjusted_vjp_from(rows.scores, rows.active, weights, low, high, gate, grad_work, normalized)
    return finish(dx, rows).to(x.dtype)


# ---- a sink per row (kernels/README.md, "A sink per row") ----------------------------------


def _sunk(x: Tensor, mask: rules.RowMask, sink: Tensor, kernel: str, **params) -> tuple[Tensor, Rows, Tensor, Tensor]:
    """``x`` in the accumulation dtype, the extended row's rows, the real allowed keys per row ``(..., 1)`` and
    the extended row's weights (the sink's last)."""
    work = _working(x)
    extended, keep, count = extend(work, mask, sink)
    return work, rows_of(extended, keep), count, weights_of(kernel, extended, keep, count, **params)


def _real(weights: Tensor, x: Tensor) -> Tensor:
    """The real positions' part of an extended row, laid out like ``x`` (the ops' fake kernels say so)."""
    return weights[..., :-1].to(x.dtype).contiguous()


def _sink_weight(weights: Tensor) -> Tensor:
    return weights[..., -1].clone()  # a view would alias the weights: ops' outputs may not


def _sink_grad(dx: Tensor) -> Tensor:
    return dx[..., -1].to(rules.accumulation_dtype(dx.dtype), copy=True)


def _sunk_softmax_forward(x, mask, variant, first, second, sink) -> tuple[Tensor, Tensor, Tensor | None, Tensor]:
    if variant == 0:
        work, rows, _, weights = _sunk(x, mask, sink, "softmax", temperature=first)
        multiplier, log_count = 1 / as_param(first, work), None
    elif variant == 1:
        work, rows, count, weights = _sunk(x, mask, sink, "scalable_softmax", s=first, bias=second)
        log_count = torch.log(count.clamp_min(1).to(work.dtype))
        multiplier = as_param(first, work) * log_count + as_param(second, work)
        log_count = log_count.squeeze(-1)
    else:
        raise ValueError(f"variant must be 0 (temperature) or 1 (Scalable-Softmax), got {variant}")
    return _real(weights, x), _multiplier(rows, multiplier), log_count, _sink_weight(weights)


def _extended_backward_inputs(y: Tensor, grad: Tensor, sink_weight: Tensor, x: Tensor | None,
                              sink: Tensor | None) -> tuple[Tensor, Tensor, Tensor | None]:
    """``[y, sink_weight]``, ``[g, 0]`` and ``[x, sink]`` (None without ``x``), in the accumulation dtype."""
    return append(_working(y), sink_weight), append(_working(grad)), None if x is None else append(_working(x), sink)


# ---- soft-capping (kernels/README.md, "Soft-capping") -------------------------------------


def _capped(x: Tensor, softcap: float) -> Tensor:
    return capped(_working(x), softcap)


def _as_input(out: tuple[Tensor, ...], x: Tensor) -> tuple[Tensor, ...]:
    """A forward's outputs with the weights back in the raw scores' dtype (capping ran in the accumulation dtype)."""
    return (out[0].to(x.dtype), *out[1:])


def _through_cap(out: Tensor | tuple[Tensor, ...], x: Tensor, softcap: float, like: Tensor):
    """A backward's outputs at the capped scores, ``dx`` carried through the cap: times ``1 - tanh(x / cap)^2``."""
    dx = out if isinstance(out, Tensor) else out[0]
    dx = (dx.to(rules.accumulation_dtype(dx.dtype)) * cap_slope(_working(x), softcap)).to(like.dtype)
    return dx if isinstance(out, Tensor) else (dx, *out[1:])
