"""Fused Self-Adjusted Softmax (Zheng et al., 2025, arXiv 2502.18277): ``y = phi(x) softmax(x)``.

``phi(x) = x`` (plain) or ``(x - low) / (high - low)`` with ``low = min(min x, 0)``,
``high = max(max x, 0)`` over the allowed finite scores (normalized; ``phi = 0`` when
``high == low``).  The span is computed without overflow or underflow: on halved
scores when ``high - low`` exceeds the dtype's range, on scores scaled by ``2^64``
when it is tiny (denormal spans would otherwise give ``1 / span = inf``).  A +inf
row gives the softmax limit: uniform weights (normalized) or +inf on the +inf
positions (plain).

The output does not determine ``x`` (``x w`` mixes both), so the backward takes
the input ``x`` and per-row stats ``(c0, c1, low, high, gate)`` (``gate`` 0 in
rows holding +inf or fully masked, whose gradient is 0) and rebuilds
``w = exp((x - c0) - c1)``.  With ``P = sum(g phi w)`` and ``Q = sum(g w)``:
``dx_j = w_j (g_j phi_j - P) + g_j w_j phi'`` where ``phi' = 1`` (plain) or
``1 / span`` plus the paths through ``low`` and ``high``: ``(P - Q) / span`` shared
by the positions attaining ``low`` and ``-P / span`` by those attaining ``high``
(as torch's amin/amax and clamp gradients share them).

With a sink (``kernels/README.md``) both run on the extended row ``[x, sink]`` (the
sink takes part in ``max``, ``min``, ``low``, ``high`` and the softmax sum; its
gradient is 0): its output value and the gradient reaching its score come out per row.
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
    load_row,
    load_sink_score,
    load_softcap,
    row_extent,
    scan_row,
    sink_taken,
    store_row,
    store_sink,
    through_cap,
)

__all__ = ["self_adjusted_backward", "self_adjusted_forward"]

_STATS = 5  # c0, c1, low, high, gate


@triton.jit
def _span(low, high):
    """``(scale, scaled span)``: ``phi = (x scale - low scale) / scaled span`` never overflows or divides by a denormal.

    ``scale`` is 1/2 when ``high - low`` overflows, ``2^64`` when it is below ``2^-60``
    (exact: powers of two), else 1.
    """
    span = high - low
    scale = tl.where(span == float("inf"), 0.5, tl.where(span < 8.673617379884035e-19, 18446744073709551616.0, 1.0))
    return scale, high * scale - low * scale


@triton.jit
def _factor(x, low, scale, scaled_span, NORMALIZED: tl.constexpr):
    """``phi(x)``: ``x`` or its min-max normalised form (0 when the span is 0)."""
    factor = x
    if NORMALIZED:
        positive = scaled_span > 0
        factor = tl.where(positive, (x * scale - low * scale) / tl.where(positive, scaled_span, 1.0), 0.0)
    return factor


@triton.jit
def _output(x, allowed, weights, low, high, posinf_row, NORMALIZED: tl.constexpr):
    scale, scaled_span = _span(low, high)
    out = _factor(x, low, scale, scaled_span, NORMALIZED) * weights
    if NORMALIZED:
        out = tl.where(posinf_row, weights, out)
    else:
        out = tl.where(posinf_row, float("inf"), out)
    return tl.where(allowed, out, 0.0)


@triton.jit
def _self_adjusted_forward_kernel(
    X, OUT, STATS,
    mask_ptr, mask_batch_stride, mask_head_stride, mask_query_stride, mask_col_stride,
    lengths_ptr, lengths_stride, rows_per_batch, num_queries, diagonal,
    sink_values, sink_stride, sink_period, sink_count, SINK_WEIGHT, softcap_value,
    length, x_row_stride, out_row_stride,
    BLOCK: tl.constexpr, SINGLE: tl.constexpr, NORMALIZED: tl.constexpr,
    BOOL_MASK: tl.constexpr, CAUSAL: tl.constexpr, LENGTHS: tl.constexpr, HAS_SINK: tl.constexpr, SOFTCAP: tl.constexpr,
    COMPUTE: tl.constexpr, WEIGHTS_ONLY: tl.constexpr,
):
    """SA-Softmax of one row; writes its stats ``(c0, c1, low, high, gate)`` for the backward (not ``WEIGHTS_ONLY``).

    Passes over the row and bytes moved: a single-block row reads x once and writes
    the output once, ``L * (in + out)``, plus 5 per-row scalars (4 bytes each, 8 for
    float64); a multi-pass row reads x twice (online max and sum, then the write),
    ``L * (2 in + out)``.  A bool mask adds one byte per element and pass.
    ``HAS_SINK``: the sink is position ``length`` of every pass (one scalar read, held
    in a register) and its output value one more per-row scalar written; no extra pass.
    ``SOFTCAP``: x is capped as it is read in every pass (one
    scalar read per row, one ``exp`` and one division per element and pass); no extra
    pass or byte.
    """
    masking = (mask_ptr, mask_batch_stride, mask_head_stride, mask_query_stride, mask_col_stride, lengths_ptr,
               lengths_stride, rows_per_batch, num_queries, diagonal)
    row = tl.program_id(0).to(tl.int64)
    sink = load_sink_score(sink_values, sink_stride, sink_period, sink_count, row, HAS_SINK, COMPUTE)
    softcap = load_softcap(softcap_value, SOFTCAP, COMPUTE)
    sink_weight = tl.zeros((), COMPUTE)
    if SINGLE:
        cols = tl.arange(0, BLOCK)
        x, allowed, posinf_row, nan_row, _ = load_row(
            X, row, cols, length, x_row_stride, masking, sink, softcap,
            BOOL_MASK, CAUSAL, LENGTHS, HAS_SINK, SOFTCAP, COMPUTE
        )
        live = tl.sum(allowed.to(tl.int32), 0) > 0
        top = tl.where(live, tl.max(tl.where(allowed, x, float("-inf")), 0), 0.0)
        e = tl.where(allowed, tl.exp(x - top), 0.0)
        total = tl.sum(e, 0)
        low = tl.minimum(tl.min(tl.where(allowed, x, float("inf")), 0), 0.0)
        high = tl.maximum(top, 0.0)
        out = _output(x, allowed, e / tl.where(total > 0, total, 1.0), low, high, posinf_row, NORMALIZED)
        store_row(OUT, row, cols, length, out_row_stride, out, nan_row)
        if HAS_SINK:
            sink_weight = at_sink(cols, length, out)
    else:
        count, posinf_count, nan_count, top, min_x, _, total = scan_row(
            X, row, length, x_row_stride, masking, sink, softcap, 1.0, BLOCK, True,
            BOOL_MASK, CAUSAL, LENGTHS, HAS_SINK, SOFTCAP, COMPUTE,
        )
        posinf_row = posinf_count > 0
        nan_row = nan_count > 0
        if HAS_SINK:
            count += sink_taken(sink)
        live = count > 0
        top = tl.where(top == float("-inf"), 0.0, top)
        low = tl.minimum(min_x, 0.0)
        high = tl.maximum(top, 0.0)
        for start in range(0, row_extent(length, HAS_SINK), BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x, allowed = load_block(
                X, row, cols, length, x_row_stride, masking, sink, softcap,
                BOOL_MASK, CAUSAL, LENGTHS, HAS_SINK, SOFTCAP, COMPUTE
            )
            x, allowed = keep_posinf(x, allowed, posinf_row)
            weights = tl.where(allowed, tl.exp(x - top) / tl.where(total > 0, total, 1.0), 0.0)
            out = _output(x, allowed, weights, low, high, posinf_row, NORMALIZED)
            store_row(OUT, row, cols, length, out_row_stride, out, nan_row)
            if HAS_SINK:
                sink_weight += at_sink(cols, length, out)
    if not WEIGHTS_ONLY:
        gate = live & ~posinf_row
        stats = STATS + row * 5  # a fresh (rows, 5) tensor
        tl.store(stats, tl.where(gate, top, 0.0))
        tl.store(stats + 1, tl.where(gate, tl.log(tl.where(gate, total, 1.0)), 0.0))
        tl.store(stats + 2, low)
        tl.store(stats + 3, high)
        tl.store(stats + 4, tl.where(gate, 1.0, 0.0))
    if HAS_SINK:
        store_sink(SINK_WEIGHT, row, sink_weight, nan_row)


@triton.jit
def _block_sums(x, allowed, g, c0, c1, low, high, NORMALIZED: tl.constexpr):
    """``sum(g phi w)``, ``sum(g w)`` and how many positions attain ``low`` and ``high``."""
    weights = tl.where(allowed, tl.exp((x - c0) - c1), 0.0)
    weighted_g = tl.where(allowed, g * weights, 0.0)
    scale, scaled_span = _span(low, high)
    phi = _factor(x, low, scale, scaled_span, NORMALIZED)
    at_low = tl.sum((allowed & (x == low)).to(tl.int32), 0)
    at_high = tl.sum((allowed & (x == high)).to(tl.int32), 0)
    return tl.sum(weighted_g * phi, 0), tl.sum(weighted_g, 0), at_low, at_high


@triton.jit
def _input_grad(x, allowed, g, c0, c1, low, high, phi_g_w, g_w, at_low, at_high, NORMALIZED: tl.constexpr):
    weights = tl.where(allowed, tl.exp((x - c0) - c1), 0.0)
    scale, scaled_span = _span(low, high)
    phi = _factor(x, low, scale, scaled_span, NORMALIZED)
    dx = weights * g * phi - weights * phi_g_w  # g phi - P could overflow; each product cannot
    if NORMALIZED:
        # Every 1 / span term is (value * scale) / scaled span: finite values never give NaN.
        positive = scaled_span > 0
        divisor = tl.where(positive, scaled_span, 1.0)
        through_low = tl.where(x == low, (phi_g_w - g_w) * scale / divisor / tl.maximum(at_low, 1), 0.0)
        through_high = tl.where(x == high, phi_g_w * scale / divisor / tl.maximum(at_high, 1), 0.0)
        dx += tl.where(positive, g * weights * scale / divisor + through_low - through_high, 0.0)
    else:
        dx += g * weights
    return tl.where(allowed, dx, 0.0)


@triton.jit
def _load_backward_block(
    X, G, row, cols, length, x_row_stride, g_row_stride, masking, sink, softcap, live,
    BOOL_MASK, CAUSAL, LENGTHS, HAS_SINK, SOFTCAP, COMPUTE,
):
    """Scores (0 where not used), used positions (none when not ``live``), NaN at allowed positions, the gradient.

    The sink's gradient (position ``length`` with ``HAS_SINK``) is 0.
    """
    x, allowed = load_block(
        X, row, cols, length, x_row_stride, masking, sink, softcap,
        BOOL_MASK, CAUSAL, LENGTHS, HAS_SINK, SOFTCAP, COMPUTE
    )
    nan = tl.sum((allowed & (x != x)).to(tl.int32), 0)
    allowed = tl.where(live, allowed, False)
    g = tl.load(G + row * g_row_stride + cols, mask=cols < length, other=0.0).to(COMPUTE)
    return tl.where(allowed, x, 0.0), allowed, nan, g


@triton.jit
def _self_adjusted_backward_kernel(
    X, G, DX, STATS, stats_row_stride, stats_col_stride,
    mask_ptr, mask_batch_stride, mask_head_stride, mask_query_stride, mask_col_stride,
    lengths_ptr, lengths_stride, rows_per_batch, num_queries, diagonal,
    sink_values, sink_stride, sink_period, sink_count, DSINK, softcap_value,
    length, x_row_stride, g_row_stride, dx_row_stride,
    BLOCK: tl.constexpr, SINGLE: tl.constexpr, NORMALIZED: tl.constexpr,
    BOOL_MASK: tl.constexpr, CAUSAL: tl.constexpr, LENGTHS: tl.constexpr, HAS_SINK: tl.constexpr, SOFTCAP: tl.constexpr,
    COMPUTE: tl.constexpr,
):
    """SA-Softmax backward of one row (formula in the module docstring); NaN rows give NaN.

    Passes over the row and bytes moved: a single-block row reads x and g once and
    writes dx once, ``3 L itemsize``, plus 5 per-row scalars (and the bool mask, if
    given); a multi-pass row reads x and g twice (sums, then dx), ``5 L itemsize``.
    ``HAS_SINK``: the row is ``[x, sink]`` with gradient ``[g, 0]``, the sink's score one
    scalar read per row and its gradient one written.  ``SOFTCAP``: the weights are
    recomputed from ``c(x)`` and ``dx`` is carried through the cap's slope at the raw x,
    read again where dx is written (the elements just read: from cache), no extra pass.
    """
    masking = (mask_ptr, mask_batch_stride, mask_head_stride, mask_query_stride, mask_col_stride, lengths_ptr,
               lengths_stride, rows_per_batch, num_queries, diagonal)
    row = tl.program_id(0).to(tl.int64)
    stats = STATS + row * stats_row_stride
    c0 = tl.load(stats).to(COMPUTE)
    c1 = tl.load(stats + stats_col_stride).to(COMPUTE)
    low = tl.load(stats + 2 * stats_col_stride).to(COMPUTE)
    high = tl.load(stats + 3 * stats_col_stride).to(COMPUTE)
    live = tl.load(stats + 4 * stats_col_stride) != 0
    sink = load_sink_score(sink_values, sink_stride, sink_period, sink_count, row, HAS_SINK, COMPUTE)
    softcap = load_softcap(softcap_value, SOFTCAP, COMPUTE)
    dsink = tl.zeros((), COMPUTE)
    if SINGLE:
        cols = tl.arange(0, BLOCK)
        x, allowed, nan, g = _load_backward_block(
            X, G, row, cols, length, x_row_stride, g_row_stride, masking, sink, softcap, live,
            BOOL_MASK, CAUSAL, LENGTHS, HAS_SINK, SOFTCAP, COMPUTE,
        )
        phi_g_w, g_w, at_low, at_high = _block_sums(x, allowed, g, c0, c1, low, high, NORMALIZED)
        dx = _input_grad(x, allowed, g, c0, c1, low, high, phi_g_w, g_w, at_low, at_high, NORMALIZED)
        if HAS_SINK:
            dsink = at_sink(cols, length, dx)
        dx = through_cap(X, row, cols, length, x_row_stride, dx, softcap, SOFTCAP, COMPUTE)
        store_row(DX, row, cols, length, dx_row_stride, dx, nan > 0)
    else:
        phi_g_w = tl.zeros((), COMPUTE)
        g_w = tl.zeros((), COMPUTE)
        at_low = tl.zeros((), tl.int32)
        at_high = tl.zeros((), tl.int32)
        nan = tl.zeros((), tl.int32)
        for start in range(0, row_extent(length, HAS_SINK), BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x, allowed, block_nan, g = _load_backward_block(
                X, G, row, cols, length, x_row_stride, g_row_stride, masking, sink, softcap, live,
                BOOL_MASK, CAUSAL, LENGTHS, HAS_SINK, SOFTCAP, COMPUTE,
            )
            block_phi_g_w, block_g_w, block_low, block_high = _block_sums(
                x, allowed, g, c0, c1, low, high, NORMALIZED
            )
            phi_g_w += block_phi_g_w
            g_w += block_g_w
            at_low += block_low
            at_high += block_high
            nan += block_nan
        for start in range(0, row_extent(length, HAS_SINK), BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x, allowed, _, g = _load_backward_block(
                X, G, row, cols, length, x_row_stride, g_row_stride, masking, sink, softcap, live,
                BOOL_MASK, CAUSAL, LENGTHS, HAS_SINK, SOFTCAP, COMPUTE,
            )
            dx = _input_grad(x, allowed, g, c0, c1, low, high, phi_g_w, g_w, at_low, at_high, NORMALIZED)
            if HAS_SINK:
                dsink += at_sink(cols, length, dx)
            dx = through_cap(X, row, cols, length, x_row_stride, dx, softcap, SOFTCAP, COMPUTE)
            store_row(DX, row, cols, length, dx_row_stride, dx, nan > 0)
    if HAS_SINK:
        store_sink(DSINK, row, dsink, nan > 0)


@replay.replayable
def self_adjusted_forward(
    x: Tensor, mask: rules.RowMask, normalized: bool, sink: Tensor | None = None, softcap: float | None = None,
    weights_only: bool = False, out_dtype: torch.dtype | None = None,
) -> tuple[Tensor, ...]:
    """SA-Softmax ``y = phi(x) softmax(x)`` over the allowed positions of each row.

    Args:
        x: scores ``(..., L)``, float16/bfloat16/float32/float64.
        mask: which positions each row may use.
        normalized: ``phi(x) = (x - low) / (high - low)`` instead of ``x``.
        sink: the score of a virtual key after each row, ``x.shape[:-1]`` (or ``(..., 1)``), or
            None: SA-Softmax of the extended row ``[x, sink]`` (the sink in ``low``, ``high``
            and the softmax).
        softcap: a cap ``> 0``, or None: SA-Softmax of ``c(x) = softcap tanh(x / softcap)``
            (``c(-inf) = -inf``, ``c(+inf) = softcap``; the sink is not capped).
        weights_only: skip what only a backward reads: ``stats`` is None (one allocation and
            five stores per row less).
        out_dtype: the weights' dtype, ``x``'s by default (the decoding route's float32 scores
            give their weights in the query's half dtype, rounded as ``Tensor.to`` rounds).

    Returns:
        ``(y, stats)``: weights like ``x``; ``stats`` of shape ``x.shape[:-1] + (5,)`` in the
        accumulation dtype, ``(c0, c1, low, high, gate)`` with softmax weights
        ``exp((x - c0) - c1)`` and ``gate`` 0 in rows holding +inf or fully masked.  With a
        ``sink``, ``(y, stats, sink_weight)``: the sink's output value ``phi(sink) w`` per row.
        With ``softcap`` the stats are those of ``c(x)``.

    Raises:
        ValueError: ``sink`` of another shape, or a ``softcap`` that is not a finite number > 0.
    """
    run = launch.prepare(x, sink is not None, out_dtype)
    stats = None if weights_only else run.row_stats(_STATS)
    sink_weight = run.row_stats() if sink is not None else None
    masking = launch.mask_args(mask, x)
    unwritten = run.out  # a pointer the kernel never writes through (WEIGHTS_ONLY, or no sink)
    launch.run(
        _self_adjusted_forward_kernel, run,
        run.rows, run.out, unwritten if stats is None else stats, *masking.args,
        *launch.sink_scores(sink, x), unwritten if sink_weight is None else sink_weight,
        launch.softcap_arg(softcap, x), run.length, run.rows.stride(0), run.out.stride(0),
        BLOCK=run.config.block, SINGLE=run.config.single, NORMALIZED=bool(normalized), HAS_SINK=sink is not None,
        SOFTCAP=softcap is not None, COMPUTE=launch.compute_dtype(x), WEIGHTS_ONLY=stats is None, **masking.constants,
    )
    outputs = (run.out.reshape(x.shape), None if stats is None else stats.reshape(*x.shape[:-1], _STATS))
    return outputs if sink_weight is None else (*outputs, sink_weight.reshape(x.shape[:-1]))


@replay.replayable
def self_adjusted_backward(
    x: Tensor, mask: rules.RowMask, grad: Tensor, stats: Tensor, normalized: bool, sink: Tensor | None = None,
    softcap: float | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """SA-Softmax's ``dx``, recomputing the softmax weights from ``x`` and ``stats``.

    Args:
        x: the forward's scores ``(..., L)``.
        mask: the forward's mask.
        grad: the incoming gradient, like ``x``.
        stats: the forward's stats ``x.shape[:-1] + (5,)``.
        normalized: the forward's variant.
        sink: the forward's sink scores, or None: the backward of the extended row ``[x, sink]``
            with gradient ``[g, 0]``.
        softcap: the forward's cap, or None: the weights are recomputed from ``c(x)`` (``x``
            raw, capped as it is read) and ``dx`` is carried through the cap,
            ``dx = (1 - tanh(x / softcap)^2) dc`` (0 where ``x`` is infinite).

    Returns:
        ``dx`` like ``x`` (0 in rows whose gate is 0, NaN in rows holding NaN).  With a
        ``sink``, ``(dx, dsink)``: the gradient of the sink's score per row ``x.shape[:-1]``,
        in the accumulation dtype.

    Raises:
        ValueError: ``sink`` of another shape, or a ``softcap`` that is not a finite number > 0.
    """
    run = launch.prepare(x, sink is not None)
    g = launch.rows_view(grad)
    row_stats = stats.reshape(-1, _STATS)
    dsink = run.row_stats() if sink is not None else None
    masking = launch.mask_args(mask, x)
    launch.run(
        _self_adjusted_backward_kernel, run,
        run.rows, g, run.out, row_stats, row_stats.stride(0), row_stats.stride(1), *masking.args,
        *launch.sink_scores(sink, x), run.out if dsink is None else dsink, launch.softcap_arg(softcap, x),
        run.length, run.rows.stride(0), g.stride(0), run.out.stride(0),
        BLOCK=run.config.block, SINGLE=run.config.single, NORMALIZED=bool(normalized), HAS_SINK=sink is not None,
        SOFTCAP=softcap is not None, COMPUTE=launch.compute_dtype(x), **masking.constants,
    )
    dx = run.out.reshape(x.shape)
    return dx if dsink is None else (dx, dsink.reshape(x.shape[:-1]))
