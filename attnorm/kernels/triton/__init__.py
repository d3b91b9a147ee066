"""Fused Triton kernels for every row operation: the ``triton`` backend of ``kernels/README.md``.

This package exports the seven functions of the backend contract; each is defined
next to its forward and backward kernels in its family's module.  They are plain
functions (no autograd, no host synchronisation) that :mod:`attnorm.kernels.ops`
registers as the CUDA kernels of its operators.  The kernels run on CUDA tensors, or on CPU
tensors under ``TRITON_INTERPRET=1``.  Importing this package raises ImportError
when triton is missing.

========================================== ======================
functions                                  module
========================================== ======================
softmax_forward, softmax_backward          :mod:`.softmax`
topk_forward (backward: softmax_backward)  :mod:`.topk`
entmax_forward, entmax_backward            :mod:`.entmax`
self_adjusted_forward, ..._backward        :mod:`.self_adjusted`
========================================== ======================

Every rule of :mod:`attnorm.kernels.rules` (masks, -inf/+inf, fully masked rows,
NaN) is applied inside the kernels, with no fallback to torch; so is a sink per row
(``sink=``: position ``L`` of each row, behind the constexpr ``HAS_SINK``).  A row of up to
:data:`.launch.SINGLE_BLOCK_MAX` elements is read once and written once; longer
rows are streamed in several passes (each kernel's docstring counts them and the
bytes moved).  Row layout, masks, parameters and block sizes: :mod:`.launch`;
device helpers shared by the kernels (mask rules, +inf rows, row scans): :mod:`.blocks`.
"""

from __future__ import annotations

from attnorm.kernels.triton.entmax import entmax_backward, entmax_forward
from attnorm.kernels.triton.self_adjusted import self_adjusted_backward, self_adjusted_forward
from attnorm.kernels.triton.softmax import softmax_backward, softmax_forward
from attnorm.kernels.triton.topk import topk_forward

__all__ = [
    "entmax_backward",
    "entmax_forward",
    "self_adjusted_backward",
    "self_adjusted_forward",
    "softmax_backward",
    "softmax_forward",
    "topk_forward",
]
