"""Device helpers shared by the kernels: a block of a row under its mask, +inf rows, row scans.

The shared rules of :mod:`attnorm.kernels.rules` live here once: ``load_block``
marks a position allowed when it lies inside the row, passes the mask and is not
-inf; ``keep_posinf`` rewrites a row holding +inf so that only its +inf positions
are allowed, each with score 0 (every normaliser is then uniform over them, the
limit of the finite case); a row holding NaN at an allowed position is written NaN
whole.  ``scaled`` is how every kernel applies a multiplier: to scores already
shifted by the row's max (``m >= 0``) or min (``m < 0``), so finite scores never
give NaN or +inf.

A sink (``kernels/README.md``, "A sink per row") is position ``length`` of its row
when the constexpr ``HAS_SINK`` is set: ``load_block`` puts the sink's score there and
allows it after the mask rules (unless it is -inf), so every row statistic, the +inf
and NaN rules and the writes see the extended row ``[x, sink]``; kernels walk
``row_extent`` positions, stores keep to ``cols < length`` and the sink's own value is
picked out by ``at_sink``.  The sink costs no memory traffic but its score (and one
per-row output): a streamed row whose length is a multiple of the block takes one more
step per pass for it, a block of masked loads.  Without ``HAS_SINK`` none of this is
compiled.

Soft-capping (``kernels/README.md``, "Soft-capping") happens in ``load_block`` too, when
the constexpr ``SOFTCAP`` is set: the row's scores become ``c(x) = cap tanh(x / cap)``
(``soft_cap``) as they are read, after the allowed positions are found and before the
sink is put in (the sink is not capped), so every rule and statistic after it sees the
capped row: ``c(+inf) = cap`` is finite, so +inf scores no longer make a +inf row.  The
cap is a runtime value (``load_softcap``); it costs no memory traffic but one scalar read
per row, and one ``exp`` and one division per score per pass.  Backwards carry ``dx``
through the cap with ``through_cap``, reading the raw scores.  Without ``SOFTCAP`` none of
this is compiled.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = [
    "at_sink",
    "capping_tanh",
    "keep_posinf",
    "load_block",
    "load_output_and_grad",
    "load_row",
    "load_row_param",
    "load_sink",
    "load_sink_score",
    "load_softcap",
    "row_extent",
    "scaled",
    "scan_row",
    "sink_taken",
    "soft_cap",
    "stable_tanh",
    "store_row",
    "store_sink",
    "through_cap",
]


@triton.jit
def load_row_param(values, stride, row):
    """Row ``row``'s value of a parameter passed as ``(values, stride)``."""
    return tl.load(values + row * stride)


@triton.jit
def load_sink(values, stride, row, HAS_SINK: tl.constexpr, COMPUTE: tl.constexpr):
    """Row ``row``'s sink value (its score; a backward's sink weight) passed as ``(values, stride)``, in ``COMPUTE``.

    0, never read, without ``HAS_SINK``.
    """
    sink = tl.zeros((), COMPUTE)
    if HAS_SINK:
        sink = load_row_param(values, stride, row).to(COMPUTE)
    return sink


