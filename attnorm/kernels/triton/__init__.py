"""Fused Triton kernels for every row operation (``backend="triton"``).

Each op has a forward and a backward kernel and an autograd Function in its own
module; this file registers them with :func:`attnorm.kernels.dispatch.register`.
The kernels run on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1``.
Importing this package raises ImportError when triton is missing (the
dispatcher then falls back to torch).

====================== ====================== ===========================
op                     module                 autograd Function
====================== ====================== ===========================
softmax                :mod:`.softmax`        SoftmaxFunction
scalable_softmax       :mod:`.softmax`        ScalableSoftmaxFunction
self_adjusted_softmax  :mod:`.self_adjusted`  SelfAdjustedSoftmaxFunction
sparsemax, entmax      :mod:`.entmax`         EntmaxFunction
topk_softmax           :mod:`.topk`           TopKSoftmaxFunction
====================== ====================== ===========================

Every rule of :mod:`attnorm.normalizers.base` (masks, -inf/+inf, fully masked
rows, NaN) is applied inside the kernels, with no fallback to torch.  A row of up
to :data:`.launch.SINGLE_BLOCK_MAX` elements is read once and written once; longer
rows are streamed in several passes.  Row layout, masks, parameters and block
sizes: :mod:`.launch`; device helpers shared by the kernels (mask rules, +inf
rows, row scans): :mod:`.blocks`; bytes each kernel moves: :mod:`attnorm.kernels.traffic`.
"""

from __future__ import annotations

import triton  # noqa: F401  (ImportError here tells the dispatcher Triton is unavailable)
from torch import Tensor

from attnorm.kernels.dispatch import register
from attnorm.kernels.triton.entmax import EntmaxFunction
from attnorm.kernels.triton.self_adjusted import SelfAdjustedSoftmaxFunction
from attnorm.kernels.triton.softmax import ScalableSoftmaxFunction, SoftmaxFunction
from attnorm.kernels.triton.topk import TopKSoftmaxFunction

__all__ = [
    "entmax_rows",
    "scalable_softmax_rows",
    "self_adjusted_softmax_rows",
    "softmax_rows",
    "sparsemax_rows",
    "topk_softmax_rows",
]


@register("triton", "softmax")
def softmax_rows(x: Tensor, mask, temperature: float | Tensor = 1.0) -> Tensor:
    return SoftmaxFunction.apply(x, mask, temperature)


@register("triton", "scalable_softmax")
def scalable_softmax_rows(x: Tensor, mask, s: float | Tensor = 0.43, bias: float | Tensor = 0.0) -> Tensor:
    return ScalableSoftmaxFunction.apply(x, mask, s, bias)


@register("triton", "self_adjusted_softmax")
def self_adjusted_softmax_rows(x: Tensor, mask, normalized: bool = True) -> Tensor:
    return SelfAdjustedSoftmaxFunction.apply(x, mask, normalized)


@register("triton", "sparsemax")
def sparsemax_rows(x: Tensor, mask) -> Tensor:
    return EntmaxFunction.apply(x, mask, 2.0)


@register("triton", "entmax")
def entmax_rows(x: Tensor, mask, alpha: float | Tensor = 1.5) -> Tensor:
    return EntmaxFunction.apply(x, mask, alpha)


@register("triton", "topk_softmax")
def topk_softmax_rows(x: Tensor, mask, k: int | float = 1, temperature: float | Tensor = 1.0) -> Tensor:
    return TopKSoftmaxFunction.apply(x, mask, k, temperature)


for _row_op in (
    softmax_rows,
    scalable_softmax_rows,
    self_adjusted_softmax_rows,
    sparsemax_rows,
    entmax_rows,
    topk_softmax_rows,
):
    _row_op.reads_half_precision = True  # normalize() hands fp16/bf16 scores over without an fp32 copy
