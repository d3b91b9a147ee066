"""The shared row rules of :mod:`attnorm.kernels.rules` as differentiable torch, written once.

Every reference function first turns ``(x, mask)`` into :class:`Rows`: which positions
take part, scores that are finite wherever they are used, and the special rows.  All of
it is branch-free (no host synchronisation), so ``torch.func.vmap`` and
``torch.compile(fullgraph=True)`` see one graph.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from attnorm.kernels import rules

__all__ = [
    "Rows", "as_param", "cap_slope", "capped", "finish", "masked_softmax", "per_row", "row_extremes", "rows_of",
    "shifted_scaled",
]


class Rows(NamedTuple):
    """Scores of a row operation after the shared rules.

    Attributes:
        allowed: bool like ``x``: the mask allows the position and the score is not -inf.
        active: bool like ``x``: the positions the weights live on (the +inf positions
            in rows holding +inf, else ``allowed``).
        scores: ``x`` where active and finite, 0 elsewhere (gradients reach ``x`` only there).
        posinf_row: bool ``(..., 1)``: the row holds +inf at an allowed position.
        nan_row: bool ``(..., 1)``: the row holds NaN at an allowed position.
        any_active: bool ``(..., 1)``: the row has an active position.
        raw: ``x`` as given (only :func:`finish` reads it, for the gradients of rows holding NaN).
    """

    allowed: Tensor
    active: Tensor
    scores: Tensor
    posinf_row: Tensor
    nan_row: Tensor
    any_active: Tensor
    raw: Tensor


def rows_of(x: Tensor, mask: rules.RowMask) -> Rows:
    """Apply the mask, the -inf / +inf / NaN rules, and zero the unused scores."""
    allowed = rules.allowed(x, mask).expand(x.shape)
    posinf = allowed & (x == math.inf)
    posinf_row = posinf.any(-1, keepdim=True)
    active = torch.where(posinf_row, posinf, allowed)
    nan_row = (allowed & x.isnan()).any(-1, keepdim=True)
    scores = torch.where(active & x.isfinite(), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return Rows(allowed, active, scores, posinf_row, nan_row, active.any(-1, keepdim=True), x)


def finish(out: Tensor, rows: Rows) -> Tensor:
    """Rows holding NaN at an allowed position become NaN, and so do their gradients (as torch.softmax's).

    ``out`` times a per-row factor: 1, or in those rows ``sum(c x)`` with ``c`` a constant
    NaN, whose value is NaN and whose derivative is NaN at every position (masked ones too,
    as the kernels' weights there are NaN) and, through ``out``, every parameter.
    ``c`` is 0 in the other rows, so nothing leaks there.  A ``torch.where`` would give
    those rows gradient 0.
    """
    nan = torch.full((), math.nan, dtype=out.dtype, device=out.device)
    zero, one = torch.zeros((), dtype=out.dtype, device=out.device), torch.ones((), dtype=out.dtype, device=out.device)
    coefficient = torch.where(rows.nan_row, nan, zero)
    poisoned = (rows.raw.to(out.dtype) * coefficient).sum(-1, keepdim=True)
    return out * torch.where(rows.nan_row, poisoned, one)


def as_param(value: float | Tensor, x: Tensor) -> float | Tensor:
    """A per-row parameter in ``x``'s dtype: python numbers stay numbers, tensors ``(..., 1)`` are cast."""
    return value.to(x.dtype) if isinstance(value, Tensor) else float(value)


def per_row(value: float | Tensor, like: Tensor, dtype: torch.dtype) -> Tensor:
    """A ``(..., 1)`` value (number or tensor) as a per-row tensor of shape ``like.shape[:-1]`` in ``dtype``."""
    column = torch.zeros(like.shape[:-1] + (1,), dtype=dtype, device=like.device) + value
    return column.squeeze(-1)


def row_extremes(scores: Tensor, rows: Rows) -> tuple[Tensor, Tensor]:
    """Largest and smallest active score per row ``(..., 1)``, 0 in rows with none (no gradient)."""
    scores = scores.detach()
    zero = torch.zeros((), dtype=scores.dtype, device=scores.device)
    top = torch.where(rows.active, scores, -math.inf).amax(-1, keepdim=True)
    bottom = torch.where(rows.active, scores, math.inf).amin(-1, keepdim=True)
    return torch.where(rows.any_active, top, zero), torch.where(rows.any_active, bottom, zero)


def shifted_scaled(rows: Rows, multiplier: float | Tensor) -> Tensor:
    """``m (x - max x)`` where ``m >= 0``, ``m (x - min x)`` where ``m < 0``: never +inf, no NaN from finite input.

    The shift is detached: every map using it is shift-invariant, so gradients are exact.
    The difference is clamped to the dtype's range so ``0 * difference`` stays 0.
    """
    top, bottom = row_extremes(rows.scores, rows)
    if isinstance(multiplier, Tensor):
        shift = torch.where(multiplier >= 0, top, bottom)
    else:
        shift = top if multiplier >= 0 else bottom
    largest = torch.finfo(rows.scores.dtype).max
    return multiplier * (rows.scores - shift).clamp(-largest, largest)


def masked_softmax(z: Tensor, rows: Rows, keep: Tensor | None = None) -> Tensor:
    """Softmax of ``z`` over the active (and ``keep``) positions; exact zeros elsewhere and in empty rows."""
    keep = rows.active if keep is None else keep & rows.active
    any_kept = keep.any(-1, keepdim=True)
    z = torch.where(keep, z, -math.inf)
    z = torch.where(any_kept, z, torch.zeros((), dtype=z.dtype, device=z.device))
    return torch.where(keep, torch.softmax(z, dim=-1), torch.zeros((), dtype=z.dtype, device=z.device))


def capped(x: Tensor, cap: float) -> Tensor:
    """Soft-capped scores ``cap tanh(x / cap)`` (Gemma 2); -inf stays -inf (not allowed), +inf becomes ``cap``."""
    return torch.where(x == -math.inf, x, cap * torch.tanh(x / cap))


def cap_slope(x: Tensor, cap: float) -> Tensor:
    """``d capped / dx = 1 - tanh(x / cap)^2``; 0 at infinite scores."""
    return torch.where(x.isfinite(), 1 - torch.tanh(x / cap).square(), 0.0)
