"""Sparsemax, alpha-entmax and top-k softmax without sorting rows (the fast CPU path).

These normalizers keep few positions per row, so the work is arranged around the
candidates for the support:

1. one pass finds each row's maximum ``m``; it bounds the threshold from below
   (entmax's ``tau >= (alpha - 1) m - 1``; for top-k the smallest of ``k`` block
   maxima is at most the k-th largest score);
2. one pass marks the scores above that bound, and ``nonzero`` packs them into a
   small ``(rows, K)`` matrix, ``K`` the most candidates in any row;
3. the threshold is found on that matrix: Newton's method on the entmax threshold
   (exact in finitely many steps for sparsemax), ``torch.topk`` for top-k;
4. the output is a zero buffer with the surviving weights written in.

The backward finds the support again from the saved output (``out > 0``) and applies
the closed-form Jacobian there, so nothing but the output is saved.  Both passes
reuse their output buffer's memory for the bool masks, because on the CPU every
fresh large tensor costs a round of page faults.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor
from torch.autograd import Function

from attnorm.kernels.reference import masked_softmax, topk_row_count
from attnorm.kernels.sparse import sum_to_shape

__all__ = ["Candidates", "entmax_support", "pack_candidates", "topk_support"]

_BLOCKS = 8  # a row's maxima over 8 interleaved blocks give a tighter entmax bound


class Candidates(NamedTuple):
    """Per-row candidates for the support, packed to the left of a small matrix.

    Attributes:
        values: ``(R, K)`` candidate scores, -inf after each row's last candidate;
            the whole score matrix when packing would not pay (``flat`` is None then).
        flat: ``(N,)`` flat index ``row * L + column`` of each candidate, or None.
        rows: ``(N,)`` row of each candidate, or None.
        slots: ``(N,)`` column of each candidate in ``values``, or None.
    """

    values: Tensor
    flat: Tensor | None
    rows: Tensor | None
    slots: Tensor | None

    def flat_index(self, slots: Tensor) -> Tensor:
        """Flat index into the ``(R, L)`` scores of the entries ``values.gather(1, slots)``."""
        rows, width = self.values.shape
        if self.flat is None:
            return slots + torch.arange(rows, device=slots.device).unsqueeze(1) * width
        index = torch.full_like(self.values, -1, dtype=torch.long)
        index[self.rows, self.slots] = self.flat
        return index.gather(1, slots)

    def scatter(self, weights: Tensor, out: Tensor) -> Tensor:
        """Write ``weights`` (shaped like ``values``) into the 2-D ``out``; zeros elsewhere."""
        if self.flat is None:
            return out.copy_(weights)
        out.zero_()
        out.view(-1)[self.flat] = weights[self.rows, self.slots]
        return out


def bool_view(buffer: Tensor) -> Tensor:
    """A contiguous bool tensor shaped like ``buffer``, living in ``buffer``'s memory."""
    return buffer.view(-1).view(torch.uint8)[: buffer.numel()].view(torch.bool).view(buffer.shape)


def pack_candidates(scores: Tensor, threshold: Tensor, inclusive: bool, above: Tensor) -> Candidates:
    """Pack the entries of ``scores`` (R, L) above ``threshold`` (R, 1) row by row.

    Args:
        scores: contiguous ``(R, L)`` scores.
        threshold: ``(R, 1)`` per-row bound; +inf selects nothing.
        inclusive: keep scores equal to the threshold too.
        above: bool ``(R, L)`` scratch space for the comparison.
    """
    rows_count, length = scores.shape
    (torch.ge if inclusive else torch.gt)(scores, threshold, out=above)
    flat = above.view(-1).nonzero().squeeze(1)
    if 4 * flat.numel() > scores.numel():
        return Candidates(scores, None, None, None)
    rows = torch.div(flat, length, rounding_mode="floor")
    counts = torch.bincount(rows, minlength=rows_count)
    width = max(int(counts.max()), 1) if flat.numel() else 1
    slots = torch.arange(flat.numel(), device=scores.device) - (counts.cumsum(0) - counts)[rows]
    values = scores.new_full((rows_count, width), -math.inf)
    values[rows, slots] = scores.view(-1)[flat]
    return Candidates(values, flat, rows, slots)


