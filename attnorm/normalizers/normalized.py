"""Any ``F(x) / sum F(x)`` normalizer, its named instances, softmax_1 and sigmoid attention.

Mudarisov et al. (arXiv 2508.17821) state Lemma 1 and Lemma 2 for every normalisation
``a = F(x) / sum F(x)`` with ``F >= 0`` elementwise; :class:`Normalized` builds one from any
``F``.  The named maps compute ``log F`` instead (:mod:`attnorm.kernels.reference.ratio`),
so extreme scores neither overflow nor underflow.  These run in pure torch on every device
(no native or Triton kernels): the row math is a handful of elementwise ops and one reduction.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import Tensor

from attnorm import validation as V
from attnorm.kernels.reference import ratio
from attnorm.kernels.rules import RowMask
from attnorm.masks import StructuredMask
from attnorm.normalizers import base
from attnorm.normalizers.base import Checked, Normalizer
from attnorm.normalizers.registry import register_normalizer

__all__ = [
    "Normalized",
    "ReLUNormalized",
    "RowFunctionNormalizer",
    "SigmoidAttention",
    "Softmax1",
    "SoftplusNormalized",
    "apply_rows",
]

RowFunction = Callable[[Tensor, RowMask], Tensor]


@V.quiet_shape_checks_while_tracing
def apply_rows(row_function: RowFunction, scores: Tensor, mask: Tensor | StructuredMask | None, dim: int) -> Tensor:
    """Apply a pure-torch row function along ``dim`` under the shared rules of :mod:`attnorm.normalizers.base`.

    The same checks, dim handling and dtype rule as :func:`attnorm.normalizers.base.normalize`,
    for row functions that are plain differentiable torch rather than ``torch.library`` ops.

    Args:
        row_function: ``f(x, row_mask)`` normalising the last axis of ``x``.
        scores: floating-point tensor of any shape.
        mask: bool tensor broadcastable to ``scores`` (True = may attend), a StructuredMask, or None.
        dim: the axis to normalise over.

    Returns:
        Weights with the shape and dtype of ``scores``.
    """
    base._check_scores(scores)
    mask = base._check_mask(mask, scores)
    dim = base._normalize_dim(dim, scores.ndim)
    if scores.numel() == 0:
        return scores.clone()
    squeeze = scores.ndim == 0
    x = scores.reshape(1) if squeeze else scores
    row_mask = base._row_mask(mask, x, dim)
    rows = x.movedim(dim, -1)
    if rows.dtype in (torch.float16, torch.bfloat16):
        rows = rows.float()
    out = row_function(rows, row_mask).to(x.dtype).movedim(-1, dim)
    return out.reshape(()) if squeeze else out


class RowFunctionNormalizer(Normalizer):
    """A normalizer whose rows are computed by :meth:`row_function` in pure torch (no kernel op).

    ``backend`` is accepted like every normalizer's, for one interface; these rows are the
    same few torch operations on every backend.
    """

    def row_function(self) -> RowFunction:
        raise NotImplementedError

    def forward(self, scores: Tensor, mask: Tensor | StructuredMask | None = None) -> Tensor:
        return apply_rows(self.row_function(), scores, mask, self.dim)


class Normalized(RowFunctionNormalizer):
    """``a_i = F(x_i) / sum_j F(x_j)`` over the allowed positions, for a user's elementwise ``F >= 0``.

    The general form of Mudarisov et al. (arXiv 2508.17821), Lemmas 1 and 2: with logits in
    ``[a, b]`` every weight lies in ``[min F / (L max F), max F / (L min F)]`` (min, max over
    ``[a, b]``), and the Jacobian is ``J = (diag(F'(x)) - a F'(x)^T) / sum F(x)``.

    A row whose ``F`` sums to 0 gives zeros; ``F = +inf`` at some allowed positions makes the
    row uniform over them.  ``F`` must be non-negative (not checked: reading values would
    synchronise the device); it is applied to allowed scores only.

    Args:
        f: ``F`` as a torch function of a tensor, e.g. ``lambda x: torch.relu(x) ** 3``.
        derivative: ``F'`` as a torch function, used in the backward pass; None differentiates
            ``f`` with autograd.
        dim: axis to normalise over.
        name: shown by ``repr``.

    Raises:
        TypeError: ``f`` or ``derivative`` not callable.
    """

    def __init__(
        self, f: Callable[[Tensor], Tensor], derivative: Callable[[Tensor], Tensor] | None = None, dim: int = -1,
        name: str | None = None, backend: str | None = None,
    ) -> None:
        super().__init__(dim, backend)
        if not callable(f):
            raise TypeError(f"f must be a callable F(x) -> tensor, got {type(f).__name__}")
        if derivative is not None and not callable(derivative):
            raise TypeError(f"derivative must be a callable F'(x) -> tensor or None, got {type(derivative).__name__}")
        self.f, self.derivative = f, derivative
        self.name = name or getattr(f, "__name__", "F")

    def row_function(self) -> RowFunction:
        return partial(ratio.ratio_of_values, f=self.f, derivative=self.derivative)

    def _repr_fields(self) -> dict[str, Any]:
        return {"f": self.name}


class _LogRatio(RowFunctionNormalizer):
    """``F / sum F`` from a stable ``log F`` (:func:`attnorm.kernels.reference.ratio.ratio_of_logs`)."""

    sink: float | None = None

    def log_f(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def row_function(self) -> RowFunction:
        return partial(ratio.ratio_of_logs, log_f=self.log_f, sink=self.sink)


def _check_power(power: float) -> float:
    V.check_finite("power", power)
    if isinstance(power, Tensor) or power <= 0:
        raise ValueError(f"power must be a number > 0, got {power!r}")
    return float(power)


class ReLUNormalized(_LogRatio):
    """``a_i = max(x_i, 0)^p / sum_j max(x_j, 0)^p`` (``relu``: p = 1, ``relu2``: p = 2).

    Sparse: non-positive scores get exactly 0; a row with no positive allowed score gives
    zeros.  Homogeneous of degree ``p``: ``a(x / T) = a(x)``, so a temperature changes nothing,
    while the Jacobian scales like ``1 / T`` (``J = p (diag(x_+^{p-1}) - a (x_+^{p-1})^T) / sum x_+^p``).

    Args:
        power: p > 0.
        dim: axis to normalise over.
    """

    sums_to_one = False  # rows with no positive allowed score give zeros
    sparse = True
    power = Checked(_check_power)

    def __init__(self, power: float = 1.0, dim: int = -1, backend: str | None = None) -> None:
        super().__init__(dim, backend)
        self.power = power

    def log_f(self, x: Tensor) -> Tensor:
        return ratio.log_relu_power(self.power)(x)

    def _repr_fields(self) -> dict[str, Any]:
        return {"power": self.power}


class SoftplusNormalized(_LogRatio):
    """``a_i = softplus(x_i) / sum_j softplus(x_j)``, ``softplus(x) = log(1 + e^x)``.

    Behaves like softmax for very negative scores (``softplus(x) ~ e^x``) and like relu for
    large ones (``softplus(x) ~ x``), so its weights are not shift-invariant.
    """

    def log_f(self, x: Tensor) -> Tensor:
        return ratio.log_softplus(x)


class Softmax1(_LogRatio):
    """softmax_1: ``a_i = e^{x_i} / (1 + sum_j e^{x_j})`` (Miller, "Attention is off by one", 2023).

    The same as softmax with an extra sink key of logit 0 whose weight is dropped, so a row
    may put (almost) no weight anywhere; rows sum to less than 1.  Computed as
    ``e^{x_i - m} / (e^{-m} + sum_j e^{x_j - m})`` with ``m = max(0, max x)``: stable for any x.
    """

    sums_to_one = False
    sink = 0.0

    def log_f(self, x: Tensor) -> Tensor:
        return x


class SigmoidAttention(RowFunctionNormalizer):
    """Sigmoid attention (Ramapuram et al., 2024, arXiv 2409.04431): ``a_i = sigmoid(x_i - log n)``.

    ``n`` is the number of allowed keys of the row (so under a causal mask query ``i`` uses
    ``n = i + 1``); a fixed ``bias`` replaces ``-log n`` when given.  Elementwise and not
    normalised: weights lie in (0, 1), a +inf score gets weight 1, and the row sum is free.

    Args:
        bias: a finite number, or None for ``-log n``.
        dim: axis to normalise over.
    """

    sums_to_one = False

    def __init__(self, bias: float | None = None, dim: int = -1, backend: str | None = None) -> None:
        super().__init__(dim, backend)
        self.bias = None if bias is None else float(V.check_finite("bias", bias))

    def row_function(self) -> RowFunction:
        return partial(ratio.sigmoid_attention, bias=self.bias)

    def _repr_fields(self) -> dict[str, Any]:
        return {"bias": "-log n" if self.bias is None else self.bias}


register_normalizer("relu", partial(ReLUNormalized, power=1.0))
register_normalizer("relu2", partial(ReLUNormalized, power=2.0))
register_normalizer("softplus", SoftplusNormalized)
register_normalizer("sigmoid", SigmoidAttention)
register_normalizer("softmax1", Softmax1, aliases=("softmax_1",))
