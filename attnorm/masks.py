"""Structured attention masks: causal, sliding-window, key-padding and document masks that
kernels apply without materialising an (Lq x Lk) boolean tensor.

Convention everywhere in attnorm (the ``scaled_dot_product_attention`` one):
True means "may attend".  A structured mask applies to scores shaped
``(B, ..., Lq, Lk)`` normalised over the last axis (the keys).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import _C, Tensor

from attnorm.kernels.rules import check_key_lengths
from attnorm.validation import values_readable

__all__ = ["StructuredMask", "causal_mask", "document_mask", "key_padding_mask", "sliding_window_mask"]


@dataclass(frozen=True)
class StructuredMask:
    """Causal, sliding-window, key-padding and document masks described by a few numbers.

    Every field restricts the keys of query row ``i`` (batch row ``b``) to an interval,
    so the combined mask allows the keys ``j`` in ``[key_start(b, i), key_stop(b, i))``
    (see :meth:`key_range`): kernels skip whole key blocks outside it, and the number of
    allowed keys (Scalable-Softmax's ``n``) is ``key_stop - key_start``.

    Attributes:
        causal_diagonal: when not None, query ``i`` may attend key ``j`` only if
            ``j - i <= causal_diagonal`` (``torch.tril``'s ``diagonal``).  ``0`` is the
            top-left aligned mask of ``scaled_dot_product_attention(is_causal=True)``;
            ``Lk - Lq`` is the bottom-right aligned mask used with a KV cache.
        key_lengths: when not None, an integer tensor of shape ``(B,)``: in batch row
            ``b`` only the first ``key_lengths[b]`` keys may be attended (right padding).
        window_diagonal: when not None, query ``i`` may attend key ``j`` only if
            ``j - i >= window_diagonal`` (the lower edge of a sliding window).
        cu_seqlens: when not None, an integer tensor ``(D + 1,)`` of document
            boundaries ``0 = c_0 <= c_1 <= ... <= c_D`` (flash-attn's convention for
            packed sequences), or ``(B, D + 1)`` with one packing per batch row: a
            position ``p`` with ``c_d <= p < c_{d+1}`` belongs to document ``d``, and
            queries attend keys of their own document only.
            Positions at or past ``c_D`` form one more document.  Queries and keys share
            positions, so scores must be square (``Lq = Lk``).
    """

    causal_diagonal: int | None = None
    key_lengths: Tensor | None = None
    window_diagonal: int | None = None
    cu_seqlens: Tensor | None = None

    def __and__(self, other: StructuredMask) -> StructuredMask:
        if not isinstance(other, StructuredMask):
            return NotImplemented
        lengths = _combine(self.key_lengths, other.key_lengths, torch.minimum)
        # Two packings intersect into the packing with the boundaries of both.
        bounds = _combine(self.cu_seqlens, other.cu_seqlens, _refine)
        return StructuredMask(
            _combine(self.causal_diagonal, other.causal_diagonal, min),
            lengths,
            _combine(self.window_diagonal, other.window_diagonal, max),
            bounds,
        )

    @property
    def row_fields_only(self) -> bool:
        """True when only ``causal_diagonal`` and ``key_lengths`` are set (what the row kernels take)."""
        return self.window_diagonal is None and self.cu_seqlens is None

    def key_range(
        self, batch: int, lq: int, lk: int, device: torch.device | str | None = None
    ) -> tuple[Tensor, Tensor]:
        """Allowed keys of each query row as an interval: int32 ``(start, stop)``, each ``(B | 1, Lq)``.

        Row ``(b, i)`` may attend keys ``start[b, i] <= j < stop[b, i]``; ``stop <= start``
        means none.  ``B`` is ``batch`` when ``key_lengths`` is set, else 1.
        """
        rows = torch.arange(lq, device=device)
        start = torch.zeros(lq, dtype=torch.int64, device=device)
        stop = torch.full((lq,), lk, dtype=torch.int64, device=device)
        if self.causal_diagonal is not None:
            stop = torch.minimum(stop, rows + self.causal_diagonal + 1)
        if self.window_diagonal is not None:
            start = torch.maximum(start, rows + self.window_diagonal)
        if self.cu_seqlens is not None:
            if lq != lk:
                raise ValueError(f"a document mask needs square scores (Lq = Lk), got Lq = {lq}, Lk = {lk}")
            bounds = self.cu_seqlens.to(device=device, dtype=torch.int64)
            bounds = bounds if bounds.ndim == 2 else bounds[None]  # (B | 1, D + 1)
            if bounds.shape[0] not in (1, batch):
                raise ValueError(f"cu_seqlens of shape (B, D + 1) needs B = {batch}, got {tuple(bounds.shape)}")
            rows = rows.repeat(bounds.shape[0], 1)  # fresh strides: searchsorted warns on an expanded (1, Lq)
            document = torch.searchsorted(bounds, rows, right=True)  # 1 + index of the last bound <= row
            edges = torch.cat([bounds, bounds.new_full((bounds.shape[0], 1), max(lk, 0))], dim=-1)
            start = torch.maximum(start, edges.gather(-1, document - 1))
            last = bounds.shape[-1]
            stop = torch.minimum(stop, torch.where(document < last, edges.gather(-1, document.clamp(max=last)), lk))
        rows_of = start.shape[0] if start.ndim == 2 else 1  # not reshape(-1, lq): ambiguous with no query rows
        start, stop = start.reshape(rows_of, lq), stop.reshape(rows_of, lq)
        if self.key_lengths is not None:
            lengths = self.key_lengths.to(device=device, dtype=torch.int64)
            if lengths.shape[0] not in (1, batch):
                raise ValueError(f"key_lengths must have shape (B,) with B = {batch}, got {tuple(lengths.shape)}")
            stop = torch.minimum(stop, lengths[:, None])
        stop = torch.maximum(stop, start)
        start = start.expand_as(stop)  # both (B | 1, Lq), so they share one batch stride
        return start.to(torch.int32).contiguous(), stop.to(torch.int32).contiguous()

    def materialize(self, shape: torch.Size, device: torch.device | str | None = None) -> Tensor:
        """The equivalent bool mask, broadcastable to scores of ``shape`` (..., Lq, Lk)."""
        if len(shape) < 2:
            raise ValueError(
                f"a structured mask needs scores with at least 2 dims (..., Lq, Lk), got shape {tuple(shape)}"
            )
        if self.key_lengths is not None:
            check_key_lengths(self.key_lengths, tuple(shape))
        lq, lk = shape[-2], shape[-1]
        start, stop = self.key_range(shape[0], lq, lk, device)  # (B | 1, Lq)
        keys = torch.arange(lk, device=device)
        allowed = (keys >= start[..., None]) & (keys < stop[..., None])  # (B | 1, Lq, Lk)
        if allowed.shape[0] == 1 and self.key_lengths is None:
            return allowed[0]
        return allowed.reshape(allowed.shape[0], *([1] * (len(shape) - 3)), lq, lk)


def _refine(a: Tensor, b: Tensor) -> Tensor:
    """Boundaries of both packings (per batch row when either is ``(B, D + 1)``); repeats are empty documents."""
    flat = a.ndim == b.ndim == 1
    a, b = (t if t.ndim == 2 else t[None] for t in (a, b.to(a)))
    rows = max(a.shape[0], b.shape[0])
    merged = torch.sort(torch.cat([a.expand(rows, -1), b.expand(rows, -1)], dim=-1), dim=-1).values
    return merged[0] if flat else merged


def _combine(a, b, both):
    """``both(a, b)`` when both are set, else whichever is."""
    if a is None:
        return b
    return a if b is None else both(a, b)


def causal_mask(diagonal: int = 0) -> StructuredMask:
    """Causal mask: query ``i`` attends keys ``j <= i + diagonal``."""
    if not isinstance(diagonal, int) or isinstance(diagonal, bool):
        raise TypeError(f"diagonal must be an int, got {diagonal!r}")
    return StructuredMask(causal_diagonal=diagonal)


def key_padding_mask(lengths: Tensor) -> StructuredMask:
    """Key-padding mask: batch row ``b`` attends only its first ``lengths[b]`` keys."""
    if not isinstance(lengths, Tensor):  # as_tensor of a tensor is a no-op that jit.trace warns about
        lengths = torch.as_tensor(lengths)
    if lengths.dtype.is_floating_point or lengths.dtype == torch.bool or lengths.ndim != 1:
        raise TypeError(
            f"lengths must be a 1-D integer tensor, got dtype {lengths.dtype} and shape {tuple(lengths.shape)}"
        )
    # The values are checked where reading them is free and allowed (validation.values_readable: not while
    # jit.trace records, which would warn that the trace may not generalise).
    if values_readable(lengths) and bool((lengths < 0).any()):
        raise ValueError(f"lengths must be >= 0, got {lengths.tolist()}")
    return StructuredMask(key_lengths=lengths)


def sliding_window_mask(window: int, diagonal: int = 0) -> StructuredMask:
    """Causal sliding window: query ``i`` attends the ``window`` keys ``i + diagonal - window < j <= i + diagonal``.

    The local layers of Mistral, Gemma 2 and gpt-oss (``window`` = their ``sliding_window``).
    ``diagonal`` aligns it as :func:`causal_mask` does (``Lk - Lq`` with a KV cache).
    """
    for name, value in (("window", window), ("diagonal", diagonal)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name} must be an int, got {value!r}")
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    return StructuredMask(causal_diagonal=diagonal, window_diagonal=diagonal - window + 1)


def document_mask(cu_seqlens: Tensor) -> StructuredMask:
    """Packed sequences: each query attends only keys of its own document.

    Args:
        cu_seqlens: cumulative document lengths ``(D + 1,)``, ``[0, len_0, len_0 + len_1, ...]``
            (flash-attn's ``cu_seqlens``), or ``(B, D + 1)`` for a different packing per batch
            row (pad a row's boundaries with repeats of its last one: empty documents).
            Combine with :func:`causal_mask` by ``&`` for causal packed training;
            Scalable-Softmax's ``n`` then counts each document's keys.
    """
    if not isinstance(cu_seqlens, Tensor):  # as_tensor of a tensor is a no-op that jit.trace warns about
        cu_seqlens = torch.as_tensor(cu_seqlens)
    if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype == torch.bool or cu_seqlens.ndim not in (1, 2):
        raise TypeError(
            "cu_seqlens must be an integer tensor (D + 1,) or (B, D + 1), "
            f"got dtype {cu_seqlens.dtype} and shape {tuple(cu_seqlens.shape)}"
        )
    # Checked where key_padding_mask checks its lengths (values_readable), and not while jit.trace records
    # (a traced size is a tensor there, and the trace would warn it may not generalise).
    if _C._get_tracing_state():
        return StructuredMask(cu_seqlens=cu_seqlens)
    if cu_seqlens.shape[-1] < 1:
        raise ValueError("cu_seqlens must hold at least one boundary (0)")
    if values_readable(cu_seqlens):
        for values in cu_seqlens.reshape(-1, cu_seqlens.shape[-1]).tolist():
            if values[0] != 0 or any(b < a for a, b in zip(values, values[1:], strict=False)):
                raise ValueError(f"cu_seqlens must start at 0 and never decrease, got {values}")
    return StructuredMask(cu_seqlens=cu_seqlens)