def _power(base: Tensor, exponent: float | Tensor) -> Tensor:
    """``base ** exponent`` for ``base >= 0``, with 0 wherever ``base`` is 0."""
    if isinstance(exponent, float):
        if exponent == 1.0:
            return base
        if exponent == 2.0:
            return base * base
        if exponent == 0.5:
            return base.sqrt()
        if exponent == 0.0:
            return (base > 0).to(base.dtype)
    return torch.where(base > 0, base.pow(exponent), 0.0)


def _newton_step(values: Tensor, tau: Tensor, scale: float | Tensor, exponent: float | Tensor) -> tuple[Tensor, Tensor]:
    """Newton step on the threshold of ``sum_i (scale * (v_i - tau))_+^p = 1``, and the sum minus 1.

    For ``p >= 1`` the step is Newton's on ``||(scale * (v - tau))_+||_p - 1``, a convex
    decreasing function of ``tau``: from below, the iterates rise monotonically to the
    root, and one candidate, or sparsemax's settled support, is solved in one step.
    For ``p < 1`` it is Newton's on ``sum(...)^p - 1``, taken from above.
    """
    gap = ((values - tau) * scale).clamp_min_(0)
    slope_terms = _power(gap, exponent - 1)
    slope_sum = slope_terms.sum(-1, keepdim=True)  # sum gap^(p-1)
    mass = (slope_terms * gap).sum(-1, keepdim=True)  # sum gap^p
    norm = mass.pow(1 / exponent)
    norm_step = (norm - 1) * mass / (scale * norm * slope_sum)
    plain_step = (mass - 1) / (exponent * scale * slope_sum)
    if isinstance(exponent, float):
        step = norm_step if exponent >= 1 else plain_step
    else:
        step = torch.where(exponent >= 1, norm_step, plain_step)
    return torch.where(slope_sum > 0, step, 0.0), mass - 1


def entmax_threshold(
    values: Tensor,
    low: Tensor,
    high: Tensor,
    scale: float | Tensor,
    exponent: float | Tensor,
    max_steps: int,
    tolerance: float,
) -> Tensor:
    """Safeguarded Newton on the entmax threshold, bracketed by ``low <= tau <= high``.

    Starts from ``low`` where ``p >= 1`` and from ``high`` where ``p < 1`` (the sides
    the Newton iterates approach from); a step leaving the bracket is replaced by
    bisection.  Stops when every row's step is below ``tolerance * max(1, |tau|)``.
    """
    if isinstance(exponent, float):
        tau = low if exponent >= 1 else high
    else:
        tau = torch.where(exponent >= 1, low, high)
    for _ in range(max_steps):
        step, excess = _newton_step(values, tau, scale, exponent)
        low = torch.where(excess >= 0, torch.maximum(low, tau), low)
        high = torch.where(excess <= 0, torch.minimum(high, tau), high)
        proposal = tau + step
        outside = (proposal < low) | (proposal > high)
        proposal = torch.where(outside, (low + high) / 2, proposal)
        moved = (proposal - tau).abs()
        tau = proposal
        if bool((moved <= tolerance * tau.abs().clamp_min(1)).all()):
            break
    return tau


def _work_buffers(x: Tensor, keep: Tensor | None) -> tuple[Tensor, Tensor | None, Tensor]:
    """(scores (R, L) with masked positions at -inf, output buffer or None, bool scratch)."""
    length = x.shape[-1]
    if keep is None and x.is_contiguous():
        scores = x.view(-1, length)
        out = torch.empty_like(scores)
        return scores, out, bool_view(out)
    scores = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if keep is None:
        scores.copy_(x)
    else:
        torch.where(keep, x, torch.tensor(-math.inf, dtype=x.dtype), out=scores)
    scores = scores.view(-1, length)
    # The masked copy becomes the output once its candidates are packed.
    return scores, None, torch.empty(scores.shape, dtype=torch.bool, device=x.device)


def _per_row(value: float | Tensor, shape: torch.Size, rows: int) -> float | Tensor:
    if isinstance(value, Tensor):
        return value.expand(*shape[:-1], 1).reshape(rows, 1)
    return value


