"""Softmax of scaled, masked rows with one output buffer per pass (the torch-only CPU path).

``scaled_softmax(x, scale, keep)`` is ``softmax(scale * x)`` over the positions
``keep`` allows.  On the CPU a fresh 32 MB tensor costs more in page faults than
the arithmetic of a softmax, so the forward writes ``scale * x`` into the output
buffer and normalises it there, and the backward allocates only the gradient:
the same two allocations as ``torch.softmax`` and its backward.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.autograd import Function

from attnorm.kernels.sparse import sum_to_shape

__all__ = ["scaled_softmax", "self_adjusted_softmax"]


def _softmax_in_place(z: Tensor) -> Tensor:
    # ATen's CPU softmax reads each row before writing it, so it may write over
    # its input; tests/kernels/test_cpu.py checks the result against torch.softmax.
    return torch.ops.aten._softmax.out(z, -1, False, out=z)


class _ScaledSoftmax(Function):
    @staticmethod
    def forward(ctx, x: Tensor, scale: float | Tensor, keep: Tensor | None):
        if keep is None and isinstance(scale, float) and scale == 1.0 and x.is_contiguous():
            out = torch.softmax(x, dim=-1)
        else:
            out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
            torch.mul(x, scale, out=out)
            if keep is not None:
                torch.where(keep, out, torch.tensor(-math.inf, dtype=x.dtype), out=out)
            _softmax_in_place(out)
        # A row that is fully masked, or holds +inf or NaN, comes out all NaN;
        # its first entry tells.  Such rows are zeroed here and redone by the caller.
        bad = torch.isnan(out[..., 0])
        if bool(bad.any()):
            out.masked_fill_(bad.unsqueeze(-1), 0.0)
        scale_needs_grad = ctx.needs_input_grad[1]
        ctx.save_for_backward(out, x if scale_needs_grad else None, scale if scale_needs_grad else None)
        ctx.scale = scale if not scale_needs_grad else None
        ctx.mark_non_differentiable(bad)
        return out, bad

    @staticmethod
    def backward(ctx, grad: Tensor, _grad_bad: Tensor | None):
        out, x, scale_tensor = ctx.saved_tensors
        scale = ctx.scale if scale_tensor is None else scale_tensor
        grad_z = torch.ops.aten._softmax_backward_data(grad, out, -1, out.dtype)
        if scale_tensor is None:
            if not (isinstance(scale, float) and scale == 1.0):
                grad_z.mul_(scale)
            return grad_z, None, None
        # d/d scale of softmax(scale * x) = sum_j grad_z_j x_j; masked and
        # underflowed positions have grad_z = 0 but x may be +-inf there.
        finite_x = torch.where(out > 0, x, 0.0)
        grad_scale = sum_to_shape((grad_z * finite_x).sum(-1, keepdim=True), scale.shape)
        return grad_z * scale, grad_scale, None


def scaled_softmax(x: Tensor, scale: float | Tensor, keep: Tensor | None) -> tuple[Tensor, Tensor]:
    """``softmax(scale * x)`` over the last axis, restricted to the positions ``keep`` allows.

    Args:
        x: scores ``(..., L)``, float32 or float64, on the CPU.
        scale: a python float or a tensor of shape ``(..., 1)`` broadcastable to ``x``;
            receives a gradient when it requires one.
        keep: bool tensor broadcastable to ``x`` (True = may attend) or None.

    Returns:
        ``(weights, bad)``: weights like ``x`` (contiguous) and a bool tensor of shape
        ``x.shape[:-1]`` flagging rows whose weights are left at zero because they are
        fully masked or hold +inf or NaN; the caller recomputes those rows.
    """
    if isinstance(scale, (int, float)):
        scale = float(scale)
    return _ScaledSoftmax.apply(x, scale, keep)


def self_adjusted_softmax(x: Tensor, keep: Tensor | None, normalized: bool) -> tuple[Tensor, Tensor]:
    """SA-Softmax ``phi(x) * softmax(x)`` of finite scores over the positions ``keep`` allows.

    ``phi(x) = (x - min(x_min, 0)) / (max(x_max, 0) - min(x_min, 0))`` (normalized;
    0 where the span is 0) or ``x``.  Returns ``(weights, bad)`` as for
    :func:`scaled_softmax`; autograd differentiates the factor.
    """
    weights, bad = scaled_softmax(x, 1.0, keep)
    factor = x
    if normalized:
        low = (x if keep is None else x.masked_fill(~keep, math.inf)).amin(-1, keepdim=True).clamp_max(0)
        high = (x if keep is None else x.masked_fill(~keep, -math.inf)).amax(-1, keepdim=True).clamp_min(0)
        span = high - low
        positive = span > 0
        factor = torch.where(positive, (x - low) / torch.where(positive, span, 1.0), 0.0)
    return factor * weights, bad
