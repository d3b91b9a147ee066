"""Scalable-Softmax (SSMax): softmax with a logit multiplier that grows like log n."""

from __future__ import annotations

import torch
from torch import nn

from attnorm import validation as V
from attnorm.normalizers.base import Normalizer
from attnorm.normalizers.registry import register_normalizer


def head_shape(num_heads: int | None) -> tuple[int, ...]:
    """Shape of a per-head parameter broadcasting over scores ``(..., H, Lq, Lk)``."""
    if num_heads is None:
        return ()
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"num_heads must be an int >= 1 or None, got {num_heads!r}")
    return (num_heads, 1, 1)


class ScalableSoftmax(Normalizer):
    """``softmax((s * log n + bias) * x)`` with n the number of allowed positions per row.

    Nakanishi (2025, arXiv 2501.19399).  Under a causal mask query ``i`` uses
    ``n = i + 1``; padded keys do not count.  Keeps a needle logit's weight
    bounded away from 0 as the context grows when ``s * gap >= 1``.

    Args:
        s: scaling parameter (finite).
        bias: added to the multiplier.
        learnable: make ``s`` and ``bias`` trainable ``nn.Parameter`` s.
        num_heads: one ``s`` (and ``bias``) per head, broadcast over scores
            ``(..., H, Lq, Lk)``.
        dim: axis to normalise over.
        backend: ``"auto"``, ``"reference"``, ``"native"``, ``"triton"`` (``"torch"``: alias) or None.
    """

    kernel = "scalable_softmax"

    def __init__(
        self,
        s: float = 0.43,
        bias: float = 0.0,
        learnable: bool = False,
        num_heads: int | None = None,
        dim: int = -1,
        backend: str | None = None,
    ) -> None:
        super().__init__(dim, backend)
        V.check_finite("s", s)
        V.check_finite("bias", bias)
        self.learnable = learnable
        self.num_heads = num_heads
        shape = head_shape(num_heads)
        if learnable:
            self.s = nn.Parameter(torch.full(shape, float(s)))
            self.bias = nn.Parameter(torch.full(shape, float(bias)))
        elif shape:
            self.register_buffer("s", torch.full(shape, float(s)))
            self.register_buffer("bias", torch.full(shape, float(bias)))
        else:
            self.s, self.bias = float(s), float(bias)

    def __setattr__(self, name: str, value) -> None:
        if name in ("s", "bias"):
            V.check_finite(name, value)  # a tensor's values too, where they can be read without a sync
            if not isinstance(value, torch.Tensor):
                value = float(value)
        super().__setattr__(name, value)

    def kernel_params(self) -> dict:
        return {"s": self.s, "bias": self.bias}

    def check_state(self, state: dict[str, torch.Tensor]) -> None:
        for name, value in state.items():
            V.check_finite(name, value)

    def _repr_fields(self) -> dict:
        fields: dict = {"s": self.s, "bias": self.bias, "learnable": self.learnable}
        if self.num_heads is not None:
            fields["num_heads"] = self.num_heads
        return fields


register_normalizer("ssmax", ScalableSoftmax, ("scalable_softmax", "scalable-softmax"))