def _support(out: Tensor, grad: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Flat index, row, output and incoming gradient of each support entry, and a zeroed gradient buffer."""
    length = out.shape[-1]
    grad_x = torch.empty_like(out)
    support = bool_view(grad_x)
    torch.gt(out, 0, out=support)
    flat = support.view(-1).nonzero().squeeze(1)
    grad_x.zero_()
    rows = torch.div(flat, length, rounding_mode="floor")
    grad_values = grad.reshape(-1)[flat] if grad.is_contiguous() else grad[torch.unravel_index(flat, grad.shape)]
    return flat, rows, out.view(-1)[flat], grad_values, grad_x


def _row_sum(values: Tensor, rows: Tensor, count: int) -> Tensor:
    return values.new_zeros(count).index_add_(0, rows, values)


class _Entmax(Function):
    @staticmethod
    def forward(ctx, x: Tensor, keep: Tensor | None, alpha: float | Tensor) -> Tensor:
        length = x.shape[-1]
        rows_count = x.numel() // length
        scores, out, above = _work_buffers(x, keep)
        alpha_rows = _per_row(alpha, x.shape, rows_count)
        scale = alpha_rows - 1  # entmax works on scale * x; scale = 1 is sparsemax
        exponent = 1 / scale
        top = scores.amax(-1, keepdim=True)
        bad = ~torch.isfinite(top)
        # Thresholds are solved relative to the row maximum, where float32 resolves
        # them finely even for scores offset by thousands.
        top = top.masked_fill(bad, 0.0)
        low = -exponent * torch.ones_like(top)  # the top score alone has mass 1 at top - 1/(alpha-1)
        widest = float(exponent.max()) if isinstance(exponent, Tensor) else exponent
        if widest > 2:  # alpha < 1.5: that bound lets in many candidates
            low = _tighten(scores, top, low, scale, exponent)
        # A few ulps of slack keep the rounded absolute bound below the threshold.
        bound = top + low - 4 * torch.finfo(x.dtype).eps * top.abs()
        candidates = pack_candidates(scores, bound.masked_fill(bad, math.inf), False, above)
        values = candidates.values - top
        # Above the root: each of the n candidates has mass <= 1 / n there.
        finite = (values > -math.inf).sum(-1, keepdim=True).clamp_min(1).to(x.dtype)
        high = -finite.pow(-scale) / scale
        eps = torch.finfo(x.dtype).eps
        tau = entmax_threshold(values, low, high, scale, exponent, 100, 16 * eps)
        weights = _power(((values - tau) * scale).clamp_min_(0), exponent)
        weights = (weights / weights.sum(-1, keepdim=True)).masked_fill_(bad, 0.0)
        if out is None:
            out = scores if candidates.flat is not None else torch.empty_like(scores)
        candidates.scatter(weights, out)
        out = out.view(x.shape)
        ctx.save_for_backward(out, alpha if isinstance(alpha, Tensor) else None)
        ctx.alpha = alpha if not isinstance(alpha, Tensor) else None
        bad = bad.view(x.shape[:-1])
        ctx.mark_non_differentiable(bad)
        return out, bad

    @staticmethod
    def backward(ctx, grad: Tensor, _grad_bad: Tensor | None):
        out, alpha_tensor = ctx.saved_tensors
        rows_count = out.numel() // out.shape[-1]
        flat, rows, weights, grad_values, grad_x = _support(out, grad)
        alpha = ctx.alpha
        if alpha_tensor is not None:
            alpha = _per_row(alpha_tensor, out.shape, rows_count).reshape(-1)[rows]
        # Jacobian of entmax: diag(s) - s s^T / sum(s), s = out^(2 - alpha) on the support.
        slopes = _power(weights, 2 - alpha)
        slope_total = _row_sum(slopes, rows, rows_count)
        correction = (_row_sum(slopes * grad_values, rows, rows_count) / slope_total)[rows]
        grad_x.view(-1)[flat] = slopes * (grad_values - correction)
        grad_alpha = None
        if ctx.needs_input_grad[2]:
            # d out_i / d alpha = beta (S_i - s_i sum(S) / sum(s)), S_i = out_i (beta - log out_i),
            # beta = 1 / (alpha - 1)  (as in attnorm.kernels.sparse).
            beta = 1 / (alpha - 1)
            entropy_terms = weights * (beta - weights.log())
            ratio = (_row_sum(entropy_terms, rows, rows_count) / slope_total)[rows]
            d_out = beta * (entropy_terms - slopes * ratio)
            per_row = _row_sum(grad_values * d_out, rows, rows_count).view(*out.shape[:-1], 1)
            grad_alpha = sum_to_shape(per_row, alpha_tensor.shape)
        return grad_x, None, grad_alpha


def _tighten(scores: Tensor, top: Tensor, low: Tensor, scale: float | Tensor, exponent: float | Tensor) -> Tensor:
    """A higher lower bound on the entmax threshold (relative to ``top``), from block maxima.

    The threshold of the problem restricted to any subset of a row's scores is at
    most the row's threshold, and for ``p >= 1`` (convex) Newton iterates from below
    stay below it; the maxima of 8 interleaved blocks are a subset holding most of
    the support.  Rows with ``p < 1`` keep ``low``.
    """
    rows_count, length = scores.shape
    blocks = length // _BLOCKS
    if blocks < 2:
        return low
    block_max = scores[:, : blocks * _BLOCKS].view(rows_count, _BLOCKS, blocks).amax(1) - top
    subset_low = low
    for _ in range(3):
        subset_low = subset_low + _newton_step(block_max, subset_low, scale, exponent)[0]
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
        scores, out, above = _work_buffers(x, keep)
        bad = ~torch.isfinite(scores.amax(-1, keepdim=True))
        if allowed_count is None:
            count = torch.full((rows_count, 1), min(int(k), length), device=x.device)
        else:
            count = topk_row_count(k, allowed_count.expand(*x.shape[:-1], 1).reshape(rows_count, 1))
        largest = int(count.max())
        if 2 * largest <= length:
            # Every one of `largest` interleaved blocks holds a score >= its minimum
            # block maximum, so that minimum is at most the largest-th largest score.
            width = length // largest
            blocks = scores[:, : largest * width].view(rows_count, width, largest)
            threshold = blocks.amax(1).amin(-1, keepdim=True).masked_fill_(bad, math.inf)
            candidates = pack_candidates(scores, threshold, True, above)
        else:
            candidates = Candidates(scores, None, None, None)
        chosen = min(largest, candidates.values.shape[-1])
        top_values, top_slots = candidates.values.topk(chosen, dim=-1)
        kept = (torch.arange(chosen, device=x.device) < count) & (top_values > -math.inf) & ~bad
        # Shifting by the row maximum first keeps float32 logits exact for large offsets.
        logits = (top_values - top_values[:, :1]) * _per_row(scale, x.shape, rows_count)
        weights = masked_softmax(logits, kept)
        if out is None:
            out = scores
        out.zero_()
        out.view(-1)[candidates.flat_index(top_slots)[kept]] = weights[kept]
        out = out.view(x.shape)
        ctx.save_for_backward(out, scale if isinstance(scale, Tensor) else None)
        ctx.scale = scale if not isinstance(scale, Tensor) else None
        bad = bad.view(x.shape[:-1])
        ctx.mark_non_differentiable(bad)
        return out, bad

    @staticmethod
    def backward(ctx, grad: Tensor, _grad_bad: Tensor | None):
        out, scale_tensor = ctx.saved_tensors
        rows_count = out.numel() // out.shape[-1]
        flat, rows, weights, grad_values, grad_x = _support(out, grad)
        scale = ctx.scale
        if scale_tensor is not None:
            scale = _per_row(scale_tensor, out.shape, rows_count).reshape(-1)[rows]
        grad_logits = weights * (grad_values - _row_sum(weights * grad_values, rows, rows_count)[rows])
        grad_x.view(-1)[flat] = grad_logits * scale
        grad_scale = None
        if ctx.needs_input_grad[3]:
            # sum_i grad_logits_i x_i = sum_i grad_logits_i log(out_i) / scale, since
            # scale * x_i = log(out_i) + const and the grad_logits sum to 0 per row.
            per_row = _row_sum(grad_logits * weights.log() / scale, rows, rows_count).view(*out.shape[:-1], 1)
            grad_scale = sum_to_shape(per_row, scale_tensor.shape)
        return grad_x, None, None, grad_scale, None


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
