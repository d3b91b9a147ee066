"""Fused route: flash-style Triton attention kernels for the normalizers that have them."""

from __future__ import annotations

from torch import Tensor

__all__ = ["attention", "supports"]


def supports(normalizer, q: Tensor, k: Tensor, v: Tensor, dropout_p: float) -> bool:
    """True when a fused kernel computes ``normalizer``'s attention for these inputs."""
    return False


def attention(normalizer, q: Tensor, k: Tensor, v: Tensor, mask, additive: Tensor | None, scale: float) -> Tensor:
    raise NotImplementedError
