"""Sparsemax, alpha-entmax and top-k softmax without sorting rows (the fast CPU path).

These normalizers keep few positions per row, so the work is arranged around the
candidates for the support (:mod:`attnorm.kernels.cpu_candidates`):

1. one vectorised pass takes the maxima of groups of up to 16 interleaved
   positions; their maximum is the row's, and it bounds the threshold from below
   (entmax's ``tau >= (alpha - 1) max - 1``, raised by three Newton steps on the
   group maxima);
2. the groups above the bound are gathered (for top-k: the k groups with the largest
   maxima), then their single positions above the bound, into a small padded matrix;
3. the threshold is found there: safeguarded Newton on the entmax threshold
   (finite and exact for sparsemax), ``torch.topk`` for top-k;
4. the output is a zero buffer with the surviving weights written in.

Entmax's backward finds the support again from the saved output's group maxima
and applies the closed-form Jacobian there; top-k's is softmax's backward.  Both
save only the output (and tensor parameters) and are built from differentiable
torch ops, so double backward works.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor
from torch.autograd import Function

from attnorm.kernels.cpu_candidates import Candidates, group_maxima, pack_groups, top_groups
from attnorm.kernels.old_reference import masked_softmax, topk_row_count
from attnorm.kernels.sparse import save_output, saved_output, sum_to_shape

__all__ = ["Bracket", "entmax_support", "entmax_threshold", "topk_support"]


def _power(base: Tensor, exponent: float | Tensor) -> Tensor:
    """``base ** exponent`` for ``base >= 0``, 0 wherever ``base`` is 0 (differentiable).

    Zeros are kept out of ``pow`` itself: its derivative there is infinite for
    exponents below 1 (a double backward would meet ``0 * inf``), and the CPU's
    ``sqrt`` and ``pow`` are slow on zeros.
    """
    if isinstance(exponent, float):
        if exponent == 1.0:
            return base
        if exponent == 2.0:
            return base * base
        if exponent == 0.0:
            return (base > 0).to(base.dtype)
    positive = base > 0
    safe_base = torch.where(positive, base, 1.0)
    powered = safe_base.sqrt() if isinstance(exponent, float) and exponent == 0.5 else safe_base.pow(exponent)
    return torch.where(positive, powered, 0.0)


def _power_into(base: Tensor, exponent: float | Tensor, out: Tensor) -> Tensor:
    """``out ~= base ** exponent`` for ``base >= 0``, without autograd, for sums over a row.

    Computed as ``exp(exponent * log(max(base, floor)))``: in-place ``log`` and ``exp``
    are several times faster than ``pow`` on the CPU, and the floor keeps them off
    their slow paths for 0 and for underflow.  Where ``base`` is 0 the result is
    ``floor ** exponent <= 1e-30`` (float32; 1e-300 in float64), not 0: harmless in
    row sums, and multiplied by ``base`` itself where it must vanish.
    """
    if isinstance(exponent, float):
        if exponent == 0.0:
            return torch.sign(base, out=out)
        if exponent == 1.0:
            return out.copy_(base)
        if exponent == 2.0:
            return torch.mul(base, base, out=out)
    if not bool((torch.as_tensor(exponent) > 0).all()):
        return out.copy_(_power(base, exponent))
    finfo = torch.finfo(base.dtype)
    negligible = 1e-30 if base.dtype == torch.float32 else 1e-300
    floor = torch.as_tensor(negligible, dtype=base.dtype).pow(1 / torch.as_tensor(exponent, dtype=base.dtype))
    floor = floor.clamp_min(finfo.tiny)
    if isinstance(exponent, float) and exponent == 0.5:
        return torch.clamp(base, min=floor, out=out).sqrt_()
    return torch.clamp(base, min=floor, out=out).log_().mul_(exponent).exp_()


def _gap_into(values: Tensor, tau: Tensor, scale: float | Tensor, out: Tensor) -> Tensor:
    """``out = (scale * (values - tau))_+``."""
    torch.sub(values, tau, out=out)
    if not (isinstance(scale, float) and scale == 1.0):
        out.mul_(scale)
    return out.clamp_min_(0)


def _newton_step(
    values: Tensor, tau: Tensor, scale: float | Tensor, exponent: float | Tensor, work: tuple[Tensor, Tensor]
) -> tuple[Tensor, Tensor]:
    """Newton step on the threshold of ``sum_i (scale * (v_i - tau))_+^p = 1``, and the sum minus 1.

    ``values`` is ``(R, W)`` (-inf padding); ``work`` two buffers shaped like it.
    For ``p >= 1`` the step is Newton's on ``||(scale * (v - tau))_+||_p - 1``, a convex
    decreasing function of ``tau``: from below, the iterates rise monotonically to the
    root, and one candidate, or sparsemax's settled support, is solved in one step.
    For ``p < 1`` it is Newton's on ``sum(...)^p - 1``, taken from above.
    """
    gap, slope = work
    _gap_into(values, tau, scale, gap)
    _power_into(gap, exponent - 1, slope)
    slope_sum = slope.sum(-1, keepdim=True)  # sum gap^(p-1)
    mass = slope.mul_(gap).sum(-1, keepdim=True)  # sum gap^p
    norm = mass.pow(1 / exponent)
    norm_step = (norm - 1) * mass / (scale * norm * slope_sum)
    plain_step = (mass - 1) / (exponent * scale * slope_sum)
    if isinstance(exponent, float):
        step = norm_step if exponent >= 1 else plain_step
    else:
        step = torch.where(exponent >= 1, norm_step, plain_step)
    return torch.where(slope_sum > 0, step, 0.0), mass - 1


class Bracket(NamedTuple):
    """Per-row state of the threshold search: the iterate and ``low <= root <= high``."""

    tau: Tensor
    low: Tensor
    high: Tensor

    @classmethod
    def start(cls, low: Tensor, high: Tensor, exponent: float | Tensor) -> Bracket:
        """Start from ``low`` where ``p >= 1``, from ``high`` where ``p < 1``: the sides
        the Newton iterates approach the root from."""
        if isinstance(exponent, float):
            return cls(low if exponent >= 1 else high, low, high)
        return cls(torch.where(exponent >= 1, low, high), low, high)


def entmax_threshold(
    values: Tensor,
    bracket: Bracket,
    scale: float | Tensor,
    exponent: float | Tensor,
    max_steps: int,
    tolerance: float,
    work: tuple[Tensor, Tensor] | None = None,
) -> tuple[Bracket, bool]:
    """Safeguarded Newton on the entmax threshold of each row of ``values`` (R, W).

    A step leaving the bracket is replaced by bisection.  ``work`` is two scratch
    buffers shaped like ``values`` (allocated when None).  Returns the new bracket and
    whether every row's last move was below ``tolerance * max(1, |tau|)``.
    """
    tau, low, high = bracket
    work = (torch.empty_like(values), torch.empty_like(values)) if work is None else work
    for _ in range(max_steps):
        step, excess = _newton_step(values, tau, scale, exponent, work)
        low = torch.where(excess >= 0, torch.maximum(low, tau), low)
        high = torch.where(excess <= 0, torch.minimum(high, tau), high)
        proposal = tau + step
        outside = (proposal < low) | (proposal > high)
        proposal = torch.where(outside, (low + high) / 2, proposal)
        moved = (proposal - tau).abs()
        tau = proposal
        if bool((moved <= tolerance * tau.abs().clamp_min(1)).all()):
            return Bracket(tau, low, high), True
    return Bracket(tau, low, high), False


def _work_buffers(x: Tensor, keep: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """Contiguous ``(R, L)`` scores with masked positions at -inf, and an output buffer.

    The buffer is None when the scores are a fresh masked copy: that copy becomes
    the output once its candidates are packed (a fresh tensor costs page faults).
    """
    length = x.shape[-1]
    if keep is None and x.is_contiguous():
        scores = x.view(-1, length)
        return scores, torch.empty_like(scores)
    scores = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if keep is None:
        scores.copy_(x)
    else:
        torch.where(keep, x, torch.tensor(-math.inf, dtype=x.dtype), out=scores)
    return scores.view(-1, length), None


def _per_row(value: float | Tensor, shape: torch.Size, rows: int) -> float | Tensor:
    if isinstance(value, Tensor):
        return value.expand(*shape[:-1], 1).reshape(rows, 1)
    return value


def _support(out: Tensor, grad: Tensor) -> tuple[Candidates, Tensor, Tensor]:
    """The groups holding a saved output's support, its weights and the incoming gradient there."""
    out2d = out.view(-1, out.shape[-1])
    support = pack_groups(out2d, group_maxima(out2d) > 0)
    return support, support.values, support.take(grad)


