"""The shared rules every backend applies, written once.

A row operation normalises ``x`` over its last axis.  Which positions of a row take
part is decided by a :class:`RowMask` and by the scores themselves:

* a position is **allowed** when the mask allows it and its score is not -inf;
* a row with no allowed position gives zeros (and zero gradients);
* a row holding +inf at an allowed position is uniform over its +inf positions;
* a NaN at an allowed position makes the whole row NaN.

Per-row parameters (temperature, s, bias, alpha) are python numbers or tensors of
shape ``(..., 1)`` with ``x.ndim`` dims that broadcast against ``x``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = [
    "AttentionMask",
    "RowMask",
    "accumulation_dtype",
    "allowed",
    "attention_allowed",
    "allowed_count",
    "allowed_prefix",
    "check_key_lengths",
    "keeps_float_output",
    "mask_allows",
    "masked_scores",
    "ssmax_multiplier",
    "sum_to_shape",
    "topk_row_count",
]


class RowMask(NamedTuple):
    """Which keys a row may use, as the kernels take it.

    Attributes:
        tensor: bool tensor with ``x.ndim`` dims broadcastable to ``x`` (True = may
            attend), or None.
        diagonal: causal mask when not None: the row of query ``q`` (its index along
            ``x``'s dim -2) may use key ``j`` only if ``j <= q + diagonal``.
        key_lengths: int64 tensor of shape ``(B,)`` or ``(1,)``, or None: batch ``b``
            (``x``'s dim 0) may use only its first ``key_lengths[b]`` keys.
    """

    tensor: Tensor | None = None
    diagonal: int | None = None
    key_lengths: Tensor | None = None

    @property
    def structured(self) -> bool:
        return self.diagonal is not None or self.key_lengths is not None

    @property
    def unmasked(self) -> bool:
        """Every position a row holds may be used (no field set)."""
        return self.tensor is None and self.diagonal is None and self.key_lengths is None


NO_MASK = RowMask()


def broadcasts_to(shape: torch.Size | tuple[int, ...], target: torch.Size | tuple[int, ...]) -> bool:
    """Whether a tensor of ``shape`` broadcasts to ``target`` without growing it."""
    # Plain shape arithmetic in a loop: torch.broadcast_shapes costs tens of microseconds
    # per call, all(generator) or a zip over a slice of the target more than this.
    offset = len(target) - len(shape)
    if offset < 0:
        return False
    for axis, size in enumerate(shape):
        if size != 1 and size != target[offset + axis]:
            return False
    return True


def check_key_lengths(key_lengths: Tensor, shape: tuple[int, ...]) -> None:
    """Raise unless ``key_lengths`` fits scores of ``shape`` ``(B, ..., Lq, Lk)``."""
    if len(shape) < 3:
        raise ValueError(f"key_lengths needs scores shaped (B, ..., Lq, Lk) with a batch axis, got shape {shape}")
    if key_lengths.ndim != 1 or key_lengths.shape[0] not in (1, shape[0]):
        raise ValueError(
            f"key_lengths must have shape (B,) with B = scores.shape[0] = {shape[0]}, got {tuple(key_lengths.shape)}"
        )


def mask_allows(x: Tensor, mask: RowMask) -> Tensor | None:
    """The mask alone as a bool tensor broadcastable to ``x`` (True = may use), None when it allows everything.

    Kept in its own broadcast shape: a causal part is ``(Lq, Lk)``, key lengths ``(B, 1, ..., 1, Lk)``,
    so only the one operation that meets ``x`` runs over every score.
    """
    keep = mask.tensor
    if mask.structured:
        prefix = torch.arange(x.shape[-1], device=x.device) < _prefix_stops(x, mask)[..., None]
        keep = prefix if keep is None else keep & prefix
    return keep


def _prefix_stops(x: Tensor, mask: RowMask) -> Tensor:
    """How many leading positions each row may use under ``mask``'s ``diagonal`` and ``key_lengths``: row
    ``(b, ..., q)`` its first ``min(q + diagonal + 1, key_lengths[b])``, clamped to ``[0, L]``.  int64, in
    its own broadcast shape against ``x.shape[:-1]``: ``(Lq,)``, ``(B, 1, ..., 1)`` or both."""
    stop = torch.full((1,), x.shape[-1], dtype=torch.int64, device=x.device)
    if mask.diagonal is not None:
        stop = torch.arange(mask.diagonal + 1, mask.diagonal + 1 + x.shape[-2], device=x.device)  # (Lq,)
    if mask.key_lengths is not None:
        lengths = mask.key_lengths.to(device=x.device, dtype=torch.int64)
        stop = torch.minimum(stop, lengths.reshape(-1, *([1] * (x.ndim - 2))))
    return stop.clamp(0, x.shape[-1])


def allowed_prefix(x: Tensor, mask: RowMask) -> Tensor:
    """Each row's allowed positions under a mask of ``diagonal`` and ``key_lengths`` alone: a prefix.

    Row ``(b, ..., q)`` may use its first ``min(q + diagonal + 1, key_lengths[b])`` positions
    (clamped to ``[0, L]``); int64, contiguous, shape ``x.shape[:-1]``.
    """
    if mask.tensor is not None:
        raise ValueError("allowed_prefix takes a mask of diagonal and key_lengths only (a bool tensor is no prefix)")
    if mask.key_lengths is not None:
        check_key_lengths(mask.key_lengths, tuple(x.shape))
    return _prefix_stops(x, mask).expand(x.shape[:-1]).contiguous()


def allowed(x: Tensor, mask: RowMask) -> Tensor:
    """Bool tensor shaped like ``x``: True where the mask allows the position and ``x`` is not -inf."""
    keep = x != -math.inf
    allows = mask_allows(x, mask)
    return keep if allows is None else keep & allows


def masked_scores(x: Tensor, mask: RowMask) -> Tensor:
    """A contiguous copy of ``x`` with -inf wherever the mask forbids a position (``x`` itself when no mask).

    One pass over the scores (``where`` against the mask in its own broadcast shape); -inf scores
    stay -inf, so the scores' own -inf need no look.  Building the full-size ``allowed`` first
    took four more passes, 3-5x the native row kernel's own time under a causal mask (1024 x 1024 rows).
    """
    allows = mask_allows(x, mask)
    if allows is None:
        return x.contiguous()
    return torch.where(allows, x, x.new_full((), -math.inf)).contiguous()


def allowed_count(keep: Tensor) -> Tensor:
    """Allowed positions per row, int64 of shape ``(..., 1)``."""
    return keep.sum(-1, keepdim=True)


def topk_row_count(k: float, is_fraction: bool, n: Tensor) -> Tensor:
    """Positions top-k keeps per row: ``min(k, n)``, or ``max(1, ceil(k n))`` for a fraction (0 when ``n = 0``).

    ``n`` holds integer counts; a tiny slack keeps ``ceil(0.06 * 100)`` at 6 despite rounding.
    """
    if is_fraction:
        count = torch.ceil(n.to(torch.float64) * k - 1e-9).to(n.dtype).clamp_min(1)
    else:
        count = torch.full_like(n, int(k))
    return torch.minimum(count, n)


def ssmax_multiplier(n: Tensor, s: float | Tensor, bias: float | Tensor) -> Tensor:
    """Scalable-Softmax's logit multiplier ``s log max(n, 1) + bias`` for rows of ``n`` allowed positions."""
    return s * torch.log(n.clamp_min(1)) + bias


NEAR_SOFTMAX = 1.1
"""Below this entmax alpha (above 1) float32 rows are computed in float64: the weights
``[(alpha - 1) x - tau]_+^(1 / (alpha - 1))`` amplify float32's rounding by ``1 / (alpha - 1)``
(the reference for python and tensor alphas, as the native kernel does; the Triton row kernel
for python alphas; the fused attention kernels leave such alphas to the row kernels)."""


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """What kernels accumulate (and store per-row statistics) in: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def keeps_float_output(dtype: torch.dtype, wanted: bool) -> bool:
    """Whether a fused forward asked for its output in the accumulation dtype too (``float_out``) keeps it:
    for float16 / bfloat16 inputs, whose rounded output would round the backward's ``delta``."""
    return bool(wanted) and dtype in (torch.float16, torch.bfloat16)


def sum_to_shape(grad: Tensor, shape: torch.Size) -> Tensor:
    """Reduce a gradient broadcast over ``grad.shape`` back to ``shape``."""
    while grad.ndim > len(shape):
        grad = grad.sum(0)
    for axis, size in enumerate(shape):
        if size == 1 and grad.shape[axis] != 1:
            grad = grad.sum(axis, keepdim=True)
    return grad


class AttentionMask(NamedTuple):
    """Which keys each query may attend, as the attention kernels take it.

    Scores are ``(B, Hq, Lq, Lk)``; a key is allowed for row ``(b, h, i)`` when it lies
    in the row's interval, the dense mask allows it, and its score (after the
    additive mask) is not -inf.

    Attributes:
        key_start, key_stop: int32 ``(B | 1, Lq)``, or both None (every key): row
            ``(b, h, i)`` may attend keys ``key_start[b, i] <= j < key_stop[b, i]``.  The
            structured masks (causal, sliding window, key padding, documents) all
            reduce to this interval (:meth:`attnorm.masks.StructuredMask.key_range`);
            kernels skip key blocks outside it.
        dense: bool tensor broadcastable to ``(B, Hq, Lq, Lk)``, True = may attend, or None.
        additive: float tensor broadcastable to ``(B, Hq, Lq, Lk)`` added to the scaled
            scores (-inf = masked), or None.
    """

    key_start: Tensor | None = None
    key_stop: Tensor | None = None
    dense: Tensor | None = None
    additive: Tensor | None = None


def attention_allowed(mask: AttentionMask, shape: tuple[int, int, int, int], device) -> Tensor | None:
    """The mask's interval and dense parts as one bool tensor broadcastable to ``shape`` (None: all allowed).

    The additive part is not included (its -inf entries act through the scores).
    """
    keep = None
    if mask.key_start is not None:
        keys = torch.arange(shape[-1], device=device)
        start, stop = mask.key_start.to(device)[:, None, :, None], mask.key_stop.to(device)[:, None, :, None]
        keep = (keys >= start) & (keys < stop)  # (B | 1, 1, Lq, Lk)
    if mask.dense is not None:
        keep = mask.dense if keep is None else keep & mask.dense
    return keep
