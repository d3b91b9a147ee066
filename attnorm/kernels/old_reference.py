"""Torch implementations of every row operation (the reference, and the CPU path).

Each function normalises over the last axis of ``x`` and follows the rules in
:mod:`attnorm.normalizers.base`.  :func:`sanitize` turns (scores, mask) into
finite scores plus an ``allowed`` mask once, so each normaliser is written only
for the allowed positions.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from attnorm.kernels.dispatch import register
from attnorm.kernels.sparse import entmax15_rows, entmax_bisect_rows, sparsemax_rows
from attnorm.masks import StructuredMask

__all__ = ["Rows", "masked_softmax", "sanitize", "topk_row_count"]


class Rows(NamedTuple):
    """Scores ready for a normaliser.

    Attributes:
        x: scores with masked positions (and +inf positions) set to 0; NaN kept.
        allowed: bool, True where the position takes part in the normalisation.
        posinf_rows: bool ``(..., 1)``, True for rows that held a +inf score, or None
            when no row did.  In those rows ``allowed`` marks the +inf positions only.
    """

    x: Tensor
    allowed: Tensor
    posinf_rows: Tensor | None


def sanitize(x: Tensor, mask: Tensor | StructuredMask | None) -> Rows:
    """Apply the shared mask rules: -inf is masked, +inf rows are uniform over +inf."""
    if isinstance(mask, StructuredMask):
        mask = mask.materialize(x.shape, x.device)
    allowed = x != -math.inf
    if mask is not None:
        allowed = allowed & mask
    allowed = allowed.expand(x.shape)
    posinf = (x == math.inf) & allowed
    posinf_rows = None
    if bool(posinf.any()):
        posinf_rows = posinf.any(-1, keepdim=True)
        allowed = torch.where(posinf_rows, posinf, allowed)
    x = x.masked_fill(~allowed, 0.0)
    if posinf_rows is not None:
        x = x.masked_fill(posinf, 0.0)
    return Rows(x, allowed, posinf_rows)


def masked_softmax(z: Tensor, allowed: Tensor) -> Tensor:
    """Softmax over the allowed positions of each row; all-masked rows give zeros."""
    any_allowed = allowed.any(-1, keepdim=True)
    z = z.masked_fill(~allowed, -math.inf).masked_fill(~any_allowed, 0.0)
    return torch.softmax(z, dim=-1).masked_fill(~allowed, 0.0)


def allowed_count(allowed: Tensor, dtype: torch.dtype) -> Tensor:
    """Number of allowed positions per row, shape ``(..., 1)``."""
    return allowed.sum(-1, keepdim=True).to(dtype)


@register("torch", "softmax")
def softmax_rows(x: Tensor, mask, temperature: float | Tensor = 1.0) -> Tensor:
    rows = sanitize(x, mask)
    return masked_softmax(rows.x / temperature, rows.allowed)


def ssmax_scale(n: Tensor, s: float | Tensor, bias: float | Tensor) -> Tensor:
    """Scalable-Softmax's logit multiplier ``s * log(n) + bias`` (n clamped to >= 1)."""
    return s * torch.log(n.clamp_min(1)) + bias


@register("torch", "scalable_softmax")
def scalable_softmax_rows(x: Tensor, mask, s: float | Tensor = 0.43, bias: float | Tensor = 0.0) -> Tensor:
    rows = sanitize(x, mask)
    scale = ssmax_scale(allowed_count(rows.allowed, x.dtype), s, bias)
    return masked_softmax(rows.x * scale, rows.allowed)


@register("torch", "self_adjusted_softmax")
def self_adjusted_softmax_rows(x: Tensor, mask, normalized: bool = True) -> Tensor:
    rows = sanitize(x, mask)
    weights = masked_softmax(rows.x, rows.allowed)
    if normalized:
        low = rows.x.masked_fill(~rows.allowed, math.inf).amin(-1, keepdim=True).clamp_max(0)
        high = rows.x.masked_fill(~rows.allowed, -math.inf).amax(-1, keepdim=True).clamp_min(0)
        span = high - low
        positive = span > 0
        factor = torch.where(positive, (rows.x - low) / torch.where(positive, span, 1.0), 0.0)
    else:
        factor = rows.x
    out = factor * weights
    if rows.posinf_rows is not None:
        # The limit of x * softmax(x) as the top scores grow: the +inf positions
        # get factor 1 (normalized) or +inf (plain) and all the softmax mass.
        limit = weights if normalized else torch.where(rows.allowed, math.inf, 0.0).to(x.dtype)
        out = torch.where(rows.posinf_rows, limit, out)
    return out


@register("torch", "sparsemax")
def sparsemax_row_op(x: Tensor, mask) -> Tensor:
    rows = sanitize(x, mask)
    return sparsemax_rows(rows.x, rows.allowed)


@register("torch", "entmax")
def entmax_row_op(x: Tensor, mask, alpha: float | Tensor = 1.5) -> Tensor:
    rows = sanitize(x, mask)
    if not isinstance(alpha, Tensor):
        if alpha == 1:
            return masked_softmax(rows.x, rows.allowed)
        if alpha == 1.5:
            return entmax15_rows(rows.x, rows.allowed)
        if alpha == 2:
            return sparsemax_rows(rows.x, rows.allowed)
        return entmax_bisect_rows(rows.x, rows.allowed, alpha)
    is_softmax = alpha == 1
    if not bool(is_softmax.any()):
        return entmax_bisect_rows(rows.x, rows.allowed, alpha)
    safe_alpha = torch.where(is_softmax, 2.0, alpha)
    return torch.where(
        is_softmax,
        masked_softmax(rows.x, rows.allowed),
        entmax_bisect_rows(rows.x, rows.allowed, safe_alpha),
    )


def topk_row_count(k: float, n: Tensor) -> Tensor:
    """Positions kept per row: ``min(k, n)`` for an int k, ``max(1, ceil(k * n))`` for a fraction.

    ``n`` is the number of allowed positions (shape ``(..., 1)``, integer); rows with
    ``n = 0`` keep 0.  A tiny slack keeps ``ceil(0.06 * 100)`` at 6 despite rounding.
    """
    if isinstance(k, float):
        count = torch.ceil(n.to(torch.float64) * k - 1e-9).to(n.dtype).clamp_min(1)
    else:
        count = torch.full_like(n, k)
    return torch.minimum(count, n)


@register("torch", "topk_softmax")
def topk_softmax_rows(x: Tensor, mask, k: float = 1, temperature: float | Tensor = 1.0) -> Tensor:
    rows = sanitize(x, mask)
    allowed = rows.allowed
    if rows.posinf_rows is not None:
        # A fraction k counts every allowed position, as for large finite scores;
        # the kept ones are then the +inf positions.
        allowed = sanitize(x.masked_fill(x == math.inf, 0.0), mask).allowed
    count = topk_row_count(k, allowed.sum(-1, keepdim=True))
    largest = min(int(count.max()) if count.numel() else 0, x.shape[-1])
    if largest == 0:
        return torch.zeros_like(rows.x)
    order = rows.x.masked_fill(~rows.allowed, -math.inf).topk(largest, dim=-1).indices
    chosen = torch.arange(largest, device=x.device) < count
    keep = torch.zeros_like(rows.allowed).scatter(-1, order, chosen) & rows.allowed
    return masked_softmax(rows.x / temperature, keep)