def _gradient_buffer(support: Candidates, values: Tensor, out: Tensor) -> Tensor:
    """The gradient w.r.t. the scores: ``values`` on the support, zeros elsewhere."""
    if support.row is None:
        return values.view(out.shape)
    # Allocated from ``values`` (not ``out``) so that under vmap (vectorized
    # jacobians) the buffer is batched like the gradient written into it.
    buffer = values.new_empty((support.rows_count, out.shape[-1]))
    return support.scatter(values, buffer).view(out.shape)


class _Entmax(Function):
    @staticmethod
    def forward(ctx, x: Tensor, keep: Tensor | None, alpha: float | Tensor):
        rows_count = x.numel() // x.shape[-1]
        scores, out = _work_buffers(x, keep)
        scale = _per_row(alpha, x.shape, rows_count) - 1  # entmax works on scale * x; 1 is sparsemax
        exponent = 1 / scale
        block_max = group_maxima(scores)
        top = block_max.amax(-1, keepdim=True)
        bad = ~torch.isfinite(top)
        # Thresholds are solved relative to the row maximum, where float32 resolves
        # them finely even for scores offset by thousands.
        top = top.masked_fill(bad, 0.0)
        low = -exponent * torch.ones_like(top)  # the top score alone has mass 1 at top - 1/(alpha-1)
        if isinstance(exponent, Tensor) or exponent >= 1:
            low = _tighten(block_max - top, low, scale, exponent)
        # A few ulps of slack keep the rounded absolute bound below the threshold.
        bound = (top + low - 4 * torch.finfo(x.dtype).eps * top.abs()).masked_fill(bad, math.inf)
        candidates = pack_groups(scores, block_max > bound).narrow(bound, inclusive=False)
        values = candidates.values - top
        # Above the root: each of the n candidates has mass <= 1 / n there.
        high = -candidates.counts.clamp_min(1).to(x.dtype).pow(-scale) / scale
        work = (torch.empty_like(values), torch.empty_like(values))
        bracket = Bracket.start(low, high, exponent)
        tolerance = 16 * torch.finfo(x.dtype).eps
        bracket, _ = entmax_threshold(values, bracket, scale, exponent, 100, tolerance, work)
        gap = _gap_into(values, bracket.tau, scale, work[0])
        weights = _power_into(gap, exponent, work[1])
        if not (isinstance(exponent, float) and exponent in (1.0, 2.0)):
            weights *= gap.sign_()  # exact zeros off the support
        weights = (weights / weights.sum(-1, keepdim=True)).masked_fill_(bad, 0.0)  # bad rows: no candidates
        out = candidates.scatter(weights, scores if out is None else out).view(x.shape)
        return save_output(ctx, out, bad.view(x.shape[:-1]), alpha)

    @staticmethod
    def backward(ctx, grad: Tensor, _grad_bad: Tensor | None):
        out, alpha_parameter = saved_output(ctx)
        rows_count = out.numel() // out.shape[-1]
        support, weights, grad_values = _support(out, grad)
        alpha = alpha_parameter
        if isinstance(alpha_parameter, Tensor):
            alpha = support.per_entry(_per_row(alpha_parameter, out.shape, rows_count))
        # Jacobian of entmax: diag(s) - s s^T / sum(s), s = out^(2 - alpha) on the support.
        if torch.is_grad_enabled():  # a double backward differentiates the slopes
            slopes = _power(weights, 2 - alpha)
        else:
            slopes = _power_into(weights, 2 - alpha, torch.empty_like(weights)).mul_(weights.sign())
        slope_total = support.row_sum(slopes)
        total = support.per_entry(torch.where(slope_total > 0, slope_total, 1.0))
        grad_x = slopes * (grad_values - support.per_entry(support.row_sum(slopes * grad_values)) / total)
        grad_alpha = None
        if ctx.needs_input_grad[2]:
            # d out_i / d alpha = beta (S_i - s_i sum(S) / sum(s)), S_i = out_i (beta - log out_i),
            # beta = 1 / (alpha - 1)  (as in attnorm.kernels.sparse).
            beta = 1 / (alpha - 1)
            positive = weights > 0
            entropy_terms = torch.where(positive, weights * (beta - torch.where(positive, weights, 1.0).log()), 0.0)
            d_out = beta * (entropy_terms - slopes * support.per_entry(support.row_sum(entropy_terms)) / total)
            per_row = support.row_sum(grad_values * d_out).view(*out.shape[:-1], 1)
            grad_alpha = sum_to_shape(per_row, alpha_parameter.shape)
        return _gradient_buffer(support, grad_x, out), None, grad_alpha


