"""Masks as the attention routes take them: allowed counts, empty rows, kernel masks, SDPA masks.

A user's mask arrives split by :func:`attnorm.attention` into a bool tensor or a
:class:`~attnorm.masks.StructuredMask` (``mask``) and a float tensor added to the
scores (``additive``).  Scores are ``(..., Hq, Lq, Lk)``; a StructuredMask's batch dim
is ``q``'s first dim.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from attnorm.kernels.rules import AttentionMask
from attnorm.masks import StructuredMask

__all__ = ["allowed_counts", "interval", "interval_rows", "kernel_mask", "row_attends"]

Mask = Tensor | StructuredMask | None

# A bool mask's allowed counts are summed this many bytes of int64 at a time (a
# whole-tensor sum would first copy the mask to int64).
_COUNT_BLOCK_BYTES = 1 << 20


def interval(mask: StructuredMask, q: Tensor, lk: int) -> tuple[Tensor, Tensor]:
    """The key interval ``[start, stop)`` of each row: int32 ``(B | 1, 1, ..., Lq, 1)``, broadcasting over scores."""
    batch = q.shape[0] if q.ndim >= 3 else 1
    if mask.key_lengths is not None and q.ndim < 3:
        raise ValueError(f"key_lengths need q shaped (B, ..., Lq, D) with a batch dim, got {tuple(q.shape)}")
    start, stop = mask.key_range(batch, q.shape[-2], lk, q.device)  # (B | 1, Lq)
    shape = (start.shape[0], *([1] * (q.ndim - 3)), q.shape[-2], 1) if q.ndim >= 3 else (q.shape[-2], 1)
    return start.reshape(shape), stop.reshape(shape)


def allowed_counts(mask: Mask, q: Tensor, lk: int) -> Tensor | None:
    """Allowed keys per query row, ``(..., Lq, 1)``; None when every row sees all ``lk`` keys."""
    if mask is None:
        return None
    if isinstance(mask, StructuredMask):
        start, stop = interval(mask, q, lk)
        return stop - start
    rows = max(1, _COUNT_BLOCK_BYTES // (8 * math.prod(mask.shape[:-2]) * mask.shape[-1])) if mask.ndim > 1 else 1
    if mask.ndim > 1 and mask.shape[-2] > rows:
        blocks = [mask[..., start : start + rows, :].sum(-1, keepdim=True) for start in range(0, mask.shape[-2], rows)]
        counts = torch.cat(blocks, dim=-2)
    else:  # one block (a decoding step's mask): no slice, no cat (two launches less)
        counts = mask.sum(-1, keepdim=True)
    # A mask broadcast over the keys (last dim 1) allows all lk keys of a row or none.
    return counts * lk if mask.shape[-1] == 1 and lk != 1 else counts


def row_attends(mask: Mask, additive: Tensor | None, q: Tensor, lk: int) -> Tensor | None:
    """Bool ``(..., Lq, 1)``: rows with at least one allowed key; None when every row has one for sure."""
    if additive is not None:
        return ~torch.isneginf(additive).all(-1, keepdim=True)
    if isinstance(mask, Tensor):
        return mask.any(-1, keepdim=True)
    if lk == 0:
        return torch.zeros((), dtype=torch.bool, device=q.device)  # no key at all
    if mask is None:
        return None
    plain_causal = mask.key_lengths is None and mask.row_fields_only
    if plain_causal and (mask.causal_diagonal is None or mask.causal_diagonal >= 0):
        return None
    return allowed_counts(mask, q, lk) > 0


def interval_rows(bounds: tuple[Tensor, Tensor], start: int, stop: int, lo: int, hi: int) -> Tensor:
    """Bool mask (True = may attend) of query rows ``start:stop`` and keys ``lo:hi`` from the rows' key intervals
    (:func:`interval`)."""
    first, last = (bound[..., start:stop, :] for bound in bounds)
    keys = torch.arange(lo, hi, device=first.device)
    return (keys >= first) & (keys < last)


def kernel_mask(mask: Mask, additive: Tensor | None, q: Tensor, lk: int) -> AttentionMask:
    """The mask as the fused kernels take it, for ``q`` shaped ``(B, Hq, Lq, D)``."""
    start = stop = dense = None
    if isinstance(mask, StructuredMask):
        start, stop = mask.key_range(q.shape[0], q.shape[-2], lk, q.device)
    elif mask is not None:
        dense = mask
    if additive is not None:
        additive = additive.to(q.device)
    return AttentionMask(start, stop, dense, additive)
