"""Fused top-k softmax: softmax over the k largest allowed scores of each row, 0 elsewhere.

The k-th largest score is found without sorting, by a radix search on integer
keys ordered like the scores (the float's bits with the magnitude bits flipped for
negatives; NaN above everything, as ``torch.topk`` ranks it), keeping the largest key
``t`` with ``count(key >= t) >= k``: one bit per step on a row held in registers (a
reduction each), four bits per pass on a streamed row (a packed digit histogram each,
:func:`_kth_key_streamed`), which stops at a candidate with exactly k keys at or above it.  All scores above
``t`` are kept, and ties at ``t`` are kept in index order until k are kept: among
tied scores the lowest index wins (-0.0 and 0.0 tie).  ``k`` is an int, or a
fraction: ``max(1, ceil(k n - 1e-9))`` of the ``n`` allowed positions, counted in the
kernel (computed in float64 as the reference does).
In a row holding +inf, ``n`` still counts every allowed position and the kept ones
are (at most all of) the +inf positions.

Scores are shifted before they are scaled: by the largest kept score for
``1 / temperature >= 0``, by the smallest (the k-th) otherwise.  The backward is
softmax's on the kept set (:func:`.softmax.softmax_backward`).

With a sink (``kernels/README.md``) the search runs on the extended row ``[x, sink]``:
the sink competes for a slot and, at the highest index, loses every tie; ``n`` of a
fractional k counts the real positions only, an integer k counts slots over the real
positions and the sink together.

With a cap (``kernels/README.md``, "Soft-capping") the search and the weights run on
``c(x)``, capped as it is read (+inf scores become the cap, so no row holds +inf but
through its sink).
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
    load_row_param,
    load_sink_score,
    load_softcap,
    row_extent,
    scaled,
    scan_row,
    sink_taken,
    store_row,
    store_sink,
)

__all__ = ["topk_forward"]


@triton.jit
def _order_keys(x, allowed, KEY: tl.constexpr, KEY_BITS: tl.constexpr):
    """Integer keys sorting like ``x``: NaN largest, positions not allowed smallest."""
    key_max: tl.constexpr = (1 << (KEY_BITS - 1)) - 1
    key_min: tl.constexpr = -(1 << (KEY_BITS - 1))
    bits = tl.where(x == 0, 0.0, x).to(KEY, bitcast=True)  # -0.0 ties with 0.0
    keys = bits ^ ((bits >> (KEY_BITS - 1)) & key_max)
    keys = tl.where(x != x, key_max, keys)
    return tl.where(allowed, keys, key_min)


@triton.jit
def _key_value(key, COMPUTE: tl.constexpr, KEY_BITS: tl.constexpr):
    """The score whose key is ``key`` (the map of :func:`_order_keys` is its own inverse)."""
    key_max: tl.constexpr = (1 << (KEY_BITS - 1)) - 1
    return (key ^ ((key >> (KEY_BITS - 1)) & key_max)).to(COMPUTE, bitcast=True)


@triton.jit
def _wanted_count(count, k, IS_FRACTION: tl.constexpr):
    """Slots asked for (float64): ``k``, or ``max(1, ceil(k n - 1e-9))`` for a fraction k of ``n = count``."""
    if IS_FRACTION:
        wanted = tl.maximum(tl.ceil(count.to(tl.float64) * k - 1e-9), 1.0)
    else:
        wanted = k
    return wanted


@triton.jit
def _keep_count(count, k, IS_FRACTION: tl.constexpr):
    """Positions kept: ``min(k, n)``, or ``min(max(1, ceil(k * n)), n)`` for a fraction k."""
    return tl.minimum(_wanted_count(count, k, IS_FRACTION), count.to(tl.float64)).to(tl.int32)


@triton.jit
def _sink_keep_count(count, available, k, IS_FRACTION: tl.constexpr):
    """Positions kept in a row with a sink: :func:`_wanted_count` of ``n = count``, at most ``available``.

    ``n`` does not count the sink (a fraction is of the real positions); ``available``, the
    positions that may be kept after the +inf rule, does (an integer k takes slots over both).
    """
    return tl.minimum(_wanted_count(count, k, IS_FRACTION), available.to(tl.float64)).to(tl.int32)


@triton.jit
def _count_at_least(threshold, keys):
    """Positions of a row held in registers whose key is ``>= threshold`` (padding and masked keys are smallest)."""
    return tl.sum((keys >= threshold).to(tl.int32), 0)


@triton.jit
def _kth_key(keep, keys, KEY: tl.constexpr, KEY_BITS: tl.constexpr):
    """The largest key t with ``count(key >= t) >= keep`` (the keep-th largest key) of a row in registers, bit by bit.

    One reduction over the row per bit: the keys never leave the registers.
    """
    key_min: tl.constexpr = -(1 << (KEY_BITS - 1))
    # The sign bit first: t >= 0 or t < 0; then t + 2^bit never overflows.
    threshold = tl.zeros((), KEY)
    threshold = tl.where(_count_at_least(threshold, keys) >= keep, threshold, key_min)
    one = tl.full((), 1, KEY)
    for step in range(KEY_BITS - 1):
        candidate = threshold + (one << (one * (KEY_BITS - 2 - step)))
        threshold = tl.where(_count_at_least(candidate, keys) >= keep, candidate, threshold)
    return threshold


@triton.jit
def _load_kept_block(X, row, cols, length, x_row_stride, masking, sink, softcap, posinf_row,
                     BOOL_MASK, CAUSAL, LENGTHS, HAS_SINK, SOFTCAP, COMPUTE):
    """A streamed block's scores and allowed positions, the +inf rule applied (:func:`.blocks.keep_posinf`)."""
    x, allowed = load_block(
        X, row, cols, length, x_row_stride, masking, sink, softcap,
        BOOL_MASK, CAUSAL, LENGTHS, HAS_SINK, SOFTCAP, COMPUTE
    )
    return keep_posinf(x, allowed, posinf_row)


