"""Fused softmax (with temperature) and Scalable-Softmax, and the softmax-family backward.

Forward, per row: ``y = softmax(m x)`` over the allowed positions, with the
multiplier ``m = 1 / temperature`` (variant 0) or ``m = s log(max(n, 1)) + bias``
(variant 1, Scalable-Softmax, Nakanishi 2025; ``n`` the allowed positions, counted
in the kernel).  Scores are shifted before they are scaled, ``m (x - max x)`` for
``m >= 0`` and ``m (x - min x)`` for ``m < 0``, so finite scores never give NaN.

Backward, per row (shared by softmax, Scalable-Softmax and top-k): with
``dz = y (g - sum(y g))``, ``dx = m dz``; the temperature's gradient
``-m sum(dz log y)`` needs only ``y``; the multiplier's ``sum(dz x)`` needs ``x``
(Scalable-Softmax's ``m`` can be 0, where ``y`` carries no information about ``x``).

With a sink (``kernels/README.md``) both run on the extended row: the forward on
``[x, sink]`` (``n`` still counts the real positions only) and the backward on
``[y, sink_weight]``, ``[g, 0]`` (and ``[x, sink]``); the sink's weight and gradient
come out per row.

With a cap (``kernels/README.md``, "Soft-capping") the forward runs on ``c(x)``, capped
as it is read; the backward reads the raw scores and multiplies ``dx`` by the cap's
slope ``1 - tanh(x / cap)^2`` (the sink's gradient is not capped).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from attnorm.kernels import rules
from attnorm.kernels.triton import launch, replay
from attnorm.kernels.triton.blocks import (
    at_sink,
    keep_posinf,
    load_block,
    load_output_and_grad,
    load_row,
    load_row_param,
    load_sink,
    load_sink_score,
    load_softcap,
    row_extent,
    scaled,
    scan_row,
    soft_cap,
    store_row,
    store_sink,
    through_cap,
)

__all__ = ["softmax_backward", "softmax_forward"]


@triton.jit
def _multiplier(first, second, count, VARIANT: tl.constexpr):
    """``1 / temperature`` (VARIANT 0) or ``s * log(max(n, 1)) + bias`` (VARIANT 1)."""
    if VARIANT == 0:
        multiplier = 1.0 / first
    else:
        multiplier = first * tl.log(tl.maximum(count, 1).to(first.dtype)) + second
    return multiplier


@triton.jit
def _softmax_forward_kernel(
    X, OUT, MULTIPLIER, LOG_COUNT, first_values, first_stride, second_values, second_stride,
    mask_ptr, mask_batch_stride, mask_head_stride, mask_query_stride, mask_col_stride,
    lengths_ptr, lengths_stride, rows_per_batch, num_queries, diagonal,
    sink_values, sink_stride, sink_period, sink_count, SINK_WEIGHT, softcap_value,
    length, x_row_stride, out_row_stride,
    BLOCK: tl.constexpr, SINGLE: tl.constexpr, VARIANT: tl.constexpr,
    BOOL_MASK: tl.constexpr, CAUSAL: tl.constexpr, LENGTHS: tl.constexpr, HAS_SINK: tl.constexpr, SOFTCAP: tl.constexpr,
    COMPUTE: tl.constexpr, WEIGHTS_ONLY: tl.constexpr,
):
    """``y = softmax(m x)`` for one row; writes ``m`` (0 in +inf rows) and, for variant 1, ``log max(n, 1)``.

    Passes over the row and bytes moved (``in``/``out`` the element sizes of x and
    y; per-row scalars add 4 bytes each, 8 for float64): a single-block row reads x
    once and writes y once, ``L * (in + out)``.  A multi-pass row reads x twice
    (variant 0: online max and sum, then the write; ``L * (2 in + out)``) or three
    times (variant 1: ``m`` needs ``n`` before the sum of exponentials;
    ``L * (3 in + out)``).  A bool mask adds one byte per element and pass.
    ``HAS_SINK``: the sink is position ``length`` of every pass (one scalar read, held
    in a register) and its weight one more per-row scalar written; no extra pass.
    ``SOFTCAP``: x is capped as it is read in every pass (one
    scalar read per row, one ``exp`` and one division per element and pass); no extra
    pass or byte.
    """
    masking = (mask_ptr, mask_batch_stride, mask_head_stride, mask_query_stride, mask_col_stride, lengths_ptr,
               lengths_stride, rows_per_batch, num_queries, diagonal)
    row = tl.program_id(0).to(tl.int64)
    first = load_row_param(first_values, first_stride, row).to(COMPUTE)
    second = load_row_param(second_values, second_stride, row).to(COMPUTE)
    sink = load_sink_score(sink_values, sink_stride, sink_period, sink_count, row, HAS_SINK, COMPUTE)
    softcap = load_softcap(softcap_value, SOFTCAP, COMPUTE)
    sink_weight = tl.zeros((), COMPUTE)
    if SINGLE:
        cols = tl.arange(0, BLOCK)
        x, allowed, posinf_row, nan_row, count = load_row(
            X, row, cols, length, x_row_stride, masking, sink, softcap,
            BOOL_MASK, CAUSAL, LENGTHS, HAS_SINK, SOFTCAP, COMPUTE
        )
        multiplier = _multiplier(first, second, count, VARIANT)
        any_allowed = tl.sum(allowed.to(tl.int32), 0) > 0
        top = tl.where(any_allowed, tl.max(tl.where(allowed, x, float("-inf")), 0), 0.0)
        bottom = tl.where(any_allowed, tl.min(tl.where(allowed, x, float("inf")), 0), 0.0)
        shift = tl.where(multiplier >= 0, top, bottom)
        e = tl.where(allowed, tl.exp(scaled(x - shift, multiplier)), 0.0)
        total = tl.sum(e, 0)
        y = tl.where(allowed, e / tl.where(total > 0, total, 1.0), 0.0)
        store_row(OUT, row, cols, length, out_row_stride, y, nan_row)
        if HAS_SINK:
            sink_weight = at_sink(cols, length, y)
    else:
        online = VARIANT == 0  # temperature: m is known up front, so max and sum go online
        scale = 1.0 / first
        count, posinf_count, nan_count, max_x, min_x, _, sum_exp = scan_row(
            X, row, length, x_row_stride, masking, sink, softcap, scale, BLOCK, online,
            BOOL_MASK, CAUSAL, LENGTHS, HAS_SINK, SOFTCAP, COMPUTE,
        )
        posinf_row = posinf_count > 0
        nan_row = nan_count > 0
        multiplier = _multiplier(first, second, count, VARIANT)
        shift = tl.where(multiplier >= 0, max_x, min_x)
        shift = tl.where((shift == float("inf")) | (shift == float("-inf")), 0.0, shift)
        if not online:
            sum_exp = tl.zeros((), COMPUTE)
            for start in range(0, row_extent(length, HAS_SINK), BLOCK):
                cols = start + tl.arange(0, BLOCK)
                x, allowed = load_block(
                    X, row, cols, length, x_row_stride, masking, sink, softcap,
                    BOOL_MASK, CAUSAL, LENGTHS, HAS_SINK, SOFTCAP, COMPUTE
                )
                x, allowed = keep_posinf(x, allowed, posinf_row)
                sum_exp += tl.sum(tl.where(allowed, tl.exp(scaled(x - shift, multiplier)), 0.0), 0)
        total = tl.where(sum_exp > 0, sum_exp, 1.0)
        for start in range(0, row_extent(length, HAS_SINK), BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x, allowed = load_block(
                X, row, cols, length, x_row_stride, masking, sink, softcap,
                BOOL_MASK, CAUSAL, LENGTHS, HAS_SINK, SOFTCAP, COMPUTE
            )
            x, allowed = keep_posinf(x, allowed, posinf_row)
            y = tl.where(allowed, tl.exp(scaled(x - shift, multiplier)) / total, 0.0)
            store_row(OUT, row, cols, length, out_row_stride, y, nan_row)
            if HAS_SINK:
                sink_weight += at_sink(cols, length, y)
    if not WEIGHTS_ONLY:  # the per-row values only a backward reads
        tl.store(MULTIPLIER + row, tl.where(posinf_row, 0.0, multiplier))
        if VARIANT == 1:
            tl.store(LOG_COUNT + row, tl.log(tl.maximum(count, 1).to(COMPUTE)))
    if HAS_SINK:
        store_sink(SINK_WEIGHT, row, sink_weight, nan_row)


@triton.jit
def _block_sums(y, g, x, PARAM_GRAD: tl.constexpr):
    """Partial sums of one block: ``sum(y g)``, ``sum(y g v)``, ``sum(y v)`` and +inf scores on the support.

    ``v = log y`` for the temperature gradient, ``v = x`` for the multiplier's
    (``sum(dz v) = sum(y g v) - sum(y g) sum(y v)``); both taken where ``y > 0``.
    """
    y_g = tl.sum(y * g, 0)
    y_g_v = tl.zeros_like(y_g)
    y_v = tl.zeros_like(y_g)
    posinf = tl.zeros((), tl.int32)
    if PARAM_GRAD == 1:
        log_y = tl.where(y > 0, tl.log(tl.where(y > 0, y, 1.0)), 0.0)
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
def _load_scores(X, row, cols, length, x_row_stride, sink, softcap, HAS_SINK: tl.constexpr, SOFTCAP: tl.constexpr,
                 COMPUTE: tl.constexpr):
    """The scores the forward used at ``cols`` (0 past the row).

    Capped under ``SOFTCAP``; with ``HAS_SINK`` the sink's score (not capped) at position ``length``.
    """
    x = soft_cap(tl.load(X + row * x_row_stride + cols, mask=cols < length, other=0.0).to(COMPUTE), softcap, SOFTCAP)
    if HAS_SINK:
        x = tl.where(cols == length, sink, x)
    return x


@triton.jit
def _softmax_backward_kernel(
    Y, G, X, DX, PARAM_GRAD_OUT, multiplier_values, multiplier_stride,
    sink_weight_values, sink_weight_stride, sink_values, sink_stride, sink_period, sink_count, DSINK, softcap_value,
    length, y_row_stride, g_row_stride, x_row_stride, dx_row_stride,
    BLOCK: tl.constexpr, SINGLE: tl.constexpr, PARAM_GRAD: tl.constexpr, HAS_SINK: tl.constexpr, SOFTCAP: tl.constexpr,
    COMPUTE: tl.constexpr,
):
    """``dx = m y (g - sum(y g))`` and the per-row parameter gradient.

    ``PARAM_GRAD`` 1: ``-m sum(dz log y)`` (temperature); 2: ``sum(dz x)`` (the
    multiplier; reads x, 0 in +inf rows).  Passes and bytes moved: a single-block
    row reads y and g once and writes dx once, ``3 L itemsize`` (plus ``L`` x
    elements for ``PARAM_GRAD`` 2); a multi-pass row reads y and g twice (sums, then
    dx; x once), ``5 L itemsize``.  Per-row scalars add 4 bytes each (8 for float64).
    ``HAS_SINK``: the row is ``[y, sink_weight]`` with gradient ``[g, 0]`` (and ``[x, sink]``),
    the sink's weight (and score) one scalar read per row, its gradient one written.
    ``SOFTCAP``: x is the raw scores; ``dx`` is carried through the cap at them (x read
    once more in the pass that writes dx: ``L`` x elements more) and ``PARAM_GRAD`` 2
    sums over ``c(x)``.
    """
    row = tl.program_id(0).to(tl.int64)
    multiplier = load_row_param(multiplier_values, multiplier_stride, row).to(COMPUTE)
    sink_weight = load_sink(sink_weight_values, sink_weight_stride, row, HAS_SINK, COMPUTE)
    sink = tl.zeros((), COMPUTE)
    if PARAM_GRAD == 2:
        sink = load_sink_score(sink_values, sink_stride, sink_period, sink_count, row, HAS_SINK, COMPUTE)
    softcap = load_softcap(softcap_value, SOFTCAP, COMPUTE)
    dsink = tl.zeros((), COMPUTE)
    x = tl.zeros((BLOCK,), COMPUTE)
    if SINGLE:
        cols = tl.arange(0, BLOCK)
        inside = cols < length
        y, g = load_output_and_grad(Y, G, row, cols, length, y_row_stride, g_row_stride, sink_weight, HAS_SINK,
                                    COMPUTE)
        if PARAM_GRAD == 2:
            x = _load_scores(X, row, cols, length, x_row_stride, sink, softcap, HAS_SINK, SOFTCAP, COMPUTE)
        y_g, y_g_v, y_v, posinf = _block_sums(y, g, x, PARAM_GRAD)
        dx = multiplier * y * (g - y_g)
        if HAS_SINK:
            dsink = at_sink(cols, length, dx)
        dx = through_cap(X, row, cols, length, x_row_stride, dx, softcap, SOFTCAP, COMPUTE)
        tl.store(DX + row * dx_row_stride + cols, dx.to(DX.dtype.element_ty), mask=inside)
    else:
        y_g = tl.zeros((), COMPUTE)
        y_g_v = tl.zeros((), COMPUTE)
        y_v = tl.zeros((), COMPUTE)
        posinf = tl.zeros((), tl.int32)
        for start in range(0, row_extent(length, HAS_SINK), BLOCK):
            cols = start + tl.arange(0, BLOCK)
            y, g = load_output_and_grad(Y, G, row, cols, length, y_row_stride, g_row_stride, sink_weight, HAS_SINK,
                                        COMPUTE)
            if PARAM_GRAD == 2:
                x = _load_scores(X, row, cols, length, x_row_stride, sink, softcap, HAS_SINK, SOFTCAP, COMPUTE)
            block_y_g, block_y_g_v, block_y_v, block_posinf = _block_sums(y, g, x, PARAM_GRAD)
            y_g += block_y_g
            y_g_v += block_y_g_v
            y_v += block_y_v
            posinf += block_posinf
        for start in range(0, row_extent(length, HAS_SINK), BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inside = cols < length
            y, g = load_output_and_grad(Y, G, row, cols, length, y_row_stride, g_row_stride, sink_weight, HAS_SINK,
                                        COMPUTE)
            dx = multiplier * y * (g - y_g)
            if HAS_SINK:
                dsink += at_sink(cols, length, dx)
            dx = through_cap(X, row, cols, length, x_row_stride, dx, softcap, SOFTCAP, COMPUTE)
            tl.store(DX + row * dx_row_stride + cols, dx.to(DX.dtype.element_ty), mask=inside)
    param_grad = y_g_v - y_g * y_v  # sum(dz v)
    if PARAM_GRAD == 1:
        tl.store(PARAM_GRAD_OUT + row, -multiplier * param_grad)
    if PARAM_GRAD == 2:
        tl.store(PARAM_GRAD_OUT + row, tl.where(posinf > 0, 0.0, param_grad))
    if HAS_SINK:
        tl.store(DSINK + row, dsink)


@replay.replayable
def softmax_forward(
    x: Tensor, mask: rules.RowMask, variant: int, first: float | Tensor, second: float | Tensor,
    sink: Tensor | None = None, softcap: float | None = None, weights_only: bool = False,
    out_dtype: torch.dtype | None = None,
) -> tuple[Tensor, ...]:
    """``y = softmax(m x)`` over the allowed positions of each row.

    Args:
        x: scores ``(..., L)``, float16/bfloat16/float32/float64.
        mask: which positions each row may use.
        variant: 0, ``m = 1 / first`` (temperature); 1, ``m = first log(max(n, 1)) + second``
            (Scalable-Softmax, ``n`` the allowed positions of the row).
        first, second: python numbers or tensors ``(..., 1)`` broadcastable to ``x``.
        sink: the score of a virtual key after each row, ``x.shape[:-1]`` (or ``(..., 1)``), or
            None: the softmax of the extended row ``m [x, sink]``, ``n`` not counting the sink.
        softcap: a cap ``> 0``, or None: the softmax of ``c(x) = softcap tanh(x / softcap)``
            (``c(-inf) = -inf``, ``c(+inf) = softcap``; the sink is not capped).
        weights_only: skip what only a backward reads: ``multiplier`` and ``log_count`` are
            None (one or two allocations and stores per row less).
        out_dtype: the weights' dtype, ``x``'s by default (the decoding route's float32 scores
            give their weights in the query's half dtype, rounded as ``Tensor.to`` rounds).

    Returns:
        ``(y, multiplier, log_count)``: weights like ``x``; ``m`` per row ``x.shape[:-1]``
        (0 in rows holding +inf); ``log(max(n, 1))`` per row for variant 1, None for 0.
        With a ``sink``, ``(y, multiplier, log_count, sink_weight)``: the sink's weight per row.

    Raises:
        ValueError: ``variant`` is not 0 or 1, ``sink`` of another shape, or a ``softcap``
            that is not a finite number > 0.
    """
    if variant not in (0, 1):
        raise ValueError(f"variant must be 0 (temperature) or 1 (Scalable-Softmax), got {variant}")
    run = launch.prepare(x, sink is not None, out_dtype)
    multiplier = None if weights_only else run.row_stats()
    log_count = run.row_stats() if variant == 1 and not weights_only else None
    sink_weight = run.row_stats() if sink is not None else None
    masking = launch.mask_args(mask, x)
    unwritten = run.out  # a pointer the kernel never writes through (WEIGHTS_ONLY, variant 0, or no sink)
    launch.run(
        _softmax_forward_kernel, run,
        run.rows, run.out, unwritten if multiplier is None else multiplier,
        unwritten if log_count is None else log_count,
        *launch.row_param(first, x), *launch.row_param(second, x), *masking.args,
        *launch.sink_scores(sink, x), unwritten if sink_weight is None else sink_weight,
        launch.softcap_arg(softcap, x),
        run.length, run.rows.stride(0), run.out.stride(0),
        BLOCK=run.config.block, SINGLE=run.config.single, VARIANT=variant, HAS_SINK=sink is not None,
        SOFTCAP=softcap is not None, COMPUTE=launch.compute_dtype(x), WEIGHTS_ONLY=multiplier is None,
        **masking.constants,
    )
    per_row = x.shape[:-1]
    log_count = None if log_count is None else log_count.reshape(per_row)
    outputs = (run.out.reshape(x.shape), None if multiplier is None else multiplier.reshape(per_row), log_count)
    return outputs if sink_weight is None else (*outputs, sink_weight.reshape(per_row))


@replay.replayable
def softmax_backward(
    y: Tensor, grad: Tensor, multiplier: float | Tensor, x: Tensor | None, param_grad: int,
    sink_weight: Tensor | None = None, sink: Tensor | None = None, softcap: float | None = None,
) -> tuple[Tensor, ...]:
    """``dx = m y (g - sum(y g))`` and, per ``param_grad``, a per-row parameter gradient.

    Args:
        y: the forward's weights ``(..., L)``.
        grad: the incoming gradient, like ``y``.
        multiplier: ``m`` per row (``y.shape[:-1]``, the forward's output) or a number.
        x: the forward's (raw) scores, needed for ``param_grad`` 2 and with ``softcap``.
        param_grad: 0 none; 1 the temperature's, ``-m sum(dz log y)``; 2 the multiplier's,
            ``sum(dz x)`` (0 in rows holding +inf), with ``dz = y (g - sum(y g))``.
        sink_weight: the forward's sink weight per row ``y.shape[:-1]``, or None: the backward
            of the extended row ``[y, sink_weight]`` with gradient ``[g, 0]``; the per-row
            gradient includes the sink's terms.
        sink: the forward's sink scores, needed with ``sink_weight`` for ``param_grad`` 2
            (the extended ``[x, sink]``).
        softcap: the forward's cap, or None: ``dx`` is carried through it,
            ``dx = (1 - tanh(x / softcap)^2) m dz`` (0 where ``x`` is infinite), and
            ``param_grad`` 2 sums ``dz c(x)``.

    Returns:
        ``(dx, per_row)``: ``dx`` like ``y``; ``per_row`` of shape ``y.shape[:-1]`` in the
        accumulation dtype, or None for ``param_grad`` 0.  With ``sink_weight``,
        ``(dx, per_row, dsink)``: the gradient of the sink's score per row, like ``per_row``.

    Raises:
        ValueError: ``param_grad`` not 0, 1 or 2, or 2 without ``x`` (or with ``sink_weight``
            but without ``sink``); ``sink`` without ``sink_weight``; ``softcap`` without ``x``
            or not a finite number > 0.
    """
    if param_grad not in (0, 1, 2) or (param_grad == 2 and x is None):
        given = "with x" if x is not None else "without x"
        raise ValueError(f"param_grad must be 0, 1 or 2 (2 needs x), got {param_grad} {given}")
    if sink_weight is None and sink is not None:
        raise ValueError("sink is read only with sink_weight (the forward's weight of the sink), got sink_weight None")
    if sink_weight is not None and param_grad == 2 and sink is None:
        raise ValueError("param_grad 2 with sink_weight needs the sink scores, got sink None")
    launch.check_raw_scores(x, softcap)
    has_sink = sink_weight is not None
    run = launch.prepare(y, has_sink)
    g = launch.rows_view(grad)
    saved_x = run.rows if x is None else launch.rows_view(x)
    per_row = run.row_stats() if param_grad else None
    dsink = run.row_stats() if has_sink else None
    weight_args = launch.per_row_param(sink_weight, y) if has_sink else (run.rows, 0)
    launch.run(
        _softmax_backward_kernel, run,
        run.rows, g, saved_x, run.out, run.out if per_row is None else per_row,
        *launch.per_row_param(multiplier, y),
        *weight_args, *launch.sink_scores(sink if param_grad == 2 else None, y), run.out if dsink is None else dsink,
        launch.softcap_arg(softcap, y),
        run.length, run.rows.stride(0), g.stride(0), saved_x.stride(0), run.out.stride(0),
        BLOCK=run.config.block, SINGLE=run.config.single, PARAM_GRAD=param_grad, HAS_SINK=has_sink,
        SOFTCAP=softcap is not None, COMPUTE=launch.compute_dtype(y),
    )
    outputs = (run.out.reshape(y.shape), None if per_row is None else per_row.reshape(y.shape[:-1]))
    return outputs if dsink is None else (*outputs, dsink.reshape(y.shape[:-1]))
