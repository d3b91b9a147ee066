"""Fused softmax (with temperature) and Scalable-Softmax, and the softmax-family backward.

Forward, per row: ``y = softmax(m * x)`` over the allowed positions, with the
multiplier ``m = 1 / temperature`` (softmax) or ``m = s * log(max(n, 1)) + bias``
(Scalable-Softmax, ``n`` = allowed positions counted in the kernel).

Backward, per row: with ``dz = y * (g - sum(y * g))``, ``dx = m * dz``;
``d temperature = -m * sum(dz * log y)`` (needs only ``y``); ``d m = sum(dz * x)``
and then ``d s = log(n) * d m``, ``d bias = d m``.  Scalable-Softmax's ``m`` can be 0,
where ``y`` carries no information about ``x``, so when ``s`` or ``bias`` needs a
gradient the input ``x`` is saved as well.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor
from torch.autograd import Function

from attnorm.kernels.triton import launch
from attnorm.kernels.triton.blocks import (
    keep_posinf,
    load_block,
    load_output_and_grad,
    load_row,
    load_row_param,
    scan_row,
)

__all__ = ["ScalableSoftmaxFunction", "SoftmaxFunction", "temperature_backward"]

_TEMPERATURE, _SCALABLE = 0, 1
_NO_PARAM_GRAD, _TEMPERATURE_GRAD, _MULTIPLIER_GRAD = 0, 1, 2


@triton.jit
def _multiplier(first, second, count, VARIANT):
    """``1 / temperature`` (VARIANT 0) or ``s * log(max(n, 1)) + bias`` (VARIANT 1)."""
    if VARIANT == 0:
        multiplier = 1.0 / first
    else:
        multiplier = first * tl.log(tl.maximum(count, 1).to(first.dtype)) + second
    return multiplier


@triton.jit
def _softmax_forward_kernel(
    X, OUT, GRAD_SCALE, LOG_COUNT, first_param, second_param, masking, length, x_row_stride, out_row_stride,
    BLOCK: tl.constexpr, SINGLE: tl.constexpr, VARIANT: tl.constexpr,
    MASK_KIND: tl.constexpr, CAUSAL: tl.constexpr, LENGTHS: tl.constexpr, COMPUTE: tl.constexpr,
):
    """``y = softmax(m * x)`` for one row; writes ``m`` (0 in +inf rows) and, for Scalable-Softmax, ``log max(n, 1)``.

    Bytes moved (:func:`attnorm.kernels.traffic.bytes_moved`): a single-block row
    reads x and writes y once, ``L * (in + out)`` bytes, plus 4 (8 for float64) per
    per-row scalar; a multi-pass row re-reads x once (temperature: online max and
    sum) or twice (Scalable-Softmax: ``m`` needs ``n`` before the sum of exponentials).
    """
    row = tl.program_id(0).to(tl.int64)
    first = load_row_param(first_param, row).to(COMPUTE)
    second = load_row_param(second_param, row).to(COMPUTE)
    if SINGLE:
        cols = tl.arange(0, BLOCK)
        x, allowed, posinf_row, _ = load_row(
            X, row, cols, length, x_row_stride, masking, MASK_KIND, CAUSAL, LENGTHS, COMPUTE
        )
        count = tl.sum(allowed.to(tl.int32), 0)
        multiplier = _multiplier(first, second, count, VARIANT)
        z = tl.where(allowed, x * multiplier, float("-inf"))
        top = tl.where(count > 0, tl.max(z, 0), 0.0)
        e = tl.where(allowed, tl.exp(z - top), 0.0)
        y = tl.where(allowed, e / tl.sum(e, 0), 0.0)
        tl.store(OUT + row * out_row_stride + cols, y.to(OUT.dtype.element_ty), mask=cols < length)
    else:
        online = VARIANT == 0  # temperature: m is known up front, so max and sum go online
        scale = 1.0 / first
        count, posinf_count, _, max_x, min_x, _, sum_exp = scan_row(
            X, row, length, x_row_stride, masking, scale, BLOCK, online, MASK_KIND, CAUSAL, LENGTHS, COMPUTE
        )
        posinf_row = posinf_count > 0
        count = tl.where(posinf_row, posinf_count, count)
        multiplier = _multiplier(first, second, count, VARIANT)
        top = tl.where(multiplier >= 0, max_x, min_x) * multiplier
        top = tl.where(count > 0, top, 0.0)
        if not online:
            sum_exp = tl.zeros((), COMPUTE)
            for start in range(0, length, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                x, allowed = load_block(
                    X, row, cols, length, x_row_stride, masking, MASK_KIND, CAUSAL, LENGTHS, COMPUTE
                )
                x, allowed = keep_posinf(x, allowed, posinf_row)
                sum_exp += tl.sum(tl.where(allowed, tl.exp(x * multiplier - top), 0.0), 0)
        for start in range(0, length, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x, allowed = load_block(X, row, cols, length, x_row_stride, masking, MASK_KIND, CAUSAL, LENGTHS, COMPUTE)
            x, allowed = keep_posinf(x, allowed, posinf_row)
            y = tl.where(allowed, tl.exp(x * multiplier - top) / sum_exp, 0.0)
            tl.store(OUT + row * out_row_stride + cols, y.to(OUT.dtype.element_ty), mask=cols < length)
    tl.store(GRAD_SCALE + row, tl.where(posinf_row, 0.0, multiplier))
    if VARIANT == 1:
        tl.store(LOG_COUNT + row, tl.log(tl.maximum(count, 1).to(COMPUTE)))


@triton.jit
def _block_sums(y, g, x, PARAM_GRAD):
    """Partial sums of one block: ``sum(y g)``, ``sum(y g v)``, ``sum(y v)`` and +inf scores on the support.

    ``v = log y`` for the temperature gradient, ``v = x`` for the multiplier's
    (``sum(dz v) = sum(y g v) - sum(y g) sum(y v)``); both taken where ``y > 0``.
    """
    y_g = tl.sum(y * g, 0)
    y_g_v = tl.zeros_like(y_g)
    y_v = tl.zeros_like(y_g)
    posinf = tl.zeros((), tl.int32)
    if PARAM_GRAD == 1:
        log_y = tl.where(y > 0, tl.log(y), 0.0)
        y_g_v = tl.sum(y * g * log_y, 0)
        y_v = tl.sum(y * log_y, 0)
    if PARAM_GRAD == 2:
        on = y > 0
        x_on = tl.where(on, x, 0.0)
        y_g_v = tl.sum(tl.where(on, y * g * x_on, 0.0), 0)
        y_v = tl.sum(tl.where(on, y * x_on, 0.0), 0)
        posinf = tl.sum((on & (x == float("inf"))).to(tl.int32), 0)
    return y_g, y_g_v, y_v, posinf


@triton.jit
def _softmax_backward_kernel(
    Y, G, X, DX, GRAD_SCALE, PARAM_GRAD_OUT, length, y_row_stride, g_row_stride, x_row_stride, dx_row_stride,
    BLOCK: tl.constexpr, SINGLE: tl.constexpr, PARAM_GRAD: tl.constexpr, COMPUTE: tl.constexpr,
):
    """``dx = m * y * (g - sum(y g))`` and the per-row parameter gradient.

    ``PARAM_GRAD`` 1: ``-m * sum(dz log y)`` (temperature); 2: ``sum(dz x)`` (the
    Scalable-Softmax multiplier; reads x, zero in +inf rows).  Bytes moved: a
    single-block row reads y and g and writes dx once, ``3 * L * itemsize`` (plus x
    for ``PARAM_GRAD`` 2) and the per-row scalars; a multi-pass row re-reads y and g once.
    """
    row = tl.program_id(0).to(tl.int64)
    scale = tl.load(GRAD_SCALE + row)
    x = tl.zeros((BLOCK,), COMPUTE)
    if SINGLE:
        cols = tl.arange(0, BLOCK)
        inside = cols < length
        y, g = load_output_and_grad(Y, G, row, cols, length, y_row_stride, g_row_stride, COMPUTE)
        if PARAM_GRAD == 2:
            x = tl.load(X + row * x_row_stride + cols, mask=inside, other=0.0).to(COMPUTE)
        y_g, y_g_v, y_v, posinf = _block_sums(y, g, x, PARAM_GRAD)
        tl.store(DX + row * dx_row_stride + cols, (scale * y * (g - y_g)).to(DX.dtype.element_ty), mask=inside)
    else:
        y_g = tl.zeros((), COMPUTE)
        y_g_v = tl.zeros((), COMPUTE)
        y_v = tl.zeros((), COMPUTE)
        posinf = tl.zeros((), tl.int32)
        for start in range(0, length, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inside = cols < length
            y, g = load_output_and_grad(Y, G, row, cols, length, y_row_stride, g_row_stride, COMPUTE)
            if PARAM_GRAD == 2:
                x = tl.load(X + row * x_row_stride + cols, mask=inside, other=0.0).to(COMPUTE)
            block_y_g, block_y_g_v, block_y_v, block_posinf = _block_sums(y, g, x, PARAM_GRAD)
            y_g += block_y_g
            y_g_v += block_y_g_v
            y_v += block_y_v
            posinf += block_posinf
        for start in range(0, length, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inside = cols < length
            y, g = load_output_and_grad(Y, G, row, cols, length, y_row_stride, g_row_stride, COMPUTE)
            tl.store(DX + row * dx_row_stride + cols, (scale * y * (g - y_g)).to(DX.dtype.element_ty), mask=inside)
    param_grad = y_g_v - y_g * y_v  # sum(dz v)
    if PARAM_GRAD == 1:
        tl.store(PARAM_GRAD_OUT + row, -scale * param_grad)
    if PARAM_GRAD == 2:
        tl.store(PARAM_GRAD_OUT + row, tl.where(posinf > 0, 0.0, param_grad))


def _forward(x: Tensor, mask, variant: int, first, second) -> tuple[Tensor, Tensor, Tensor]:
    """Run the forward kernel: weights, per-row ``m`` and per-row ``log n`` (Scalable-Softmax only)."""
    run = launch.prepare(x)
    grad_scale = run.row_stats()
    log_count = run.row_stats() if variant == _SCALABLE else grad_scale
    masking = launch.mask_args(mask, x)
    _softmax_forward_kernel[run.grid](
        run.rows, run.out, grad_scale, log_count, launch.row_param(first, x), launch.row_param(second, x),
        masking.args, run.length, run.rows.stride(0), run.out.stride(0),
        BLOCK=run.config.block, SINGLE=run.config.single, VARIANT=variant, COMPUTE=launch.compute_dtype(x),
        num_warps=run.config.num_warps, **masking.constants,
    )
    return run.out.reshape(x.shape), grad_scale, log_count


def _backward(out: Tensor, grad: Tensor, grad_scale: Tensor, x: Tensor | None, param_grad: int):
    """Run the backward kernel; returns ``dx`` and the per-row parameter gradient (or None).

    ``param_grad``: 0 none, 1 temperature, 2 the Scalable-Softmax multiplier (needs ``x``).
    """
    run = launch.prepare(out)
    g = launch.rows_view(grad)
    saved_x = run.rows if x is None else launch.rows_view(x)
    per_row = run.row_stats() if param_grad else grad_scale
    _softmax_backward_kernel[run.grid](
        run.rows, g, saved_x, run.out, grad_scale, per_row, run.length,
        run.rows.stride(0), g.stride(0), saved_x.stride(0), run.out.stride(0),
        BLOCK=run.config.block, SINGLE=run.config.single, PARAM_GRAD=param_grad, COMPUTE=launch.compute_dtype(out),
        num_warps=run.config.num_warps,
    )
    return run.out.reshape(out.shape), per_row if param_grad else None


def temperature_backward(ctx, grad: Tensor, wants_temperature: bool) -> tuple[Tensor, Tensor | None]:
    """``dx`` and the temperature's gradient for a softmax over a fixed set of positions.

    ``ctx`` saved ``(out, grad_scale)`` and holds ``ctx.temperature`` (a
    :class:`~attnorm.kernels.triton.launch.ParamSpec`, or None for a number).
    """
    out, grad_scale = ctx.saved_tensors
    param_grad = _TEMPERATURE_GRAD if wants_temperature else _NO_PARAM_GRAD
    dx, per_row = _backward(out, grad, grad_scale, None, param_grad)
    return dx, launch.param_grad(per_row, out, ctx.temperature) if wants_temperature else None


class SoftmaxFunction(Function):
    """``softmax(x / temperature)``; ``temperature`` a number or a tensor of shape ``(..., 1)``."""

    @staticmethod
    def forward(ctx, x: Tensor, mask, temperature: float | Tensor) -> Tensor:
        out, grad_scale, _ = _forward(x, mask, _TEMPERATURE, temperature, 0.0)
        ctx.save_for_backward(out, grad_scale)
        ctx.temperature = launch.ParamSpec.of(temperature)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        dx, d_temperature = temperature_backward(ctx, grad, ctx.needs_input_grad[2])
        return dx, None, d_temperature


class ScalableSoftmaxFunction(Function):
    """``softmax((s * log n + bias) * x)``; ``s`` and ``bias`` numbers or tensors of shape ``(..., 1)``."""

    @staticmethod
    def forward(ctx, x: Tensor, mask, s: float | Tensor, bias: float | Tensor) -> Tensor:
        out, grad_scale, log_count = _forward(x, mask, _SCALABLE, s, bias)
        wants_params = any(isinstance(value, Tensor) and value.requires_grad for value in (s, bias))
        ctx.save_for_backward(out, grad_scale, log_count, x if wants_params else None)
        ctx.params = (launch.ParamSpec.of(s), launch.ParamSpec.of(bias))
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        out, grad_scale, log_count, x = ctx.saved_tensors
        wants_s, wants_bias = ctx.needs_input_grad[2], ctx.needs_input_grad[3]
        param_grad = _MULTIPLIER_GRAD if wants_s or wants_bias else _NO_PARAM_GRAD
        dx, d_multiplier = _backward(out, grad, grad_scale, x, param_grad)
        s, bias = ctx.params
        d_s = launch.param_grad(d_multiplier * log_count, out, s) if wants_s else None
        d_bias = launch.param_grad(d_multiplier, out, bias) if wants_bias else None
        return dx, None, d_s, d_bias
