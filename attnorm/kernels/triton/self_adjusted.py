"""Fused Self-Adjusted Softmax (Zheng et al., 2025): ``a = phi(x) * softmax(x)``.

``phi(x) = x`` (plain) or ``(x - low) / (high - low)`` with ``low = min(x_min, 0)``,
``high = max(x_max, 0)`` over the allowed positions (normalized; ``phi = 0`` when
``high == low``).  A +inf row gives the softmax limit: uniform weights (normalized)
or +inf on the +inf positions (plain).

The output does not determine ``x`` (``x * w`` mixes both), so the backward saves
the input ``x`` and per-row ``log sum exp``, ``low``, ``high`` and a gate (0 in +inf
rows, whose gradient is 0), and rebuilds ``w = exp(x - lse)``.  With
``P = sum(g phi w)`` and ``Q = sum(g w)``:
``dx_j = w_j (g_j phi_j - P) + g_j w_j phi'`` where ``phi' = 1`` (plain) or
``1 / span`` plus the paths through ``low`` and ``high``:
``(P - Q) / span`` shared by the positions attaining ``low`` and ``-P / span`` by those
attaining ``high`` (as torch's amin/amax and clamp gradients share them).
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor
from torch.autograd import Function

from attnorm.kernels.triton import launch
from attnorm.kernels.triton.blocks import keep_posinf, load_block, load_row, scan_row

__all__ = ["SelfAdjustedSoftmaxFunction"]


@triton.jit
def _factor(x, low, high, NORMALIZED):
    """``phi(x)``: ``x`` or its min-max normalised form (0 when the span is 0)."""
    factor = x
    if NORMALIZED:
        span = high - low
        factor = tl.where(span > 0, (x - low) / tl.where(span > 0, span, 1.0), 0.0)
    return factor


@triton.jit
def _output(x, allowed, weights, low, high, posinf_row, NORMALIZED):
    out = _factor(x, low, high, NORMALIZED) * weights
    if NORMALIZED:
        out = tl.where(posinf_row, weights, out)
    else:
        out = tl.where(posinf_row, float("inf"), out)
    return tl.where(allowed, out, 0.0)


@triton.jit
def _self_adjusted_forward_kernel(
    X, OUT, LSE, LOW, HIGH, GATE, masking, length, x_row_stride, out_row_stride,
    BLOCK: tl.constexpr, SINGLE: tl.constexpr, NORMALIZED: tl.constexpr,
    MASK_KIND: tl.constexpr, CAUSAL: tl.constexpr, LENGTHS: tl.constexpr, COMPUTE: tl.constexpr,
):
    """SA-Softmax of one row; writes ``lse``, ``low``, ``high`` and the gate for the backward.

    Bytes moved (:func:`attnorm.kernels.traffic.bytes_moved`): a single-block row
    reads x and writes the output once, ``L * (in + out)``, plus 4 per-row scalars;
    a multi-pass row re-reads x once (online max and sum, then the write).
    """
    row = tl.program_id(0).to(tl.int64)
    if SINGLE:
        cols = tl.arange(0, BLOCK)
        x, allowed, posinf_row, _ = load_row(
            X, row, cols, length, x_row_stride, masking, MASK_KIND, CAUSAL, LENGTHS, COMPUTE
        )
        count = tl.sum(allowed.to(tl.int32), 0)
        top = tl.where(count > 0, tl.max(tl.where(allowed, x, float("-inf")), 0), 0.0)
        e = tl.where(allowed, tl.exp(x - top), 0.0)
        total = tl.sum(e, 0)
        low = tl.minimum(tl.min(tl.where(allowed, x, float("inf")), 0), 0.0)
        high = tl.maximum(top, 0.0)
        out = _output(x, allowed, e / total, low, high, posinf_row, NORMALIZED)
        tl.store(OUT + row * out_row_stride + cols, out.to(OUT.dtype.element_ty), mask=cols < length)
    else:
        count, posinf_count, _, top, min_x, _, total = scan_row(
            X, row, length, x_row_stride, masking, 1.0, BLOCK, True, MASK_KIND, CAUSAL, LENGTHS, COMPUTE
        )
        posinf_row = posinf_count > 0
        top = tl.where(count > 0, top, 0.0)
        low = tl.minimum(min_x, 0.0)
        high = tl.maximum(top, 0.0)
        for start in range(0, length, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x, allowed = load_block(X, row, cols, length, x_row_stride, masking, MASK_KIND, CAUSAL, LENGTHS, COMPUTE)
            x, allowed = keep_posinf(x, allowed, posinf_row)
            weights = tl.where(allowed, tl.exp(x - top) / total, 0.0)
            out = _output(x, allowed, weights, low, high, posinf_row, NORMALIZED)
            tl.store(OUT + row * out_row_stride + cols, out.to(OUT.dtype.element_ty), mask=cols < length)
    tl.store(LSE + row, top + tl.log(total))
    tl.store(LOW + row, low)
    tl.store(HIGH + row, high)
    tl.store(GATE + row, tl.where(posinf_row, 0.0, 1.0))


@triton.jit
def _block_sums(x, allowed, g, lse, low, high, NORMALIZED):
    """``sum(g phi w)``, ``sum(g w)`` and how many positions attain ``low`` and ``high``."""
    weights = tl.where(allowed, tl.exp(x - lse), 0.0)
    weighted_g = tl.where(allowed, g * weights, 0.0)
    phi = _factor(x, low, high, NORMALIZED)
    at_low = tl.sum((allowed & (x == low)).to(tl.int32), 0)
    at_high = tl.sum((allowed & (x == high)).to(tl.int32), 0)
    return tl.sum(weighted_g * phi, 0), tl.sum(weighted_g, 0), at_low, at_high


@triton.jit
def _input_grad(x, allowed, g, lse, low, high, phi_g_w, g_w, at_low, at_high, NORMALIZED):
    weights = tl.where(allowed, tl.exp(x - lse), 0.0)
    phi = _factor(x, low, high, NORMALIZED)
    dx = weights * (g * phi - phi_g_w)
    if NORMALIZED:
        span = high - low
        inverse_span = tl.where(span > 0, 1.0 / tl.where(span > 0, span, 1.0), 0.0)
        through_low = tl.where(x == low, (phi_g_w - g_w) * inverse_span / tl.maximum(at_low, 1), 0.0)
        through_high = tl.where(x == high, phi_g_w * inverse_span / tl.maximum(at_high, 1), 0.0)
        dx += g * weights * inverse_span + tl.where(span > 0, through_low - through_high, 0.0)
    else:
        dx += g * weights
    return tl.where(allowed, dx, 0.0)


@triton.jit
def _load_backward_block(
    X, G, row, cols, length, x_row_stride, g_row_stride, masking, live, MASK_KIND, CAUSAL, LENGTHS, COMPUTE
):
    """Scores (0 where not allowed), allowed positions (none when not ``live``) and the incoming gradient."""
    x, allowed = load_block(X, row, cols, length, x_row_stride, masking, MASK_KIND, CAUSAL, LENGTHS, COMPUTE)
    allowed = tl.where(live, allowed, False)
    g = tl.load(G + row * g_row_stride + cols, mask=cols < length, other=0.0).to(COMPUTE)
    return tl.where(allowed, x, 0.0), allowed, g


@triton.jit
def _self_adjusted_backward_kernel(
    X, G, DX, LSE, LOW, HIGH, GATE, masking, length, x_row_stride, g_row_stride, dx_row_stride,
    BLOCK: tl.constexpr, SINGLE: tl.constexpr, NORMALIZED: tl.constexpr,
    MASK_KIND: tl.constexpr, CAUSAL: tl.constexpr, LENGTHS: tl.constexpr, COMPUTE: tl.constexpr,
):
    """SA-Softmax backward of one row (formula in the module docstring).

    Bytes moved: a single-block row reads x and g and writes dx once,
    ``3 * L * itemsize``, plus 4 per-row scalars (and the bool mask, if one was
    given); a multi-pass row re-reads x and g once.
    """
    row = tl.program_id(0).to(tl.int64)
    lse = tl.load(LSE + row)
    low = tl.load(LOW + row)
    high = tl.load(HIGH + row)
    live = tl.load(GATE + row) != 0
    if SINGLE:
        cols = tl.arange(0, BLOCK)
        x, allowed, g = _load_backward_block(
            X, G, row, cols, length, x_row_stride, g_row_stride, masking, live, MASK_KIND, CAUSAL, LENGTHS, COMPUTE
        )
        phi_g_w, g_w, at_low, at_high = _block_sums(x, allowed, g, lse, low, high, NORMALIZED)
        dx = _input_grad(x, allowed, g, lse, low, high, phi_g_w, g_w, at_low, at_high, NORMALIZED)
        tl.store(DX + row * dx_row_stride + cols, dx.to(DX.dtype.element_ty), mask=cols < length)
    else:
        phi_g_w = tl.zeros((), COMPUTE)
        g_w = tl.zeros((), COMPUTE)
        at_low = tl.zeros((), tl.int32)
        at_high = tl.zeros((), tl.int32)
        for start in range(0, length, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x, allowed, g = _load_backward_block(
                X, G, row, cols, length, x_row_stride, g_row_stride, masking, live, MASK_KIND, CAUSAL, LENGTHS, COMPUTE
            )
            block_phi_g_w, block_g_w, block_low, block_high = _block_sums(x, allowed, g, lse, low, high, NORMALIZED)
            phi_g_w += block_phi_g_w
            g_w += block_g_w
            at_low += block_low
            at_high += block_high
        for start in range(0, length, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x, allowed, g = _load_backward_block(
                X, G, row, cols, length, x_row_stride, g_row_stride, masking, live, MASK_KIND, CAUSAL, LENGTHS, COMPUTE
            )
            dx = _input_grad(x, allowed, g, lse, low, high, phi_g_w, g_w, at_low, at_high, NORMALIZED)
            tl.store(DX + row * dx_row_stride + cols, dx.to(DX.dtype.element_ty), mask=cols < length)


class SelfAdjustedSoftmaxFunction(Function):
    """SA-Softmax over the last axis (``normalized`` picks the variant)."""

    @staticmethod
    def forward(ctx, x: Tensor, mask, normalized: bool) -> Tensor:
        run = launch.prepare(x)
        lse, low, high, gate = (run.row_stats() for _ in range(4))
        masking = launch.mask_args(mask, x)
        _self_adjusted_forward_kernel[run.grid](
            run.rows, run.out, lse, low, high, gate, masking.args, run.length, run.rows.stride(0), run.out.stride(0),
            BLOCK=run.config.block, SINGLE=run.config.single, NORMALIZED=normalized, COMPUTE=launch.compute_dtype(x),
            num_warps=run.config.num_warps, **masking.constants,
        )
        ctx.save_for_backward(x, lse, low, high, gate, mask if isinstance(mask, Tensor) else None)
        ctx.structured_mask = None if isinstance(mask, Tensor) else mask
        ctx.normalized = normalized
        return run.out.reshape(x.shape)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, lse, low, high, gate, bool_mask = ctx.saved_tensors
        mask = bool_mask if bool_mask is not None else ctx.structured_mask
        run = launch.prepare(x)
        g = launch.rows_view(grad)
        masking = launch.mask_args(mask, x)
        _self_adjusted_backward_kernel[run.grid](
            run.rows, g, run.out, lse, low, high, gate, masking.args,
            run.length, run.rows.stride(0), g.stride(0), run.out.stride(0),
            BLOCK=run.config.block, SINGLE=run.config.single, NORMALIZED=ctx.normalized,
            COMPUTE=launch.compute_dtype(x), num_warps=run.config.num_warps, **masking.constants,
        )
        return run.out.reshape(x.shape), None, None
