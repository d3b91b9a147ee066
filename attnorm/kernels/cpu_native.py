"""The native CPU kernels (:mod:`attnorm.kernels.native`) as autograd Functions.

Drop-in replacements for :func:`~attnorm.kernels.cpu_softmax.scaled_softmax`,
:func:`~attnorm.kernels.cpu_softmax.self_adjusted_softmax`,
:func:`~attnorm.kernels.cpu_sparse.entmax_support` and
:func:`~attnorm.kernels.cpu_sparse.topk_support`, with the same ``(weights, bad)``
contract.  Entmax's alpha may be trainable (its gradient comes from the output);
the other parameters are python numbers or tensors without a gradient
(:mod:`attnorm.kernels.cpu` sends trainable ones to the torch-only functions,
which differentiate them).

Each backward saves only the output (SA-Softmax: its scores and five per-row
numbers).  It runs the native closed-form
Jacobian-vector product, except under ``create_graph`` (double backward) or
``vmap`` (vectorised jacobians), where it uses the same formula in differentiable
torch ops.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.autograd import Function

from attnorm.kernels import old_reference as reference
from attnorm.kernels.cpu import native
from attnorm.kernels.old_reference import topk_row_count
from attnorm.kernels.sparse import (
    entmax_alpha_vjp,
    entmax_slopes,
    entmax_vjp,
    save_output,
    saved_output,
    sum_to_shape,
)

__all__ = ["entmax_support", "scaled_softmax", "self_adjusted_softmax", "topk_support"]


def _scores(x: Tensor, keep: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """Contiguous scores with -inf where ``keep`` is False, and the output buffer.

    The buffer is None when the scores are ``x`` itself; a fresh masked (or
    contiguous) copy is its own output buffer, since the kernels may write over
    their input.
    """
    if keep is None:
        scores = x.contiguous()
    else:
        scores = torch.empty(x.shape, dtype=x.dtype)
        torch.where(keep, x, torch.tensor(-math.inf, dtype=x.dtype), out=scores)
    return scores, None if scores is x else scores


def _native_backward(*tensors: Tensor) -> bool:
    return not torch.is_grad_enabled() and native.usable(*tensors)


def _softmax_vjp(out: Tensor, grad: Tensor, scale: float | Tensor) -> Tensor:
    """``scale * J^T grad`` for ``out = softmax(scale * x)``."""
    if _native_backward(out, grad):
        return native.softmax_backward(out, grad, scale)
    return torch.ops.aten._softmax_backward_data(grad, out, -1, out.dtype) * scale


class _ScaledSoftmax(Function):
    @staticmethod
    def forward(ctx, x: Tensor, scale: float | Tensor, keep: Tensor | None):
        scores, buffer = _scores(x, keep)
        return save_output(ctx, *native.softmax_forward(scores, scale, out=buffer), scale)

    @staticmethod
    def backward(ctx, grad: Tensor, _grad_bad: Tensor | None):
        out, scale = saved_output(ctx)
        return _softmax_vjp(out, grad, scale), None, None


class _SelfAdjustedSoftmax(Function):
    @staticmethod
    def forward(ctx, scores: Tensor, normalized: bool):
        out, bad, stats = native.self_adjusted_forward(scores, normalized)
        ctx.save_for_backward(scores, stats)
        ctx.normalized = normalized
        ctx.mark_non_differentiable(bad)
        return out, bad

    @staticmethod
    def backward(ctx, grad: Tensor, _grad_bad: Tensor | None):
        # The output does not determine the scores (phi(x) w mixes both): SA saves its input.
        scores, stats = ctx.saved_tensors
        if _native_backward(scores, grad):
            return native.self_adjusted_backward(scores, grad, ctx.normalized, stats), None
        # Double backward or vmap: differentiate the torch reference of the forward
        # (flagged rows are replaced by the caller, so their gradient is zero).
        grad = grad.masked_fill(stats[:, 4].view(grad.shape[:-1]).unsqueeze(-1) == 0, 0.0)
        with torch.enable_grad():
            out = reference.self_adjusted_softmax_rows(scores, None, normalized=ctx.normalized)
            return torch.autograd.grad(out, scores, grad, create_graph=torch.is_grad_enabled())[0], None


class _Entmax(Function):
    @staticmethod
    def forward(ctx, x: Tensor, keep: Tensor | None, alpha: float | Tensor):
        scores, buffer = _scores(x, keep)
        return save_output(ctx, *native.entmax_forward(scores, alpha, out=buffer), alpha)

    @staticmethod
    def backward(ctx, grad: Tensor, _grad_bad: Tensor | None):
        out, alpha = saved_output(ctx)
        alpha_needs_grad = ctx.needs_input_grad[2]
        if _native_backward(out, grad):
            if not alpha_needs_grad:
                return native.entmax_backward(out, grad, alpha), None, None
            grad_x, per_row = native.entmax_backward_with_alpha(out, grad, alpha)
            per_row = per_row.to(alpha.dtype).view(*out.shape[:-1], 1)
            return grad_x, None, sum_to_shape(per_row, alpha.shape)
        # Jacobian of entmax: diag(s) - s s^T / sum(s), s = out^(2 - alpha) on the support.
        slopes = entmax_slopes(out, alpha)
        grad_alpha = entmax_alpha_vjp(grad, out, alpha, slopes) if alpha_needs_grad else None
        return entmax_vjp(grad, slopes), None, grad_alpha


class _TopKSoftmax(Function):
    @staticmethod
    def forward(ctx, x: Tensor, keep: Tensor | None, k: float, scale: float | Tensor, allowed_count: Tensor | None):
        scores, buffer = _scores(x, keep)
        if allowed_count is None:  # an int k; the kernel keeps all finite scores of shorter rows
            counts = int(k)
        else:
            counts = topk_row_count(k, allowed_count.expand(*x.shape[:-1], 1))
        return save_output(ctx, *native.topk_forward(scores, counts, scale, out=buffer), scale)

    @staticmethod
    def backward(ctx, grad: Tensor, _grad_bad: Tensor | None):
        # Softmax's backward: positions outside the top k have out = 0 and get 0.
        out, scale = saved_output(ctx)
        return _softmax_vjp(out, grad, scale), None, None, None, None


def scaled_softmax(x: Tensor, scale: float | Tensor, keep: Tensor | None) -> tuple[Tensor, Tensor]:
    """As :func:`attnorm.kernels.cpu_softmax.scaled_softmax`, for a ``scale`` without gradient."""
    return _ScaledSoftmax.apply(x, float(scale) if isinstance(scale, (int, float)) else scale, keep)


def self_adjusted_softmax(x: Tensor, keep: Tensor | None, normalized: bool) -> tuple[Tensor, Tensor]:
    """SA-Softmax ``phi(x) * softmax(x)`` over the positions ``keep`` allows; ``(weights, bad)``
    as for :func:`scaled_softmax`."""
    if keep is not None:  # masked out of place and differentiably: the scores are saved for backward
        x = x.masked_fill(~keep, -math.inf)
    return _SelfAdjustedSoftmax.apply(x.contiguous(), normalized)


def entmax_support(x: Tensor, keep: Tensor | None, alpha: float | Tensor) -> tuple[Tensor, Tensor]:
    """As :func:`attnorm.kernels.cpu_sparse.entmax_support`; ``alpha`` may be trainable."""
    return _Entmax.apply(x, keep, alpha)


def topk_support(
    x: Tensor, keep: Tensor | None, k: float, scale: float | Tensor, allowed_count: Tensor | None
) -> tuple[Tensor, Tensor]:
    """As :func:`attnorm.kernels.cpu_sparse.topk_support`, for a ``scale`` without gradient."""
    return _TopKSoftmax.apply(x, keep, k, scale, allowed_count)
