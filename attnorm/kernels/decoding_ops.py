"""The decoding operators: split-K Self-Adjusted attention and the rows route's scores, forward only.

=================================== ========================================== ==============
op                                  outputs                                    backward
=================================== ========================================== ==============
``self_adjusted_decoding_fwd``      out ``(B, Hq, Lq, Dv)``                    raises
``decoding_scores_fwd``             scores ``(B, Hq, Lq, Lk)``, float32        raises
                                    (float64 for float64 inputs)
``ssmax_queries_fwd``               ``c q`` ``(B, H, Lq, D)`` and bool rows    raises
                                    attending any key ``(B, H, Lq, 1)``
=================================== ========================================== ==============

Defined in the ``attnorm`` namespace like :mod:`attnorm.kernels.attention_ops` (a fake
kernel gives the shape, so ``torch.compile`` and ``torch.export`` see it); their CPU and
CUDA kernels are :func:`attnorm.kernels.triton.attention_decoding.self_adjusted_decoding_forward`
and :func:`~attnorm.kernels.triton.attention_decoding.decoding_scores_forward`
(on CPU tensors under ``TRITON_INTERPRET=1``, otherwise a clear error).  Masks travel
as the four fields of :class:`~attnorm.kernels.rules.AttentionMask`.

Forward only: decoding is inference.  :func:`attnorm.routes.decoding.supports` never
takes the split-K op when an input requires grad (the materialised route runs, with its
gradients), nor does :func:`attnorm.routes.decoding.scores_kernel_applies` take the
scores op; called directly on such inputs, their backward raises instead of returning a
wrong or missing gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnorm.kernels import backends, inductor, ops
from attnorm.kernels.rules import AttentionMask, accumulation_dtype

__all__ = ["decoding_scores", "self_adjusted_decoding", "ssmax_queries"]

_LIBRARY = torch.library.Library("attnorm", "FRAGMENT")
_NAME = "self_adjusted_decoding_fwd"
_SCORES = "decoding_scores_fwd"

_LIBRARY.define(
    f"{_NAME}(Tensor q, Tensor k, Tensor v, Tensor? key_start, Tensor? key_stop, Tensor? dense, Tensor? additive, "
    "float scale, bool normalized, int splits) -> Tensor"
)


def _device_kernel(q, k, v, start, stop, dense, additive, scale, normalized, splits):
    backends.resolve("triton", q.device)  # a clear error when Triton cannot run these tensors
    from attnorm.kernels.triton.attention_decoding import self_adjusted_decoding_forward

    return self_adjusted_decoding_forward(q, k, v, AttentionMask(start, stop, dense, additive), scale, normalized,
                                          splits)


def _fake(q, k, v, *rest):
    return q.new_empty(*q.shape[:-1], v.shape[-1])


def _scores_kernel(q, k, scale):
    backends.resolve("triton", q.device)
    from attnorm.kernels.triton.attention_decoding import decoding_scores_forward

    return decoding_scores_forward(q, k, scale)


def _scores_fake(q, k, scale):
    return q.new_empty(*q.shape[:-1], k.shape[-2], dtype=accumulation_dtype(q.dtype))


def _forward_only(name):
    def backward(ctx, *grads):
        raise RuntimeError(
            f"attnorm::{name} is forward only (decoding); attnorm.attention takes another route when inputs require "
            "grad"
        )

    return backward


def _register(name, kernel, fake):
    """Op ``attnorm::name`` (already defined): ``kernel`` on CPU and CUDA, its fake, a raising backward."""
    _LIBRARY.impl(name, kernel, "CPU")
    _LIBRARY.impl(name, kernel, "CUDA")
    torch.library.register_fake(f"attnorm::{name}", fake, lib=_LIBRARY)
    torch.library.register_autograd(f"attnorm::{name}", _forward_only(name), lib=_LIBRARY)
    inductor.register(f"attnorm::{name}", kernel, _LIBRARY)
    ops.register_eager(getattr(torch.ops.attnorm, name).default, kernel)


_register(_NAME, _device_kernel, _fake)
_LIBRARY.define(f"{_SCORES}(Tensor q, Tensor k, float scale) -> Tensor")
_register(_SCORES, _scores_kernel, _scores_fake)
_SSMAX = "ssmax_queries_fwd"
_LIBRARY.define(f"{_SSMAX}(Tensor q, Tensor? mask, float s, Tensor? s_rows, float bias, Tensor? bias_rows, int lk) "
                "-> (Tensor, Tensor)")


def _ssmax_kernel(q, mask, s, s_rows, bias, bias_rows, lk):
    backends.resolve("triton", q.device)
    from attnorm.kernels.triton.attention_decoding import ssmax_queries_forward

    return ssmax_queries_forward(q, mask, s if s_rows is None else s_rows, bias if bias_rows is None else bias_rows,
                                 lk)


def _ssmax_fake(q, mask, *rest):
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(*q.shape[:-1], 1, dtype=torch.bool)


_register(_SSMAX, _ssmax_kernel, _ssmax_fake)


def self_adjusted_decoding(q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask, scale: float, normalized: bool,
                           splits: int = 0) -> Tensor:
    """Split-K Self-Adjusted Softmax attention (both variants) for few query rows; ``splits`` 0: automatic.

    Straight to the kernel in a plain eager call (:func:`attnorm.kernels.ops.call`) unless
    an input needs a gradient: the dispatcher then runs the autograd rule, which raises.
    """
    op = torch.ops.attnorm.self_adjusted_decoding_fwd.default
    if ops.records_grad(q, k, v):
        return op(q, k, v, *mask, scale, normalized, splits)
    return ops.call(op, q, k, v, *mask, scale, normalized, splits)


def decoding_scores(q: Tensor, k: Tensor, scale: float) -> Tensor:
    """``scale q k^T`` ``(B, Hq, Lq, Lk)`` in float32 (float64 for float64), GQA by shapes, K read once.

    The rows route's first step for half-precision decoding (no float32 copy of K); forward only.
    """
    op = torch.ops.attnorm.decoding_scores_fwd.default
    if ops.records_grad(q, k):
        return op(q, k, scale)
    return ops.call(op, q, k, scale)


def ssmax_queries(q: Tensor, mask: Tensor | None, s: float | Tensor, bias: float | Tensor, lk: int = -1
                  ) -> tuple[Tensor, Tensor]:
    """``(c q, attends)`` for Scalable-Softmax's SDPA call: ``c = s log n + bias`` per query row, ``n`` its allowed
    keys under a bool ``mask`` (or all ``lk`` keys without one)
    (:func:`~attnorm.kernels.triton.attention_decoding.ssmax_queries_forward`); forward only."""
    op = torch.ops.attnorm.ssmax_queries_fwd.default
    s_value, s_rows = (1.0, s) if isinstance(s, Tensor) else (float(s), None)
    bias_value, bias_rows = (0.0, bias) if isinstance(bias, Tensor) else (float(bias), None)
    args = (q, mask, s_value, s_rows, bias_value, bias_rows, lk)
    return op(*args) if ops.records_grad(q, s_rows, bias_rows) else ops.call(op, *args)