@triton.jit
def load_sink_score(values, stride, period, count, row, HAS_SINK: tl.constexpr, COMPUTE: tl.constexpr):
    """Row ``row``'s sink score, passed as :func:`attnorm.kernels.triton.launch.sink_scores` gives it: read at
    ``values[(row // period) % count * stride]`` (a per-head sink of ``(B, H, Lq, L)`` scores, read in place:
    period ``Lq``, count ``H``), in ``COMPUTE``; 0, never read, without ``HAS_SINK``."""
    return load_sink(values, stride, row // period % count, HAS_SINK, COMPUTE)


@triton.jit
def row_extent(length, HAS_SINK: tl.constexpr):
    """Positions a kernel walks: the row's ``length``, and the sink at position ``length``."""
    if HAS_SINK:
        extent = length + 1
    else:
        extent = length
    return extent


@triton.jit
def sink_taken(sink):
    """1 when the sink takes part in its row (it is not -inf), else 0 (int32)."""
    return (sink != float("-inf")).to(tl.int32)


@triton.jit
def at_sink(cols, length, values):
    """The value at position ``length`` (the sink) of a block of ``values`` at ``cols``; 0 when it is not there."""
    return tl.sum(tl.where(cols == length, values, 0.0), 0)


@triton.jit
def scaled(shifted, multiplier):
    """``multiplier * shifted`` for scores shifted towards 0 by the row's extreme.

    The shifted scores are <= 0 when ``multiplier >= 0`` (>= 0 otherwise), so the
    product is never +inf; the difference may overflow to -inf (+inf), where a zero
    multiplier gives 0 instead of NaN.
    """
    return tl.where(multiplier == 0, 0.0, multiplier * shifted)


@triton.jit
def stable_tanh(x):
    """``tanh(x)`` as ``sign(x) (1 - e) / (1 + e)``, ``e = exp(-2|x|)`` in (0, 1]: never overflows.

    Absolute error a few ulps of 1 (the relative error grows as ``|x|`` falls below
    ``eps``, harmless where ``cap tanh(x / cap)`` is compared with scores of order 1).
    """
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def capping_tanh(u):
    """``tanh(u)`` to a few ulps relative for every ``u``.

    :func:`stable_tanh` computes ``1 - exp(-2|u|)``, which cancels for small ``|u|``
    (an absolute error of about ``eps``: ``cap * eps`` in ``cap tanh(x / cap)``, 5e-4 in
    float32 for a cap of 1e4); below ``|u| = 1/16`` the odd series to ``u^11``
    (truncation below ``4e-15`` relative) replaces it.
    """
    s = u * u
    series = 0.13333333333333333 + s * (-0.05396825396825397 + s * (0.021869488536155203 + s * -0.008863235529902197))
    series = u * (1.0 + s * (-0.3333333333333333 + s * series))
    return tl.where(tl.abs(u) < 0.0625, series, stable_tanh(u))


@triton.jit
def load_softcap(values, SOFTCAP: tl.constexpr, COMPUTE: tl.constexpr):
    """The cap, one element at ``values`` (:func:`attnorm.kernels.triton.launch.softcap_arg`), in ``COMPUTE``.

    1, never read, without ``SOFTCAP``.
    """
    softcap = tl.full((), 1.0, COMPUTE)
    if SOFTCAP:
        softcap = tl.load(values).to(COMPUTE)
    return softcap


@triton.jit
def soft_cap(x, softcap, SOFTCAP: tl.constexpr):
    """``c(x) = softcap tanh(x / softcap)`` under ``SOFTCAP`` (``x`` itself without).

    ``c(-inf) = -inf`` (a -inf score stays not allowed), ``c(+inf) = softcap``,
    ``c(NaN) = NaN``.
    """
    if SOFTCAP:
        x = tl.where(x == float("-inf"), x, softcap * capping_tanh(x / softcap))
    return x


@triton.jit
def through_cap(X, row, cols, length, x_row_stride, dx, softcap, SOFTCAP: tl.constexpr, COMPUTE: tl.constexpr):
    """A backward's ``dx`` at ``cols`` of ``row`` carried through the cap (``dx`` itself without ``SOFTCAP``).

    ``dx`` is the gradient with respect to ``c(x)``; it is multiplied by
    ``dc / dx = 1 - tanh(x / softcap)^2`` at the raw scores ``x``, read here (0 past
    the row).  The slope is 0 at ±inf (tanh is ±1 there) and at NaN, as in the reference.
    """
    if SOFTCAP:
        x = tl.load(X + row * x_row_stride + cols, mask=cols < length, other=0.0).to(COMPUTE)
        t = capping_tanh(x / softcap)
        dx = dx * tl.where(x == x, 1.0 - t * t, 0.0)
    return dx


@triton.jit
def load_block(X, row, cols, length, x_row_stride, masking, sink, softcap, BOOL_MASK, CAUSAL, LENGTHS, HAS_SINK,
               SOFTCAP, COMPUTE):
    """Scores of ``row`` at ``cols`` (in ``COMPUTE``) and whether each position is allowed.

    ``masking`` is the tuple of :class:`attnorm.kernels.triton.launch.MaskArgs`
    ``.args``; the causal diagonal and key lengths are evaluated from the row index,
    nothing is read for them but one key length per row.  With ``SOFTCAP`` the scores
    are :func:`soft_cap`'s ``c(x)``.  With ``HAS_SINK`` position ``length`` holds ``sink``
    (not capped), allowed whatever the mask says unless it is -inf.
    """
    (mask_ptr, mask_batch_stride, mask_head_stride, mask_query_stride, mask_col_stride, lengths_ptr, lengths_stride,
     rows_per_batch, num_queries, diagonal) = masking
    inside = cols < length
    x = tl.load(X + row * x_row_stride + cols, mask=inside, other=0.0).to(COMPUTE)
    allowed = inside & (x != float("-inf"))
    if BOOL_MASK:
        # Row (batch, head, query) of the scores reads the mask's row through its own strides (0 where it broadcasts)
        within = row % rows_per_batch
        mask_row = ((row // rows_per_batch) * mask_batch_stride + (within // num_queries) * mask_head_stride
                    + (within % num_queries) * mask_query_stride)
        permitted = tl.load(mask_ptr + mask_row + cols * mask_col_stride, mask=inside, other=0)
        allowed = allowed & (permitted != 0)
    if CAUSAL:
        allowed = allowed & (cols <= row % num_queries + diagonal)
    if LENGTHS:
        allowed = allowed & (cols < tl.load(lengths_ptr + (row // rows_per_batch) * lengths_stride))
    x = soft_cap(x, softcap, SOFTCAP)
    if HAS_SINK:
        sink_position = cols == length
        x = tl.where(sink_position, sink, x)
        allowed = tl.where(sink_position, x != float("-inf"), allowed)
    return x, allowed


@triton.jit
def keep_posinf(x, allowed, posinf_row):
    """Apply the +inf rule: in a +inf row only the +inf positions stay allowed.

    Also zeroes the scores of positions that are not allowed, so later arithmetic
    on them stays finite (results there are discarded).
    """
    posinf = allowed & (x == float("inf"))
    allowed = tl.where(posinf_row, posinf, allowed)
    x = tl.where(allowed & ~posinf, x, 0.0)
    return x, allowed


@triton.jit
def load_row(X, row, cols, length, x_row_stride, masking, sink, softcap, BOOL_MASK, CAUSAL, LENGTHS, HAS_SINK,
             SOFTCAP, COMPUTE):
    """A whole row (and its sink) in registers under the shared rules.

    Returns ``(x, allowed, posinf_row, nan_row, count)``: scores and allowed
    positions after the +inf rule, whether the row holds +inf and NaN (at allowed
    positions), and ``n``, the number of allowed positions before the +inf rule, the
    sink not counted (``sum(allowed)`` is the number after it, the sink's included).
    """
    x, allowed = load_block(
        X, row, cols, length, x_row_stride, masking, sink, softcap,
        BOOL_MASK, CAUSAL, LENGTHS, HAS_SINK, SOFTCAP, COMPUTE
    )
    count = tl.sum(allowed.to(tl.int32), 0)
    if HAS_SINK:
        count -= sink_taken(sink)
    posinf_row = tl.sum((allowed & (x == float("inf"))).to(tl.int32), 0) > 0
    nan_row = tl.sum((allowed & (x != x)).to(tl.int32), 0) > 0
    x, allowed = keep_posinf(x, allowed, posinf_row)
    return x, allowed, posinf_row, nan_row, count


@triton.jit
def store_row(OUT, row, cols, length, out_row_stride, values, nan_row):
    """Write one block of a row's output; a row holding NaN is written NaN at every position."""
    values = tl.where(nan_row, float("nan"), values)
    tl.store(OUT + row * out_row_stride + cols, values.to(OUT.dtype.element_ty), mask=cols < length)


@triton.jit
def store_sink(OUT, row, value, nan_row):
    """Write a row's sink value (its weight, or its gradient) to the per-row ``OUT``; NaN in a row holding NaN."""
    tl.store(OUT + row, tl.where(nan_row, float("nan"), value))


@triton.jit
def load_output_and_grad(Y, G, row, cols, length, y_row_stride, g_row_stride, sink_weight, HAS_SINK, COMPUTE):
    """A backward's inputs at ``cols`` of ``row``: the saved output and the incoming gradient (0 past the row).

    With ``HAS_SINK`` position ``length`` holds the sink's weight, with gradient 0.
    """
    inside = cols < length
    y = tl.load(Y + row * y_row_stride + cols, mask=inside, other=0.0).to(COMPUTE)
    g = tl.load(G + row * g_row_stride + cols, mask=inside, other=0.0).to(COMPUTE)
    if HAS_SINK:
        y = tl.where(cols == length, sink_weight, y)
    return y, g


@triton.jit
def scan_row(X, row, length, x_row_stride, masking, sink, softcap, scale, BLOCK, ONLINE_SUM, BOOL_MASK, CAUSAL,
             LENGTHS, HAS_SINK, SOFTCAP, COMPUTE):
    """First pass over a long row (and its sink): statistics of its allowed scores.

    Returns ``(count, posinf_count, nan_count, max_x, min_x, sum_below_max, sum_exp)``:
    ``count`` allowed positions (``n``: the sink not counted), ``posinf_count`` allowed
    positions holding +inf and ``nan_count`` NaN (the sink included in these and all
    that follow); extrema of the allowed finite scores; ``sum(x - max_x)`` over them
    (accumulated against the running max, so large scores do not cancel); and,
    when ``ONLINE_SUM``, ``sum exp(scale * (x - ref))`` with ``ref = max_x`` for
    ``scale >= 0`` and ``min_x`` otherwise (online, rescaled as ``ref`` moves).  In a
    row holding +inf the statistics are those of the +inf rule (every score 0; the
    sum of exponentials counts the +inf positions).
    """
    count = tl.zeros((), tl.int32)
    posinf_count = tl.zeros((), tl.int32)
    nan_count = tl.zeros((), tl.int32)
    max_x = tl.full((), float("-inf"), COMPUTE)
    min_x = tl.full((), float("inf"), COMPUTE)
    sum_below_max = tl.zeros((), COMPUTE)
    sum_exp = tl.zeros((), COMPUTE)
    for start in range(0, row_extent(length, HAS_SINK), BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x, allowed = load_block(
            X, row, cols, length, x_row_stride, masking, sink, softcap,
            BOOL_MASK, CAUSAL, LENGTHS, HAS_SINK, SOFTCAP, COMPUTE
        )
        posinf = allowed & (x == float("inf"))
        nan = allowed & (x != x)
        finite = allowed & ~posinf & ~nan
        seen = count - posinf_count - nan_count
        count += tl.sum(allowed.to(tl.int32), 0)
        posinf_count += tl.sum(posinf.to(tl.int32), 0)
        nan_count += tl.sum(nan.to(tl.int32), 0)
        new_max = tl.maximum(max_x, tl.max(tl.where(finite, x, float("-inf")), 0))
        new_min = tl.minimum(min_x, tl.min(tl.where(finite, x, float("inf")), 0))
        rebase = tl.where(seen > 0, seen.to(COMPUTE) * (max_x - new_max), 0.0)
        sum_below_max += rebase + tl.sum(tl.where(finite, x - new_max, 0.0), 0)
        if ONLINE_SUM:
            old_ref = tl.where(scale >= 0, max_x, min_x)
            new_ref = tl.where(scale >= 0, new_max, new_min)
            rescale = tl.where(seen > 0, tl.exp(scaled(old_ref - new_ref, scale)), 1.0)
            terms = tl.where(finite, tl.exp(scaled(x - new_ref, scale)), 0.0)
            sum_exp = sum_exp * rescale + tl.sum(terms, 0)
        max_x = new_max
        min_x = new_min
    if HAS_SINK:
        count -= sink_taken(sink)
    posinf_row = posinf_count > 0
    max_x = tl.where(posinf_row, 0.0, max_x)
    min_x = tl.where(posinf_row, 0.0, min_x)
    sum_below_max = tl.where(posinf_row, 0.0, sum_below_max)
    sum_exp = tl.where(posinf_row, posinf_count.to(COMPUTE), sum_exp)
    return count, posinf_count, nan_count, max_x, min_x, sum_below_max, sum_exp
