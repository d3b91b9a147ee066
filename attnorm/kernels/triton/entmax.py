"""Fused alpha-entmax (any alpha >= 1 per row) and sparsemax (alpha = 2).

Forward, per row: ``y_i = [z_i - tau]_+^p`` with ``z = (alpha - 1) x``,
``p = 1 / (alpha - 1)`` and ``tau`` such that ``sum(y) = 1`` (Peters, Niculae &
Martins, 2019), computed on scores shifted by their max (the map is
shift-invariant; large scores then do not cancel).  ``tau`` is found by Newton's
method on ``F(tau) = ||[z - tau]_+||_p = 1``, safeguarded by the bracket
``[max z - 1, max z - n^(1 - alpha)]`` (bisection when a step leaves it).  For
``p >= 1`` (alpha <= 2) ``F`` is convex, so Newton started below the root climbs to
it monotonically; the start is the larger of two lower bounds, ``max z - 1`` and
``(sum z - n^(2 - alpha)) / n`` (Hölder).  With ``p = 1`` (sparsemax) this is
Michelot's algorithm, finished exactly: ``tau = (sum_{z_i > tau} z_i - 1) / |support|``.
Other alphas are renormalised (row sums exact to rounding); alpha = 1 rows are
softmax.  No sort: a single-block row stays in registers across iterations.

For alpha > 2 (``p < 1``) a weight ``(z_i - tau)^p`` amplifies the rounding of
``z_i - tau``: at alpha = 10 a weight of 0.02 needs ``z_i - tau = 0.02^9 ~ 5e-16``,
below the resolution of ``tau``.  Those rows are finished in a well-conditioned
form: tau is written relative to the smallest support score ``x_s`` (the pivot)
as ``z_s - tau = w^(alpha - 1)``, ``w`` the pivot's own weight, so every weight
``y_i = ((alpha - 1)(x_i - x_s) + w^(alpha - 1))^p`` is a sum of two nonnegative
terms.  The pivot is the smallest score with ``F(x_s) = sum_i [(alpha - 1)(x_i - x_s)]_+^p < 1``,
found by walking from tau's estimate over neighbouring scores; ``w`` solves
``H(w) = sum_{x_i >= x_s} y_i = 1`` by Newton's method from above (``H`` is convex,
``1 <= H' <= |support|``).

With a sink (``kernels/README.md``) the forward runs on the extended row ``[x, sink]``
(the sink takes part in the max, the bracket's count and tau) and the backward on
``[y, sink_weight]`` with gradient ``[g, 0]``; the sink's weight and gradient come out
per row.

With a cap (``kernels/README.md``, "Soft-capping") the forward runs on ``c(x)``, capped
as it is read; the backward reads the raw scores to multiply ``dx`` by the cap's slope.

Backward (closed form, saves only ``y`` and a per-row gate that is 0 in +inf rows):
``dx = gppr * g - gppr * sum(gppr * g) / sum(gppr)`` with ``gppr = y^(2 - alpha)`` on
the support, and ``d alpha = beta * (sum(g S) - sum(S) / sum(gppr) * sum(g gppr))``
with ``beta = 1 / (alpha - 1)``, ``S_i = y_i (beta - log y_i)`` (0 for alpha = 1 rows).
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
    scan_row,
    sink_taken,
    store_row,
    store_sink,
    through_cap,
)

__all__ = ["entmax_backward", "entmax_forward"]


@triton.jit
def _power(u, exponent):
    """``u ** exponent`` where ``u > 0``, else 0 (exact for exponents 1 and 2)."""
    positive = u > 0
    safe = tl.where(positive, u, 1.0)
    if exponent == 1:
        value = safe
    elif exponent == 2:
        value = safe * safe
    elif exponent == 0.5:
        value = tl.sqrt(safe)
    else:
        value = tl.exp2(exponent * tl.log2(safe))
    return tl.where(positive, value, 0.0)


@triton.jit
def _mass(z, allowed, tau, power, softmax_row):
    """Unnormalised weights: ``exp(z - tau)`` (softmax rows) or ``[z - tau]_+^p``."""
    if softmax_row:
        mass = tl.where(allowed, tl.exp(z - tau), 0.0)
    else:
        mass = tl.where(allowed, _power(z - tau, power), 0.0)
    return mass


@triton.jit
def _block_sums(z, allowed, tau, power, softmax_row):
    """Over one block: total mass, ``sum [z - tau]_+^(p - 1)``, support size, ``sum z`` on the support."""
    support = allowed & (z > tau)
    mass = tl.sum(_mass(z, allowed, tau, power, softmax_row), 0)
    slope = tl.sum(tl.where(support, _power(z - tau, power - 1), 0.0), 0)
    return mass, slope, tl.sum(support.to(tl.int32), 0), tl.sum(tl.where(support, z, 0.0), 0)


@triton.jit
def _load_z(X, row, cols, length, x_row_stride, masking, sink, softcap, posinf_row, top, multiplier,
            BOOL_MASK, CAUSAL, LENGTHS, HAS_SINK, SOFTCAP, COMPUTE):
    """``z = (alpha - 1) (x - max x)`` for one block of a long row, and its allowed positions."""
    x, allowed = load_block(
        X, row, cols, length, x_row_stride, masking, sink, softcap,
        BOOL_MASK, CAUSAL, LENGTHS, HAS_SINK, SOFTCAP, COMPUTE
    )
    x, allowed = keep_posinf(x, allowed, posinf_row)
    return (x - top) * multiplier, allowed


@triton.jit
def _row_sums(
    X, row, length, x_row_stride, masking, sink, softcap, posinf_row, top, multiplier, tau, power, softmax_row,
    BLOCK, BOOL_MASK, CAUSAL, LENGTHS, HAS_SINK, SOFTCAP, COMPUTE,
):
    """:func:`_block_sums` over a long row, streamed from memory."""
    mass = tl.zeros((), COMPUTE)
    slope = tl.zeros((), COMPUTE)
    support = tl.zeros((), tl.int32)
    support_z = tl.zeros((), COMPUTE)
    for start in range(0, row_extent(length, HAS_SINK), BLOCK):
        cols = start + tl.arange(0, BLOCK)
        z, allowed = _load_z(X, row, cols, length, x_row_stride, masking, sink, softcap, posinf_row, top, multiplier,
                             BOOL_MASK, CAUSAL, LENGTHS, HAS_SINK, SOFTCAP, COMPUTE)
        block_mass, block_slope, block_support, block_z = _block_sums(z, allowed, tau, power, softmax_row)
        mass += block_mass
        slope += block_slope
        support += block_support
        support_z += block_z
    return mass, slope, support, support_z


@triton.jit
def _weights(z, allowed, tau, power, softmax_row, exact_tau, total):
    """Final weights of one block: exact sparsemax, or mass renormalised by ``total``."""
    if (power == 1) & ~softmax_row:
        y = tl.where(allowed, tl.maximum(z - exact_tau, 0.0), 0.0)
    else:
        y = _mass(z, allowed, tau, power, softmax_row) / total
    return y


@triton.jit
def _anchored(x, allowed, pivot, w, multiplier, power):
    """Weights ``((alpha - 1)(x - pivot) + w^(alpha - 1))^p`` on ``x >= pivot`` (the pivot's own: ``w``)."""
    on = allowed & (x >= pivot)
    gap = multiplier * (x - pivot)
    y = tl.where(gap == 0, w, _power(gap + _power(w, multiplier), power))
    return tl.where(on, y, 0.0)


@triton.jit
def _anchored_block(x, allowed, pivot, w, multiplier, power):
    """Over one block: ``H(w) = sum y``, ``H'(w) = sum (w / y)^(alpha - 2)`` and the scores next to ``pivot``."""
    y = _anchored(x, allowed, pivot, w, multiplier, power)
    slope = tl.where(y > 0, _power(w / tl.where(y > 0, y, 1.0), multiplier - 1), 0.0)
    above = tl.min(tl.where(allowed & (x > pivot), x, float("inf")), 0)
    below = tl.max(tl.where(allowed & (x < pivot), x, float("-inf")), 0)
    return tl.sum(y, 0), tl.sum(slope, 0), above, below


@triton.jit
def _anchored_sums(
    X, row, length, x_row_stride, masking, sink, softcap, posinf_row, x, allowed, pivot, w, multiplier, power,
    SINGLE, BLOCK, BOOL_MASK, CAUSAL, LENGTHS, HAS_SINK, SOFTCAP, COMPUTE,
):
    """:func:`_anchored_block` over the row: in registers (SINGLE) or streamed."""
    if SINGLE:
        mass, slope, above, below = _anchored_block(x, allowed, pivot, w, multiplier, power)
    else:
        mass = tl.zeros((), COMPUTE)
        slope = tl.zeros((), COMPUTE)
        above = tl.full((), float("inf"), COMPUTE)
        below = tl.full((), float("-inf"), COMPUTE)
        for start in range(0, row_extent(length, HAS_SINK), BLOCK):
            cols = start + tl.arange(0, BLOCK)
            block_x, block_allowed = load_block(
                X, row, cols, length, x_row_stride, masking, sink, softcap,
                BOOL_MASK, CAUSAL, LENGTHS, HAS_SINK, SOFTCAP, COMPUTE
            )
            block_x, block_allowed = keep_posinf(block_x, block_allowed, posinf_row)
            block_mass, block_slope, block_above, block_below = _anchored_block(
                block_x, block_allowed, pivot, w, multiplier, power
            )
            mass += block_mass
            slope += block_slope
            above = tl.minimum(above, block_above)
            below = tl.maximum(below, block_below)
    return mass, slope, above, below


@triton.jit
def _anchor(
    X, row, length, x_row_stride, masking, sink, softcap, posinf_row, x, allowed, start, top, multiplier, power,
    max_iters, SINGLE, BLOCK, BOOL_MASK, CAUSAL, LENGTHS, HAS_SINK, SOFTCAP, COMPUTE,
):
    """The pivot ``x_s`` and its weight ``w`` (module docstring), walking from the score ``start``."""
    # Walk: F(c) = H(0) at candidate c; F < 1 means c is in the support.  Down while it
    # is, up while it is not; the pivot is the lowest candidate in the support.
    zero = tl.zeros((), COMPUTE)
    candidate = start
    pivot = top
    pivot_below = tl.full((), float("-inf"), COMPUTE)
    direction = 0
    iteration = 0
    walking = True
    while walking:
        mass, _, above, below = _anchored_sums(
            X, row, length, x_row_stride, masking, sink, softcap, posinf_row, x, allowed, candidate, zero, multiplier,
            power, SINGLE, BLOCK, BOOL_MASK, CAUSAL, LENGTHS, HAS_SINK, SOFTCAP, COMPUTE,
        )
        in_support = mass < 1
        pivot = tl.where(in_support, candidate, pivot)
        pivot_below = tl.where(in_support, below, pivot_below)
        none_below = below == float("-inf")
        done = tl.where(direction > 0, in_support, tl.where(direction < 0, ~in_support, False)) | (
            in_support & none_below
        )
        direction = tl.where(in_support, -1, 1)
        candidate = tl.where(in_support, below, above)
        iteration += 1
        walking = ~done & (tl.abs(candidate) < float("inf")) & (iteration < max_iters)
    # Newton from above on the convex H: H(min(1, gap^p)) >= 1, where gap reaches the next lower score.
    gap = multiplier * (pivot - pivot_below)
    w = tl.where(pivot_below == float("-inf"), 1.0, tl.minimum(_power(gap, power), 1.0))
    iteration = 0
    descending = True
    while descending:
        mass, slope, _, _ = _anchored_sums(
            X, row, length, x_row_stride, masking, sink, softcap, posinf_row, x, allowed, pivot, w, multiplier, power,
            SINGLE, BLOCK, BOOL_MASK, CAUSAL, LENGTHS, HAS_SINK, SOFTCAP, COMPUTE,
        )
        step = tl.maximum(w - (mass - 1) / tl.where(slope > 0, slope, 1.0), 0.0)
        iteration += 1
        descending = (step < w) & (iteration < max_iters)
        w = tl.where(step < w, step, w)
    mass, _, _, _ = _anchored_sums(
        X, row, length, x_row_stride, masking, sink, softcap, posinf_row, x, allowed, pivot, w, multiplier, power,
        SINGLE, BLOCK, BOOL_MASK, CAUSAL, LENGTHS, HAS_SINK, SOFTCAP, COMPUTE,
    )
    return pivot, w, mass


@triton.jit
def _entmax_forward_kernel(
    X, OUT, GATE, alpha_values, alpha_stride,
    mask_ptr, mask_batch_stride, mask_head_stride, mask_query_stride, mask_col_stride,
    lengths_ptr, lengths_stride, rows_per_batch, num_queries, diagonal,
    sink_values, sink_stride, sink_period, sink_count, SINK_WEIGHT, softcap_value,
    length, x_row_stride, out_row_stride, max_iters,
    BLOCK: tl.constexpr, SINGLE: tl.constexpr,
    BOOL_MASK: tl.constexpr, CAUSAL: tl.constexpr, LENGTHS: tl.constexpr, HAS_SINK: tl.constexpr, SOFTCAP: tl.constexpr,
    COMPUTE: tl.constexpr, WEIGHTS_ONLY: tl.constexpr,
):
    """alpha-entmax of one row (see the module docstring for the method); ``WEIGHTS_ONLY``: no gate written.

    Passes over the row and bytes moved: a single-block row reads x once and writes
    y once, ``L * (in + out)``, plus one per-row gate; every Newton step works on the
    row held in registers.  A multi-pass row reads x once per Newton step (1-6 for
    alpha <= 2, up to ~25 bisection-safeguarded ones above; for alpha > 2 a few more
    for the pivot walk and the pivot's Newton steps, typically 3-8) plus twice
    (statistics, write).  A bool mask adds one byte per element and pass.
    ``HAS_SINK``: the sink is position ``length`` of every pass (one scalar read, held
    in a register) and its weight one more per-row scalar written; no extra pass.
    ``SOFTCAP``: x is capped as it is read in every pass (one
    scalar read per row, one ``exp`` and one division per element and pass); no extra
    pass or byte.
    """
    masking = (mask_ptr, mask_batch_stride, mask_head_stride, mask_query_stride, mask_col_stride, lengths_ptr,
               lengths_stride, rows_per_batch, num_queries, diagonal)
    row = tl.program_id(0).to(tl.int64)
    alpha = load_row_param(alpha_values, alpha_stride, row).to(COMPUTE)
    softmax_row = alpha == 1
    multiplier = tl.where(softmax_row, 1.0, alpha - 1)
    power = tl.where(softmax_row, 1.0, 1.0 / multiplier)
    sink = load_sink_score(sink_values, sink_stride, sink_period, sink_count, row, HAS_SINK, COMPUTE)
    softcap = load_softcap(softcap_value, SOFTCAP, COMPUTE)
    if SINGLE:
        cols = tl.arange(0, BLOCK)
        x, allowed, posinf_row, nan_row, _ = load_row(
            X, row, cols, length, x_row_stride, masking, sink, softcap,
            BOOL_MASK, CAUSAL, LENGTHS, HAS_SINK, SOFTCAP, COMPUTE
        )
        count = tl.sum(allowed.to(tl.int32), 0)
        top = tl.max(tl.where(allowed, x, float("-inf")), 0)
        top = tl.where(top == float("-inf"), 0.0, top)
        z = (x - top) * multiplier
        z_sum = tl.sum(tl.where(allowed, z, 0.0), 0)
    else:
        x = tl.zeros((), COMPUTE)  # the row stays in memory
        allowed = tl.zeros((), tl.int1)
        count, posinf_count, nan_count, top, _, sum_below_max, _ = scan_row(
            X, row, length, x_row_stride, masking, sink, softcap, 1.0, BLOCK, False,
            BOOL_MASK, CAUSAL, LENGTHS, HAS_SINK, SOFTCAP, COMPUTE,
        )
        posinf_row = posinf_count > 0
        if HAS_SINK:
            count += sink_taken(sink)  # the bracket counts every position of the extended row
        count = tl.where(posinf_row, posinf_count, count)
        nan_row = nan_count > 0
        top = tl.where(top == float("-inf"), 0.0, top)
        z_sum = sum_below_max * multiplier
    # Scores are shifted so that max z = 0: the bracket is [-1, -n^(1 - alpha)].
    n = tl.maximum(count, 1).to(COMPUTE)
    low = tl.full((), -1.0, COMPUTE)
    high = -tl.exp2((1 - alpha) * tl.log2(n))
    hoelder = (z_sum - tl.exp2((2 - alpha) * tl.log2(n))) / n
    tau = tl.where(softmax_row, 0.0, tl.where(power >= 1, tl.maximum(low, hoelder), low))
    mass = tl.zeros((), COMPUTE)
    slope = tl.zeros((), COMPUTE)
    support = tl.zeros((), tl.int32)
    support_z = tl.zeros((), COMPUTE)
    searchable = ~softmax_row & (count > 0) & ~nan_row
    iteration = 0
    evaluating = True
    while evaluating:
        if SINGLE:
            mass, slope, support, support_z = _block_sums(z, allowed, tau, power, softmax_row)
        else:
            mass, slope, support, support_z = _row_sums(
                X, row, length, x_row_stride, masking, sink, softcap, posinf_row, top, multiplier, tau, power,
                softmax_row, BLOCK, BOOL_MASK, CAUSAL, LENGTHS, HAS_SINK, SOFTCAP, COMPUTE,
            )
        above = mass >= 1
        low = tl.where(above, tau, low)
        high = tl.where(above, high, tau)
        newton = tau + (mass - tl.exp2((1 - 1 / power) * tl.log2(mass))) / slope
        # Convex F (p >= 1): a Newton step never overshoots, only rounding can land it on
        # the bracket's end.  Otherwise a step onto an end would stall: bisect instead.
        inside = tl.where(power >= 1, (newton >= low) & (newton <= high), (newton > low) & (newton < high))
        step = tl.where(inside, newton, 0.5 * (low + high))
        iteration += 1
        # Stop when the step no longer moves tau.  Newton on a convex F (p >= 1) only
        # climbs, so a step back is rounding noise at the root; otherwise every step
        # lands strictly inside a shrinking bracket, so the search ends.
        climbing = (power < 1) | (step > tau)
        evaluating = searchable & (step != tau) & climbing & (iteration < max_iters)
        tau = tl.where(evaluating, step, tau)
    exact_tau = (support_z - 1) / tl.maximum(support, 1).to(COMPUTE)
    total = tl.where(mass > 0, mass, 1.0)
    anchored = searchable & (power < 1)
    pivot = top
    w = tl.zeros((), COMPUTE)
    if anchored:
        # The smallest score tau's estimate puts in the support starts the walk.
        if SINGLE:
            start = tl.min(tl.where(allowed & (z > tau), x, float("inf")), 0)
        else:
            start = tl.full((), float("inf"), COMPUTE)
            for block_start in range(0, row_extent(length, HAS_SINK), BLOCK):
                cols = block_start + tl.arange(0, BLOCK)
                block_x, block_allowed = load_block(
                    X, row, cols, length, x_row_stride, masking, sink, softcap,
                    BOOL_MASK, CAUSAL, LENGTHS, HAS_SINK, SOFTCAP, COMPUTE
                )
                block_x, block_allowed = keep_posinf(block_x, block_allowed, posinf_row)
                in_support = block_allowed & ((block_x - top) * multiplier > tau)
                start = tl.minimum(start, tl.min(tl.where(in_support, block_x, float("inf")), 0))
        start = tl.where(start == float("inf"), top, start)
        pivot, w, total = _anchor(
            X, row, length, x_row_stride, masking, sink, softcap, posinf_row, x, allowed, start, top, multiplier, power,
            max_iters, SINGLE, BLOCK, BOOL_MASK, CAUSAL, LENGTHS, HAS_SINK, SOFTCAP, COMPUTE,
        )
    sink_weight = tl.zeros((), COMPUTE)
    if SINGLE:
        if anchored:
            y = _anchored(x, allowed, pivot, w, multiplier, power) / total
        else:
            y = _weights(z, allowed, tau, power, softmax_row, exact_tau, total)
        store_row(OUT, row, cols, length, out_row_stride, y, nan_row)
        if HAS_SINK:
            sink_weight = at_sink(cols, length, y)
    else:
        for block_start in range(0, row_extent(length, HAS_SINK), BLOCK):
            cols = block_start + tl.arange(0, BLOCK)
            if anchored:
                block_x, block_allowed = load_block(
                    X, row, cols, length, x_row_stride, masking, sink, softcap,
                    BOOL_MASK, CAUSAL, LENGTHS, HAS_SINK, SOFTCAP, COMPUTE
                )
                block_x, block_allowed = keep_posinf(block_x, block_allowed, posinf_row)
                y = _anchored(block_x, block_allowed, pivot, w, multiplier, power) / total
            else:
                z, block_allowed = _load_z(X, row, cols, length, x_row_stride, masking, sink, softcap, posinf_row, top,
                                           multiplier, BOOL_MASK, CAUSAL, LENGTHS, HAS_SINK, SOFTCAP, COMPUTE)
                y = _weights(z, block_allowed, tau, power, softmax_row, exact_tau, total)
            store_row(OUT, row, cols, length, out_row_stride, y, nan_row)
            if HAS_SINK:
                sink_weight += at_sink(cols, length, y)
    if not WEIGHTS_ONLY:
        tl.store(GATE + row, tl.where(posinf_row, 0.0, 1.0))
    if HAS_SINK:
        store_sink(SINK_WEIGHT, row, sink_weight, nan_row)


@triton.jit
def _backward_block_sums(y, g, alpha, beta, ALPHA_GRAD: tl.constexpr):
    """``sum(s g)``, ``sum(s)`` and, for the alpha gradient, ``sum(g S)``, ``sum(S)``."""
    gppr = _power(y, 2 - alpha)
    gppr_g = tl.sum(gppr * g, 0)
    entropy_g = tl.zeros_like(gppr_g)
    entropy_sum = tl.zeros_like(gppr_g)
    if ALPHA_GRAD:
        on = y > 0
        entropy_term = tl.where(on, y * (beta - tl.log(tl.where(on, y, 1.0))), 0.0)
        entropy_g = tl.sum(entropy_term * g, 0)
        entropy_sum = tl.sum(entropy_term, 0)
    return gppr_g, tl.sum(gppr, 0), entropy_g, entropy_sum


@triton.jit
def _entmax_backward_kernel(
    Y, G, X, DX, D_ALPHA, gate_values, gate_stride, alpha_values, alpha_stride,
    sink_weight_values, sink_weight_stride, DSINK, softcap_value,
    length, y_row_stride, g_row_stride, x_row_stride, dx_row_stride,
    BLOCK: tl.constexpr, SINGLE: tl.constexpr, ALPHA_GRAD: tl.constexpr, HAS_SINK: tl.constexpr, SOFTCAP: tl.constexpr,
    COMPUTE: tl.constexpr,
):
    """Closed-form entmax backward for one row (formulas in the module docstring); NaN rows give NaN.

    Passes and bytes moved: a single-block row reads y and g once and writes dx
    once, ``3 L itemsize``, plus the per-row gate (and alpha's gradient); a
    multi-pass row reads y and g twice (sums, then dx), ``5 L itemsize``.
    ``HAS_SINK``: the row is ``[y, sink_weight]`` with gradient ``[g, 0]``, the sink's
    weight one scalar read per row and its gradient one written.  ``SOFTCAP``: ``dx`` is
    carried through the cap's slope at the raw scores x, read once where dx is written
    (``L`` x elements more); without it x is never read.
    """
    row = tl.program_id(0).to(tl.int64)
    alpha = load_row_param(alpha_values, alpha_stride, row).to(COMPUTE)
    gate = load_row_param(gate_values, gate_stride, row).to(COMPUTE)
    sink_weight = load_sink(sink_weight_values, sink_weight_stride, row, HAS_SINK, COMPUTE)
    softcap = load_softcap(softcap_value, SOFTCAP, COMPUTE)
    beta = tl.where(alpha == 1, 0.0, 1.0 / tl.where(alpha == 1, 2.0, alpha - 1))
    if SINGLE:
        cols = tl.arange(0, BLOCK)
        y, g = load_output_and_grad(Y, G, row, cols, length, y_row_stride, g_row_stride, sink_weight, HAS_SINK,
                                    COMPUTE)
        gppr_g, gppr_sum, entropy_g, entropy_sum = _backward_block_sums(y, g, alpha, beta, ALPHA_GRAD)
        nan_row = tl.sum((y != y).to(tl.int32), 0) > 0
        mean_g = gppr_g / tl.where(gppr_sum > 0, gppr_sum, 1.0)
        dx = gate * _power(y, 2 - alpha) * (g - mean_g)
        if HAS_SINK:
            store_sink(DSINK, row, at_sink(cols, length, dx), nan_row)
        dx = through_cap(X, row, cols, length, x_row_stride, dx, softcap, SOFTCAP, COMPUTE)
        store_row(DX, row, cols, length, dx_row_stride, dx, nan_row)
    else:
        gppr_g = tl.zeros((), COMPUTE)
        gppr_sum = tl.zeros((), COMPUTE)
        entropy_g = tl.zeros((), COMPUTE)
        entropy_sum = tl.zeros((), COMPUTE)
        nan = tl.zeros((), tl.int32)
        for start in range(0, row_extent(length, HAS_SINK), BLOCK):
            cols = start + tl.arange(0, BLOCK)
            y, g = load_output_and_grad(Y, G, row, cols, length, y_row_stride, g_row_stride, sink_weight, HAS_SINK,
                                        COMPUTE)
            nan += tl.sum((y != y).to(tl.int32), 0)
            block_gppr_g, block_gppr, block_entropy_g, block_entropy = _backward_block_sums(
                y, g, alpha, beta, ALPHA_GRAD
            )
            gppr_g += block_gppr_g
            gppr_sum += block_gppr
            entropy_g += block_entropy_g
            entropy_sum += block_entropy
        mean_g = gppr_g / tl.where(gppr_sum > 0, gppr_sum, 1.0)
        dsink = tl.zeros((), COMPUTE)
        for start in range(0, row_extent(length, HAS_SINK), BLOCK):
            cols = start + tl.arange(0, BLOCK)
            y, g = load_output_and_grad(Y, G, row, cols, length, y_row_stride, g_row_stride, sink_weight, HAS_SINK,
                                        COMPUTE)
            dx = gate * _power(y, 2 - alpha) * (g - mean_g)
            if HAS_SINK:
                dsink += at_sink(cols, length, dx)
            dx = through_cap(X, row, cols, length, x_row_stride, dx, softcap, SOFTCAP, COMPUTE)
            store_row(DX, row, cols, length, dx_row_stride, dx, nan > 0)
        nan_row = nan > 0
        if HAS_SINK:
            store_sink(DSINK, row, dsink, nan_row)
    if ALPHA_GRAD:
        ratio = entropy_sum / tl.where(gppr_sum > 0, gppr_sum, 1.0)
        d_alpha = gate * beta * (entropy_g - ratio * gppr_g)
        tl.store(D_ALPHA + row, tl.where(nan_row, float("nan"), d_alpha))  # NaN in a row holding NaN, as dx


def _max_iterations(compute: tl.dtype) -> int:
    """Cap on Newton/bisection steps: bisection alone resolves tau to the compute dtype's precision within it."""
    return 120 if compute == tl.float64 else 60


def _compute(x: Tensor, alpha: float | Tensor) -> tl.dtype:
    """The forward's compute dtype: float64 for float64 rows, and for any row with a python ``alpha`` in
    ``(1, rules.NEAR_SOFTMAX)``; else float32.

    Just above alpha = 1 the weights ``[(alpha - 1) x - tau]_+^(1 / (alpha - 1))`` raise a number
    within a few float32 units of 1 to a large power: in float32 the kernel was 6e-4 off at
    alpha = 1 + 1e-5 and 3e-2 at 1 + 1e-7 (float64 bisection of the ``entmax`` package as the
    oracle), 5e-6 at 1 + 1e-3.  ``alpha`` itself then goes to the kernel in float64 too (float32
    would move 1 + 1e-7 to 1 + 1.19e-7).  A tensor ``alpha`` is not read (that would synchronise
    the device): per-row alphas that close to 1 keep float32's error.
    """
    if x.dtype == torch.float64 or (not isinstance(alpha, Tensor) and 1 < alpha < rules.NEAR_SOFTMAX):
        return tl.float64
    return tl.float32


@replay.replayable
def entmax_forward(
    x: Tensor, mask: rules.RowMask, alpha: float | Tensor, sink: Tensor | None = None, softcap: float | None = None,
    weights_only: bool = False, out_dtype: torch.dtype | None = None,
) -> tuple[Tensor, ...]:
    """alpha-entmax over the allowed positions of each row, any ``alpha >= 1`` per row.

    ``y = [(alpha - 1) x - tau]_+^(1 / (alpha - 1))`` with ``tau`` such that each row sums
    to 1 (Peters, Niculae & Martins, 2019); alpha = 1 is softmax, alpha = 2 sparsemax.

    Args:
        x: scores ``(..., L)``, float16/bfloat16/float32/float64.
        mask: which positions each row may use.
        alpha: python number or tensor ``(..., 1)`` broadcastable to ``x``, >= 1.
        sink: the score of a virtual key after each row, ``x.shape[:-1]`` (or ``(..., 1)``), or
            None: entmax of the extended row ``[x, sink]`` (``tau`` makes it sum to 1).
        softcap: a cap ``> 0``, or None: entmax of ``c(x) = softcap tanh(x / softcap)``
            (``c(-inf) = -inf``, ``c(+inf) = softcap``; the sink is not capped).
        weights_only: skip what only a backward reads: ``gate`` is None (one allocation and
            one store per row less).
        out_dtype: the weights' dtype, ``x``'s by default (the decoding route's float32 scores
            give their weights in the query's half dtype, rounded as ``Tensor.to`` rounds).

    Returns:
        ``(y, gate)``: weights like ``x``; ``gate`` per row ``x.shape[:-1]``, 1, or 0 in rows
        holding +inf.  With a ``sink``, ``(y, gate, sink_weight)``: the sink's weight per row.

    Raises:
        ValueError: ``sink`` of another shape, or a ``softcap`` that is not a finite number > 0.
    """
    run = launch.prepare(x, sink is not None, out_dtype)
    gate = None if weights_only else run.row_stats()
    sink_weight = run.row_stats() if sink is not None else None
    masking = launch.mask_args(mask, x)
    unwritten = run.out  # a pointer the kernel never writes through (WEIGHTS_ONLY, or no sink)
    compute = _compute(x, alpha)
    alpha_dtype = torch.float64 if compute == tl.float64 else None  # alpha in the precision the rows take
    launch.run(
        _entmax_forward_kernel, run,
        run.rows, run.out, unwritten if gate is None else gate, *launch.row_param(alpha, x, alpha_dtype),
        *masking.args,
        *launch.sink_scores(sink, x), unwritten if sink_weight is None else sink_weight,
        launch.softcap_arg(softcap, x), run.length, run.rows.stride(0), run.out.stride(0), _max_iterations(compute),
        BLOCK=run.config.block, SINGLE=run.config.single, HAS_SINK=sink is not None, SOFTCAP=softcap is not None,
        COMPUTE=compute, WEIGHTS_ONLY=gate is None, **masking.constants,
    )
    outputs = (run.out.reshape(x.shape), None if gate is None else gate.reshape(x.shape[:-1]))
    return outputs if sink_weight is None else (*outputs, sink_weight.reshape(x.shape[:-1]))


@replay.replayable
def entmax_backward(
    y: Tensor, grad: Tensor, gate: Tensor, alpha: float | Tensor, alpha_grad: bool,
    sink_weight: Tensor | None = None, x: Tensor | None = None, softcap: float | None = None,
) -> tuple[Tensor, ...]:
    """The closed-form entmax Jacobian-vector product, from the output alone.

    ``dx = gate (s g - s sum(s g) / sum(s))`` with ``s = y^(2 - alpha)`` on the support;
    with ``alpha_grad``, ``d alpha = gate beta (sum(g S) - sum(S) / sum(s) sum(g s))``,
    ``beta = 1 / (alpha - 1)``, ``S = y (beta - log y)`` (0 for alpha = 1 rows).

    Args:
        y: the forward's weights ``(..., L)``.
        grad: the incoming gradient, like ``y``.
        gate: the forward's gate per row ``y.shape[:-1]``.
        alpha: the forward's alpha.
        alpha_grad: also return alpha's gradient per row.
        sink_weight: the forward's sink weight per row ``y.shape[:-1]``, or None: the product
            for the extended row ``[y, sink_weight]`` with gradient ``[g, 0]`` (alpha's
            gradient includes the sink's terms).
        x: the forward's raw scores, read only with ``softcap``.
        softcap: the forward's cap, or None: ``dx`` is carried through it,
            ``dx = (1 - tanh(x / softcap)^2) dc`` (0 where ``x`` is infinite).

    Returns:
        ``(dx, per_row)``: ``dx`` like ``y``; alpha's gradient per row ``y.shape[:-1]`` in the
        accumulation dtype, or None.  With ``sink_weight``, ``(dx, per_row, dsink)``: the
        gradient of the sink's score per row, like ``per_row``.

    Raises:
        ValueError: ``softcap`` without ``x``, or a ``softcap`` that is not a finite number > 0.
    """
    launch.check_raw_scores(x, softcap)
    saved_x = launch.rows_view(y if x is None else x)
    has_sink = sink_weight is not None
    run = launch.prepare(y, has_sink)
    g = launch.rows_view(grad)
    d_alpha = run.row_stats() if alpha_grad else None
    dsink = run.row_stats() if has_sink else None
    launch.run(
        _entmax_backward_kernel, run,
        run.rows, g, saved_x, run.out, run.out if d_alpha is None else d_alpha,
        *launch.per_row_param(gate, y), *launch.row_param(alpha, y),
        *(launch.per_row_param(sink_weight, y) if has_sink else (run.rows, 0)), run.out if dsink is None else dsink,
        launch.softcap_arg(softcap, y),
        run.length, run.rows.stride(0), g.stride(0), saved_x.stride(0), run.out.stride(0),
        BLOCK=run.config.block, SINGLE=run.config.single, ALPHA_GRAD=bool(alpha_grad), HAS_SINK=has_sink,
        SOFTCAP=softcap is not None, COMPUTE=launch.compute_dtype(y),
    )
    outputs = (run.out.reshape(y.shape), None if d_alpha is None else d_alpha.reshape(y.shape[:-1]))
    return outputs if dsink is None else (*outputs, dsink.reshape(y.shape[:-1]))
