"""Fused top-k softmax: softmax over the k largest allowed scores of each row, 0 elsewhere.

The k-th largest score is found without sorting, by a radix search on integer
keys ordered like the scores (the float's bits with the magnitude bits flipped for
negatives; NaN above everything, as ``torch.topk`` ranks it): one bit per step,
keeping the largest key ``t`` with ``count(key >= t) >= k``.  All scores above
``t`` are kept, and ties at ``t`` are kept in index order until k are kept (the
torch reference breaks ties as ``torch.topk`` does, which may pick other tied
positions).  ``k`` is an int, or a fraction: ``max(1, ceil(k * n))`` of the ``n``
allowed positions, counted in the kernel (computed in float64 as the reference does).
In a row holding +inf, ``n`` still counts every allowed position and the kept ones
are (at most all of) the +inf positions.

The backward is softmax's on the kept set (:func:`.softmax.temperature_backward`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.autograd import Function

from attnorm.kernels.triton import launch
from attnorm.kernels.triton.blocks import keep_posinf, load_block, load_row, load_row_param, scan_row
from attnorm.kernels.triton.softmax import temperature_backward

__all__ = ["TopKSoftmaxFunction"]

@triton.jit
def _order_keys(x, allowed, KEY: tl.constexpr, KEY_BITS: tl.constexpr):
    """Integer keys sorting like ``x``: NaN largest, positions not allowed smallest."""
    key_max: tl.constexpr = (1 << (KEY_BITS - 1)) - 1
    key_min: tl.constexpr = -(1 << (KEY_BITS - 1))
    bits = x.to(KEY, bitcast=True)
    keys = bits ^ ((bits >> (KEY_BITS - 1)) & key_max)
    keys = tl.where(x != x, key_max, keys)
    return tl.where(allowed, keys, key_min)


@triton.jit
def _is_nan_key(key, KEY_BITS: tl.constexpr):
    """Whether ``key`` is the one every NaN maps to."""
    return key == (1 << (KEY_BITS - 1)) - 1


@triton.jit
def _keep_count(count, k, IS_FRACTION: tl.constexpr):
    """Positions kept: ``min(k, n)``, or ``min(max(1, ceil(k * n)), n)`` for a fraction k."""
    if IS_FRACTION:
        wanted = tl.maximum(tl.ceil(count.to(tl.float64) * k - 1e-9), 1.0)
    else:
        wanted = k
    return tl.minimum(wanted, count.to(tl.float64)).to(tl.int32)


@triton.jit
def _count_at_least(X, row, length, x_row_stride, masking, posinf_row, threshold, keys, SINGLE, BLOCK,
                    MASK_KIND, CAUSAL, LENGTHS, COMPUTE, KEY, KEY_BITS):
    """Allowed positions whose key is >= threshold: from ``keys`` in registers (SINGLE) or streamed."""
    if SINGLE:
        found = tl.sum((keys >= threshold).to(tl.int32), 0)
    else:
        found = tl.zeros((), tl.int32)
        for start in range(0, length, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x, allowed = load_block(X, row, cols, length, x_row_stride, masking, MASK_KIND, CAUSAL, LENGTHS, COMPUTE)
            x, allowed = keep_posinf(x, allowed, posinf_row)
            found += tl.sum((_order_keys(x, allowed, KEY, KEY_BITS) >= threshold).to(tl.int32), 0)
    return found


@triton.jit
def _kth_key(X, row, length, x_row_stride, masking, posinf_row, keep, keys, SINGLE, BLOCK,
             MASK_KIND, CAUSAL, LENGTHS, COMPUTE, KEY, KEY_BITS):
    """The largest key t with ``count(key >= t) >= keep`` (the keep-th largest key), bit by bit."""
    key_min: tl.constexpr = -(1 << (KEY_BITS - 1))
    # The sign bit first: t >= 0 or t < 0; then t + 2^bit never overflows.
    threshold = tl.zeros((), KEY)
    found = _count_at_least(X, row, length, x_row_stride, masking, posinf_row, threshold, keys, SINGLE, BLOCK,
                            MASK_KIND, CAUSAL, LENGTHS, COMPUTE, KEY, KEY_BITS)
    threshold = tl.where(found >= keep, threshold, key_min)
    one = tl.full((), 1, KEY)
    for step in range(KEY_BITS - 1):
        candidate = threshold + (one << (one * (KEY_BITS - 2 - step)))
        found = _count_at_least(X, row, length, x_row_stride, masking, posinf_row, candidate, keys, SINGLE, BLOCK,
                                MASK_KIND, CAUSAL, LENGTHS, COMPUTE, KEY, KEY_BITS)
        threshold = tl.where(found >= keep, candidate, threshold)
    return threshold


@triton.jit
def _topk_forward_kernel(
    X, OUT, GRAD_SCALE, k_param, temperature_param, masking, length, x_row_stride, out_row_stride,
    BLOCK: tl.constexpr, SINGLE: tl.constexpr, IS_FRACTION: tl.constexpr,
    MASK_KIND: tl.constexpr, CAUSAL: tl.constexpr, LENGTHS: tl.constexpr, COMPUTE: tl.constexpr,
    KEY: tl.constexpr, KEY_BITS: tl.constexpr,
):
    """Top-k softmax of one row; also writes ``1 / temperature`` (0 in +inf rows) for the backward.

    Bytes moved (:func:`attnorm.kernels.traffic.bytes_moved`): a single-block row
    reads x and writes y once, ``L * (in + out)``, plus a per-row scalar; the radix
    search runs on the keys in registers.  A multi-pass row reads x KEY_BITS + 3
    times (statistics, one pass per key bit, sums, write).
    """
    row = tl.program_id(0).to(tl.int64)
    scale = 1.0 / load_row_param(temperature_param, row).to(COMPUTE)
    k = tl.load(k_param)
    if SINGLE:
        cols = tl.arange(0, BLOCK)
        x, allowed, posinf_row, count = load_row(
            X, row, cols, length, x_row_stride, masking, MASK_KIND, CAUSAL, LENGTHS, COMPUTE
        )
        keep = tl.minimum(_keep_count(count, k, IS_FRACTION), tl.sum(allowed.to(tl.int32), 0))
        keys = _order_keys(x, allowed, KEY, KEY_BITS)
        threshold = _kth_key(X, row, length, x_row_stride, masking, posinf_row, keep, keys, True, BLOCK,
                             MASK_KIND, CAUSAL, LENGTHS, COMPUTE, KEY, KEY_BITS)
        greater = keys > threshold
        ties = keys == threshold
        tie_slots = keep - tl.sum(greater.to(tl.int32), 0)
        kept = allowed & (greater | (ties & (tl.cumsum(ties.to(tl.int32), 0) <= tie_slots)))
        z = x * scale
        top = tl.max(tl.where(kept, z, float("-inf")), 0)
        e = tl.where(kept, tl.exp(z - top), 0.0)
        y = tl.where(kept, e / tl.sum(e, 0), 0.0)
        tl.store(OUT + row * out_row_stride + cols, y.to(OUT.dtype.element_ty), mask=cols < length)
    else:
        count, posinf_count, _, max_x, _, _, _ = scan_row(
            X, row, length, x_row_stride, masking, 1.0, BLOCK, False, MASK_KIND, CAUSAL, LENGTHS, COMPUTE
        )
        posinf_row = posinf_count > 0
        keep = tl.minimum(_keep_count(count, k, IS_FRACTION), tl.where(posinf_row, posinf_count, count))
        threshold = _kth_key(X, row, length, x_row_stride, masking, posinf_row, keep, 0, False, BLOCK,
                             MASK_KIND, CAUSAL, LENGTHS, COMPUTE, KEY, KEY_BITS)
        top = max_x * scale
        above_sum = tl.zeros((), COMPUTE)
        above = tl.zeros((), tl.int32)
        tie_score = tl.full((), float("-inf"), COMPUTE)
        for start in range(0, length, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x, allowed = load_block(X, row, cols, length, x_row_stride, masking, MASK_KIND, CAUSAL, LENGTHS, COMPUTE)
            x, allowed = keep_posinf(x, allowed, posinf_row)
            keys = _order_keys(x, allowed, KEY, KEY_BITS)
            greater = keys > threshold
            above += tl.sum(greater.to(tl.int32), 0)
            above_sum += tl.sum(tl.where(greater, tl.exp(x * scale - top), 0.0), 0)
            tie_score = tl.maximum(tie_score, tl.max(tl.where(allowed & (keys == threshold), x, float("-inf")), 0))
        tie_slots = keep - above
        tie_score = tl.where(_is_nan_key(threshold, KEY_BITS), float("nan"), tie_score)
        total = above_sum + tie_slots.to(COMPUTE) * tl.exp(tie_score * scale - top)
        ties_before = tl.zeros((), tl.int32)
        for start in range(0, length, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x, allowed = load_block(X, row, cols, length, x_row_stride, masking, MASK_KIND, CAUSAL, LENGTHS, COMPUTE)
            x, allowed = keep_posinf(x, allowed, posinf_row)
            keys = _order_keys(x, allowed, KEY, KEY_BITS)
            ties = allowed & (keys == threshold)
            rank = ties_before + tl.cumsum(ties.to(tl.int32), 0)
            kept = allowed & ((keys > threshold) | (ties & (rank <= tie_slots)))
            y = tl.where(kept, tl.exp(x * scale - top) / total, 0.0)
            tl.store(OUT + row * out_row_stride + cols, y.to(OUT.dtype.element_ty), mask=cols < length)
            ties_before += tl.sum(ties.to(tl.int32), 0)
    tl.store(GRAD_SCALE + row, tl.where(posinf_row, 0.0, scale))


class TopKSoftmaxFunction(Function):
    """Top-k softmax over the last axis; ``k`` an int >= 1 or a float fraction in (0, 1)."""

    @staticmethod
    def forward(ctx, x: Tensor, mask, k: int | float, temperature: float | Tensor) -> Tensor:
        run = launch.prepare(x)
        grad_scale = run.row_stats()
        masking = launch.mask_args(mask, x)
        wide = x.dtype == torch.float64
        k_value = torch.full((1,), float(k), dtype=torch.float64, device=x.device)
        _topk_forward_kernel[run.grid](
            run.rows, run.out, grad_scale, k_value, launch.row_param(temperature, x), masking.args,
            run.length, run.rows.stride(0), run.out.stride(0),
            BLOCK=run.config.block, SINGLE=run.config.single, IS_FRACTION=isinstance(k, float),
            COMPUTE=launch.compute_dtype(x), KEY=tl.int64 if wide else tl.int32, KEY_BITS=64 if wide else 32,
            num_warps=run.config.num_warps, **masking.constants,
        )
        out = run.out.reshape(x.shape)
        ctx.save_for_backward(out, grad_scale)
        ctx.temperature = launch.ParamSpec.of(temperature)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        dx, d_temperature = temperature_backward(ctx, grad, ctx.needs_input_grad[3])
        return dx, None, None, d_temperature
