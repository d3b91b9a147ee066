"""Structured attention masks: causal and key-padding masks that kernels can
apply without materialising an (Lq x Lk) boolean tensor.

Convention everywhere in attnorm (the ``scaled_dot_product_attention`` one):
True means "may attend".  A structured mask applies to scores shaped
``(B, ..., Lq, Lk)`` normalised over the last axis (the keys).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from attnorm.kernels.rules import check_key_lengths

__all__ = ["StructuredMask", "causal_mask", "key_padding_mask"]


@dataclass(frozen=True)
class StructuredMask:
    """A causal and/or key-padding mask described by a few numbers.

    Attributes:
        causal_diagonal: when not None, query ``i`` may attend key ``j`` only if
            ``j - i <= causal_diagonal`` (``torch.tril``'s ``diagonal``).  ``0`` is the
            top-left aligned mask of ``scaled_dot_product_attention(is_causal=True)``;
            ``Lk - Lq`` is the bottom-right aligned mask used with a KV cache.
        key_lengths: when not None, an integer tensor of shape ``(B,)``: in batch row
            ``b`` only the first ``key_lengths[b]`` keys may be attended (right padding).
    """

    causal_diagonal: int | None = None
    key_lengths: Tensor | None = None

    def __and__(self, other: StructuredMask) -> StructuredMask:
        if not isinstance(other, StructuredMask):
            return NotImplemented
        if self.causal_diagonal is not None and other.causal_diagonal is not None:
            diagonal = min(self.causal_diagonal, other.causal_diagonal)
        else:
            diagonal = self.causal_diagonal if self.causal_diagonal is not None else other.causal_diagonal
        lengths = self.key_lengths
        if other.key_lengths is not None:
            lengths = other.key_lengths if lengths is None else torch.minimum(lengths, other.key_lengths)
        return StructuredMask(diagonal, lengths)

    def materialize(self, shape: torch.Size, device: torch.device | str | None = None) -> Tensor:
        """The equivalent bool mask, broadcastable to scores of ``shape`` (..., Lq, Lk)."""
        if len(shape) < 2:
            raise ValueError(
                f"a structured mask needs scores with at least 2 dims (..., Lq, Lk), got shape {tuple(shape)}"
            )
        lq, lk = shape[-2], shape[-1]
        allowed = torch.ones(lq, lk, dtype=torch.bool, device=device)
        if self.causal_diagonal is not None:
            allowed = allowed.tril(self.causal_diagonal)
        if self.key_lengths is None:
            return allowed
        check_key_lengths(self.key_lengths, tuple(shape))
        lengths = self.key_lengths.to(device)
        keys = torch.arange(lk, device=device)
        padding = keys < lengths[:, None]  # (B, Lk)
        padding = padding.reshape(padding.shape[0], *([1] * (len(shape) - 2)), lk)
        return allowed & padding


def causal_mask(diagonal: int = 0) -> StructuredMask:
    """Causal mask: query ``i`` attends keys ``j <= i + diagonal``."""
    if not isinstance(diagonal, int) or isinstance(diagonal, bool):
        raise TypeError(f"diagonal must be an int, got {diagonal!r}")
    return StructuredMask(causal_diagonal=diagonal)


def key_padding_mask(lengths: Tensor) -> StructuredMask:
    """Key-padding mask: batch row ``b`` attends only its first ``lengths[b]`` keys."""
    lengths = torch.as_tensor(lengths)
    if lengths.dtype.is_floating_point or lengths.dtype == torch.bool or lengths.ndim != 1:
        raise TypeError(
            f"lengths must be a 1-D integer tensor, got dtype {lengths.dtype} and shape {tuple(lengths.shape)}"
        )
    # Reading a GPU tensor's values would synchronise the device: only CPU lengths are checked.
    if lengths.device.type == "cpu" and not torch.compiler.is_compiling() and bool((lengths < 0).any()):
        raise ValueError(f"lengths must be >= 0, got {lengths.tolist()}")
    return StructuredMask(key_lengths=lengths)