def _tighten(block_max: Tensor, low: Tensor, scale: float | Tensor, exponent: float | Tensor) -> Tensor:
    """A higher lower bound on the entmax threshold from the group maxima (relative to the row max).

    The threshold of the problem restricted to a subset of a row's scores is at most
    the row's threshold, and for ``p >= 1`` (convex) Newton iterates from below stay
    below it; the group maxima are such a subset and hold most of the support.
    Rows with ``p < 1`` keep ``low``.
    """
    work = (torch.empty_like(block_max), torch.empty_like(block_max))
    subset_low = low
    for _ in range(3):
        subset_low = subset_low + _newton_step(block_max, subset_low, scale, exponent, work)[0]
    tighter = torch.maximum(low, subset_low)
    if isinstance(exponent, Tensor):
        return torch.where(exponent >= 1, tighter, low)
    return tighter


def entmax_support(x: Tensor, keep: Tensor | None, alpha: float | Tensor) -> tuple[Tensor, Tensor]:
    """alpha-entmax (alpha > 1; 2 is sparsemax) over the last axis of ``x``.

    Args:
        x: scores ``(..., L)``, float32 or float64, on the CPU.
        keep: bool tensor broadcastable to ``x`` (True = may attend) or None; -inf
            scores are masked too.
        alpha: a python float > 1, or a tensor of shape ``(..., 1)`` with values > 1
            (receives a gradient when it requires one).

    Returns:
        ``(weights, bad)``: weights like ``x`` (contiguous) and a bool tensor of shape
        ``x.shape[:-1]`` flagging rows left at zero because they are fully masked or
        hold +inf or NaN (their maximum is not finite); the caller recomputes those rows.
    """
    return _Entmax.apply(x, keep, alpha)