STREAMED_DIGIT_BITS = 4
"""Bits of the k-th key settled per pass over a streamed row (a divisor of 32)."""


@triton.jit
def _digit_counts(X, row, length, x_row_stride, masking, sink, softcap, posinf_row, prefix, shift, BLOCK,
                  BOOL_MASK, CAUSAL, LENGTHS, HAS_SINK, SOFTCAP, COMPUTE, KEY, UKEY, KEY_BITS, DIGIT_BITS):
    """One pass over a streamed row: for each digit ``d``, the positions whose key is ``>= prefix | d << shift``.

    ``prefix`` holds no bit below ``shift + DIGIT_BITS``.  A key at or above ``prefix``
    counts at digit ``min((key - prefix) >> shift, top)`` of a per-block histogram packed
    two 16-bit counts to a 32-bit word (a block has fewer than 2^16 positions): one
    reduction over the block per word, ``2^DIGIT_BITS / 2`` of them; the suffix sums of
    the histogram are the counts.
    """
    tl.static_assert(BLOCK < 65536, "16-bit digit counts per block")
    key_min: tl.constexpr = -(1 << (KEY_BITS - 1))
    top: tl.constexpr = (1 << DIGIT_BITS) - 1
    digits = tl.arange(0, 1 << DIGIT_BITS)
    histogram = tl.zeros((1 << DIGIT_BITS,), tl.int32)
    for start in range(0, row_extent(length, HAS_SINK), BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x, allowed = _load_kept_block(X, row, cols, length, x_row_stride, masking, sink, softcap, posinf_row,
                                       BOOL_MASK, CAUSAL, LENGTHS, HAS_SINK, SOFTCAP, COMPUTE)
        keys = (_order_keys(x, allowed, KEY, KEY_BITS) ^ key_min).to(UKEY, bitcast=True)
        digit = tl.minimum((keys - prefix) >> shift.to(UKEY), top).to(tl.int32)
        one = tl.where(keys >= prefix, (1 << ((digit & 1) * 16)).to(tl.uint32), 0)
        word = digit >> 1
        for index in tl.static_range(1 << (DIGIT_BITS - 1)):
            packed = tl.sum(tl.where(word == index, one, 0).to(tl.uint32), 0)
            histogram += tl.where(digits == 2 * index, (packed & 0xFFFF).to(tl.int32), 0)
            histogram += tl.where(digits == 2 * index + 1, (packed >> 16).to(tl.int32), 0)
    return tl.sum(histogram, 0) - tl.cumsum(histogram, 0) + histogram


@triton.jit
def _kth_key_streamed(X, row, length, x_row_stride, masking, sink, softcap, posinf_row, keep, BLOCK,
                      BOOL_MASK, CAUSAL, LENGTHS, HAS_SINK, SOFTCAP, COMPUTE, KEY, KEY_BITS, DIGIT_BITS):
    """A key ``t`` with ``count(key >= t) >= keep`` and ``count(key > t) < keep`` for a row streamed from memory.

    A radix select, ``DIGIT_BITS`` (:data:`STREAMED_DIGIT_BITS`) bits of the keep-th largest key per pass
    (:func:`_digit_counts`), most significant first: 8 passes for float32 scores instead of
    32 one-bit ones.  It stops early at a candidate with exactly ``keep`` keys at or above it
    (the ties at ``t`` then number 0 and ``keep`` keys lie above it, which the output passes
    handle as any threshold): the lower digits only separate the keep-th key from the next.
    Not at a candidate that is no score's key (NaN or below -inf).
    """
    key_min: tl.constexpr = -(1 << (KEY_BITS - 1))
    UKEY: tl.constexpr = tl.uint64 if KEY_BITS == 64 else tl.uint32
    digits = tl.arange(0, 1 << DIGIT_BITS)
    prefix = tl.zeros((), UKEY)
    level = 0
    cut = tl.zeros((), tl.int1)
    while (level < KEY_BITS // DIGIT_BITS) & ~cut:
        shift = KEY_BITS - DIGIT_BITS * (level + 1)
        counts = _digit_counts(X, row, length, x_row_stride, masking, sink, softcap, posinf_row, prefix, shift, BLOCK,
                               BOOL_MASK, CAUSAL, LENGTHS, HAS_SINK, SOFTCAP, COMPUTE, KEY, UKEY, KEY_BITS, DIGIT_BITS)
        digit = tl.sum((counts >= keep).to(tl.int32), 0) - 1
        at = tl.sum(tl.where(digits == digit, counts, 0), 0)
        prefix = prefix | (digit.to(UKEY) << shift)
        cut = (at == keep) & (_key_value(prefix.to(KEY, bitcast=True) ^ key_min, COMPUTE, KEY_BITS) > float("-inf"))
        level += 1
    return prefix.to(KEY, bitcast=True) ^ key_min


@triton.jit
def _least_at_or_above(X, row, length, x_row_stride, masking, sink, softcap, posinf_row, threshold, BLOCK,
                       BOOL_MASK, CAUSAL, LENGTHS, HAS_SINK, SOFTCAP, COMPUTE, KEY, KEY_BITS):
    """The least allowed score of a streamed row whose key is ``>= threshold`` (+inf if none): one more pass."""
    least = tl.full((), float("inf"), COMPUTE)
    for start in range(0, row_extent(length, HAS_SINK), BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x, allowed = _load_kept_block(X, row, cols, length, x_row_stride, masking, sink, softcap, posinf_row,
                                       BOOL_MASK, CAUSAL, LENGTHS, HAS_SINK, SOFTCAP, COMPUTE)
        kept = allowed & (_order_keys(x, allowed, KEY, KEY_BITS) >= threshold)
        least = tl.minimum(least, tl.min(tl.where(kept, x, float("inf")), 0))
    return least


@triton.jit
def _topk_forward_kernel(
    X, OUT, MULTIPLIER, k_param, temperature_values, temperature_stride,
    mask_ptr, mask_batch_stride, mask_head_stride, mask_query_stride, mask_col_stride,
    lengths_ptr, lengths_stride, rows_per_batch, num_queries, diagonal,
    sink_values, sink_stride, sink_period, sink_count, SINK_WEIGHT, softcap_value,
    length, x_row_stride, out_row_stride,
    BLOCK: tl.constexpr, SINGLE: tl.constexpr, IS_FRACTION: tl.constexpr,
    BOOL_MASK: tl.constexpr, CAUSAL: tl.constexpr, LENGTHS: tl.constexpr, HAS_SINK: tl.constexpr, SOFTCAP: tl.constexpr,
    COMPUTE: tl.constexpr, KEY: tl.constexpr, KEY_BITS: tl.constexpr, DIGIT_BITS: tl.constexpr,
    WEIGHTS_ONLY: tl.constexpr,
):
    """Top-k softmax of one row; also writes ``1 / temperature`` (0 in +inf rows) for the backward.

    Passes over the row and bytes moved: a single-block row reads x once and writes
    y once, ``L * (in + out)``, plus a per-row scalar; the radix search runs on the
    keys in registers.  A multi-pass row reads x at most ``KEY_BITS / 4 + 3`` times
    (statistics, one pass per 4-bit digit, sums, write; one more with a negative
    ``1 / temperature``, for the least kept score): ``L * ((KEY_BITS / 4 + 3) in + out)``,
    11 reads for float32 (35 with one bit per pass); the search stops early once
    a candidate has exactly k keys at or above it (a float32 model, N(0, 1) rows of 16k
    and 64k keys, k = 64 or 6 %: after 4.7-5.9 of its 8 passes on average).  A bool
    mask adds one byte per element and pass.  ``HAS_SINK``: the sink is position
    ``length`` of every pass (one scalar read, held in a register) and its weight one
    more per-row scalar written; no extra pass.
    ``SOFTCAP``: x is capped as it is read in every pass (one
    scalar read per row, one ``exp`` and one division per element and pass); no extra
    pass or byte.
    """
    masking = (mask_ptr, mask_batch_stride, mask_head_stride, mask_query_stride, mask_col_stride, lengths_ptr,
               lengths_stride, rows_per_batch, num_queries, diagonal)
    row = tl.program_id(0).to(tl.int64)
    scale = 1.0 / load_row_param(temperature_values, temperature_stride, row).to(COMPUTE)
    k = tl.load(k_param)
    sink = load_sink_score(sink_values, sink_stride, sink_period, sink_count, row, HAS_SINK, COMPUTE)
    softcap = load_softcap(softcap_value, SOFTCAP, COMPUTE)
    sink_weight = tl.zeros((), COMPUTE)
    if SINGLE:
        cols = tl.arange(0, BLOCK)
        x, allowed, posinf_row, nan_row, count = load_row(
            X, row, cols, length, x_row_stride, masking, sink, softcap,
            BOOL_MASK, CAUSAL, LENGTHS, HAS_SINK, SOFTCAP, COMPUTE
        )
        if HAS_SINK:
            keep = _sink_keep_count(count, tl.sum(allowed.to(tl.int32), 0), k, IS_FRACTION)
        else:
            keep = tl.minimum(_keep_count(count, k, IS_FRACTION), tl.sum(allowed.to(tl.int32), 0))
        keys = _order_keys(x, allowed, KEY, KEY_BITS)
        threshold = _kth_key(keep, keys, KEY, KEY_BITS)
        greater = keys > threshold
        ties = keys == threshold
        tie_slots = keep - tl.sum(greater.to(tl.int32), 0)
        kept = allowed & (greater | (ties & (tl.cumsum(ties.to(tl.int32), 0) <= tie_slots)))
        any_kept = keep > 0
        top = tl.where(any_kept, tl.max(tl.where(kept, x, float("-inf")), 0), 0.0)
        kth = tl.where(any_kept, tl.min(tl.where(kept, x, float("inf")), 0), 0.0)
        e = tl.where(kept, tl.exp(scaled(x - tl.where(scale >= 0, top, kth), scale)), 0.0)
        total = tl.sum(e, 0)
        y = tl.where(kept, e / tl.where(total > 0, total, 1.0), 0.0)
        store_row(OUT, row, cols, length, out_row_stride, y, nan_row)
        if HAS_SINK:
            sink_weight = at_sink(cols, length, y)
    else:
        count, posinf_count, nan_count, max_x, _, _, _ = scan_row(
            X, row, length, x_row_stride, masking, sink, softcap, 1.0, BLOCK, False,
            BOOL_MASK, CAUSAL, LENGTHS, HAS_SINK, SOFTCAP, COMPUTE,
        )
        posinf_row = posinf_count > 0
        nan_row = nan_count > 0
        if HAS_SINK:
            available = tl.where(posinf_row, posinf_count, count + sink_taken(sink))
            keep = _sink_keep_count(count, available, k, IS_FRACTION)
        else:
            keep = tl.minimum(_keep_count(count, k, IS_FRACTION), tl.where(posinf_row, posinf_count, count))
        threshold = _kth_key_streamed(X, row, length, x_row_stride, masking, sink, softcap, posinf_row, keep, BLOCK,
                                      BOOL_MASK, CAUSAL, LENGTHS, HAS_SINK, SOFTCAP, COMPUTE, KEY, KEY_BITS, DIGIT_BITS)
        kth = tl.where(keep > 0, _key_value(threshold, COMPUTE, KEY_BITS), 0.0)
        if scale < 0:  # the shift is the least kept score, and a threshold the search cut at may lie below it
            least = _least_at_or_above(X, row, length, x_row_stride, masking, sink, softcap, posinf_row, threshold,
                                       BLOCK, BOOL_MASK, CAUSAL, LENGTHS, HAS_SINK, SOFTCAP, COMPUTE, KEY, KEY_BITS)
            kth = tl.where(keep > 0, least, 0.0)
        top = tl.where(max_x == float("-inf"), 0.0, max_x)
        shift = tl.where(scale >= 0, top, kth)
        above_sum = tl.zeros((), COMPUTE)
        above = tl.zeros((), tl.int32)
        for start in range(0, row_extent(length, HAS_SINK), BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x, allowed = _load_kept_block(X, row, cols, length, x_row_stride, masking, sink, softcap, posinf_row,
                                           BOOL_MASK, CAUSAL, LENGTHS, HAS_SINK, SOFTCAP, COMPUTE)
            greater = _order_keys(x, allowed, KEY, KEY_BITS) > threshold
            above += tl.sum(greater.to(tl.int32), 0)
            above_sum += tl.sum(tl.where(greater, tl.exp(scaled(x - shift, scale)), 0.0), 0)
        tie_slots = keep - above
        total = above_sum + tie_slots.to(COMPUTE) * tl.exp(scaled(kth - shift, scale))
        total = tl.where(total > 0, total, 1.0)
        ties_before = tl.zeros((), tl.int32)
        for start in range(0, row_extent(length, HAS_SINK), BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x, allowed = _load_kept_block(X, row, cols, length, x_row_stride, masking, sink, softcap, posinf_row,
                                           BOOL_MASK, CAUSAL, LENGTHS, HAS_SINK, SOFTCAP, COMPUTE)
            keys = _order_keys(x, allowed, KEY, KEY_BITS)
            ties = allowed & (keys == threshold)
            rank = ties_before + tl.cumsum(ties.to(tl.int32), 0)
            kept = allowed & ((keys > threshold) | (ties & (rank <= tie_slots)))
            y = tl.where(kept, tl.exp(scaled(x - shift, scale)) / total, 0.0)
            store_row(OUT, row, cols, length, out_row_stride, y, nan_row)
            ties_before += tl.sum(ties.to(tl.int32), 0)
            if HAS_SINK:
                sink_weight += at_sink(cols, length, y)
    if not WEIGHTS_ONLY:
        tl.store(MULTIPLIER + row, tl.where(posinf_row, 0.0, scale))
    if HAS_SINK:
        store_sink(SINK_WEIGHT, row, sink_weight, nan_row)


@replay.replayable
def topk_forward(
    x: Tensor, mask: rules.RowMask, k: float, is_fraction: bool, temperature: float | Tensor,
    sink: Tensor | None = None, softcap: float | None = None, weights_only: bool = False,
    out_dtype: torch.dtype | None = None,
) -> tuple[Tensor, ...]:
    """Softmax of ``x / temperature`` over the kept positions of each row, exact zeros elsewhere.

    Args:
        x: scores ``(..., L)``, float16/bfloat16/float32/float64.
        mask: which positions each row may use.
        k: positions to keep, ``min(k, n)`` of the ``n`` allowed ones; with ``is_fraction``
            (``0 < k < 1``) ``max(1, ceil(k n - 1e-9))``.  Ties at the k-th value: the
            lowest index wins.
        is_fraction: read ``k`` as a fraction.
        temperature: python number or tensor ``(..., 1)`` broadcastable to ``x``.
        sink: the score of a virtual key after each row, ``x.shape[:-1]`` (or ``(..., 1)``), or
            None: top-k of the extended row ``[x, sink]`` (the sink may take a slot and loses
            every tie; ``n`` of a fraction does not count it, an integer ``k`` does).
        softcap: a cap ``> 0``, or None: top-k of ``c(x) = softcap tanh(x / softcap)``
            (``c(-inf) = -inf``, ``c(+inf) = softcap``; the sink is not capped).
        weights_only: skip what only a backward reads: ``multiplier`` is None (one allocation
            and one store per row less).
        out_dtype: the weights' dtype, ``x``'s by default (the decoding route's float32 scores
            give their weights in the query's half dtype, rounded as ``Tensor.to`` rounds).

    Returns:
        ``(y, multiplier)``: weights like ``x``; ``1 / temperature`` per row ``x.shape[:-1]``,
        0 in rows holding +inf.  With a ``sink``, ``(y, multiplier, sink_weight)``: the sink's
        weight per row.

    Raises:
        ValueError: ``sink`` of another shape, or a ``softcap`` that is not a finite number > 0.
    """
    run = launch.prepare(x, sink is not None, out_dtype)
    multiplier = None if weights_only else run.row_stats()
    sink_weight = run.row_stats() if sink is not None else None
    unwritten = run.out  # a pointer the kernel never writes through (WEIGHTS_ONLY, or no sink)
    masking = launch.mask_args(mask, x)
    wide = x.dtype == torch.float64
    k_value = launch.constant(float(k), torch.float64, x.device)  # kept: no fill kernel per call
    launch.run(
        _topk_forward_kernel, run,
        run.rows, run.out, unwritten if multiplier is None else multiplier, k_value,
        *launch.row_param(temperature, x), *masking.args,
        *launch.sink_scores(sink, x), unwritten if sink_weight is None else sink_weight,
        launch.softcap_arg(softcap, x),
        run.length, run.rows.stride(0), run.out.stride(0),
        BLOCK=run.config.block, SINGLE=run.config.single, IS_FRACTION=bool(is_fraction), HAS_SINK=sink is not None,
        SOFTCAP=softcap is not None, COMPUTE=launch.compute_dtype(x), KEY=tl.int64 if wide else tl.int32,
        KEY_BITS=64 if wide else 32, DIGIT_BITS=STREAMED_DIGIT_BITS, WEIGHTS_ONLY=multiplier is None,
        **masking.constants,
    )
    outputs = (run.out.reshape(x.shape), None if multiplier is None else multiplier.reshape(x.shape[:-1]))
    return outputs if sink_weight is None else (*outputs, sink_weight.reshape(x.shape[:-1]))