class _TopKSoftmax(Function):
    @staticmethod
    def forward(ctx, x: Tensor, keep: Tensor | None, k: float, scale: float | Tensor, allowed_count: Tensor | None):
        length = x.shape[-1]
        rows_count = x.numel() // length
        scores, out = _work_buffers(x, keep)
        block_max = group_maxima(scores)
        bad = ~torch.isfinite(block_max.amax(-1, keepdim=True))
        if allowed_count is None:
            count = torch.full((rows_count, 1), min(int(k), length), device=x.device)
        else:
            count = topk_row_count(k, allowed_count.expand(*x.shape[:-1], 1).reshape(rows_count, 1))
        largest = int(count.max())
        if 2 * largest <= block_max.shape[-1]:
            candidates = top_groups(scores, block_max, largest)
        else:
            candidates = Candidates(scores, None, None, rows_count, length)
        chosen = min(largest, candidates.values.shape[-1])
        top_values, top_slots = candidates.values.topk(chosen, dim=-1)
        kept = (torch.arange(chosen, device=x.device) < count) & (top_values > -math.inf) & ~bad
        # Shifting by the row maximum first keeps float32 logits exact for large offsets.
        logits = (top_values - top_values[:, :1]) * _per_row(scale, x.shape, rows_count)
        weights = masked_softmax(logits, kept)
        if out is None:
            out = scores
        out.zero_()
        out.scatter_add_(1, candidates.columns(top_slots), weights)  # 0 where not kept
        return save_output(ctx, out.view(x.shape), bad.view(x.shape[:-1]), scale)

    @staticmethod
    def backward(ctx, grad: Tensor, _grad_bad: Tensor | None):
        # Softmax's backward: positions outside the top k have out = 0 and get 0.
        out, scale = saved_output(ctx)
        grad_logits = torch.ops.aten._softmax_backward_data(grad, out, -1, out.dtype)
        if not isinstance(scale, Tensor):
            return grad_logits * scale, None, None, None, None
        # sum_i grad_logits_i x_i = sum_i grad_logits_i log(out_i) / scale, since
        # scale * x_i = log(out_i) + const on the top k and the grad_logits sum to 0.
        log_weights = out.clamp_min(torch.finfo(out.dtype).tiny).log()
        per_row = (grad_logits * log_weights).sum(-1, keepdim=True) / scale
        return grad_logits * scale, None, None, sum_to_shape(per_row, scale.shape), None


def topk_support(
    x: Tensor, keep: Tensor | None, k: float, scale: float | Tensor, allowed_count: Tensor | None
) -> tuple[Tensor, Tensor]:
    """Softmax of ``scale * x`` over the k largest allowed scores of each row, 0 elsewhere.

    Args:
        x: scores ``(..., L)``, float32 or float64, on the CPU.
        keep: bool tensor broadcastable to ``x`` (True = may attend) or None.
        k: an int >= 1, or a fraction in (0, 1) of each row's allowed positions.
        scale: ``1 / temperature``: a python float or a positive ``(..., 1)`` tensor.
        allowed_count: ``(..., 1)`` number of allowed finite scores per row; needed
            for a fractional ``k`` (None for an int ``k``: rows with fewer finite
            scores keep all of them).

    Returns:
        ``(weights, bad)`` as for :func:`entmax_support`.
    """
    return _TopKSoftmax.apply(x, keep, k, scale, allowed_count)
