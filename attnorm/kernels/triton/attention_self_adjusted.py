"""Fused Self-Adjusted Softmax attention (Zheng et al., 2025, arXiv 2502.18277): forward and backward.

``out_i = sum_j phi(x_ij) w_ij v_j`` with ``x = scale q k^T + additive`` over row ``i``'s
allowed keys, ``w = softmax(x)`` and ``phi(x) = x`` (plain) or ``(x - low) / (high - low)``,
``low = min(min x, 0)``, ``high = max(max x, 0)`` (normalized; ``phi = 0`` when
``high = low``).  No ``(Lq, Lk)`` matrix is stored: each kernel runs one program per
query block (or key block) and recomputes score tiles with
:func:`.attention_blocks.score_tile`, always on the same aligned ``(BLOCK_M, BLOCK_N)``
tiles, so every kernel sees bit-identical scores (the backward's ``x == low`` and
``x == high`` tests rely on it).

**Forward, one pass over K and V.**  ``phi`` is affine in ``x`` once ``low`` is known, so
``sum_j phi_j e_j v_j`` (``e_j = exp(x_j - m)``, ``m`` the row max) follows from two running
sums rescaled online as ``m`` grows: ``A = sum e (x - b) v`` and ``B = sum e v``, ``b`` the
running max of the keys alone (``A`` moved by ``(b_old - b_new) B`` as it grows); then
``out = (A + b B) / l`` (plain) or ``(A + (b - low) B) / (l span)`` (normalized): a key's
``x - b`` is no larger than the keys' spread, so a sink far above them does not make ``A``
and ``b B`` cancel (5 % of a float16 output before).  Plain outside float16 keeps one sum,
``sum e x v``, ``out = A / l`` (one product a tile less; in float16 the two sums' rounded
``e (x - b)`` kept plain's gradients 3x closer to float64, interpreted: 0.05 against 0.17 %).
Products with V take ``e (x - b)`` or ``e x``
rounded to V's dtype (float16: scaled by a power of two per row first,
:func:`.attention_blocks.rounded_mma`, so neither overflows nor sinks into subnormals).
The same pass tracks
``l = sum e`` and, normalized, the row min and how many keys attain the min and the max.
Special values cost nothing per score: the running max is the raw one (+inf in a row
holding +inf) and a NaN score turns the row's ``l`` NaN.  Rows holding +inf (the limit of
the finite case: uniform over their +inf keys, factor 1 normalized, +inf plain) take a
second pass, only in query blocks that hold such a row; it also counts their NaN keys.

**Backward, by recomputation (FlashAttention-2 style, no atomics).**  With
``g_j = dO_i . v_j``, ``P = sum_j g_j y_j`` and ``Q = sum_j g_j w_j``,
:func:`attnorm.kernels.reference.jacobians.self_adjusted_vjp` gives the score gradient

* plain: ``ds_j = w_j (g_j (1 + x_j) - P)``;
* normalized: ``ds_j = w_j (g_j phi_j - P) + (g_j w_j + [x_j = low] (P - Q) / n_low
  - [x_j = high] P / n_high) / span``, the last two the paths through ``low`` (when
  ``low <= 0``) and ``high`` (when ``high >= 0``), shared by the ``n_low`` (``n_high``) keys
  attaining them.  At a row min (max) of exactly 0, where ``min(x, 0)`` has a kink, the path
  counts, as autograd of ``clamp`` has it; every backend follows that rule.

Plain needs only ``P = dO_i . out_i``: a per-row pre-pass over ``out`` (no K/V), as
FlashAttention's ``delta``.  Normalized divides by the span, where the terms cancel in
rows with a tiny span (a row with one key: ``g w - P = 0``), so ``P`` and ``Q`` must come
from the very ``g`` and ``w`` the kernels see, and each ``ds`` is summed in the
accumulation dtype before it is rounded for ``tl.dot``: the dq kernel (one program per
query block, looping over its key blocks) first sums ``P`` and ``Q`` over its key blocks
and writes them, then accumulates ``dq``; the dk/dv kernel (one program per key block,
looping over the query heads of its GQA group and their query blocks that reach it)
reads them.  Passes per query block: forward 1 over K and V (2 in query blocks with
+inf rows); backward, dq 1 over K and V (2 normalized), and dk/dv 1 over q and dO per
key block.

Bytes per query row beyond q, k, v, out and their gradients: the forward writes
:data:`STATS` stats of 4 bytes (8 for float64); the backward reads them and writes
and reads two per-row sums (``P``, ``Q``).

**Softcap and sinks.**  Under ``SOFTCAP`` the scores are ``cap tanh(scale q k^T / cap)
+ additive`` (one ``exp`` more per score, in every pass) and the backward multiplies
each ``ds`` by the cap's slope ``1 - tanh^2``.  A sink (``HAS_SINK``: a score per row,
value zero) is one more allowed key: it starts the forward's running max, min, tie
counts and ``l`` (``A`` and ``B`` have no term for it), so it enters ``low``, ``high``
and the softmax; in the backward its ``g`` is 0, so ``P`` and ``Q`` are unchanged and
its own ``ds`` (the formulas above with ``g = 0``) is written per row by the dq kernel
(4 bytes per row, 8 for float64) for torch to sum.  No pass is added.

Block size, shape checks, operands and the ``P`` pre-pass: :mod:`.attention_launch`;
mask arguments, key-block bounds and tiles: :mod:`.attention_blocks`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from attnorm.kernels import rules
from attnorm.kernels.rules import AttentionMask
from attnorm.kernels.triton import launch, replay
from attnorm.kernels.triton.attention_blocks import (
    RANGE_SCAN,
    as_acc,
    inner_key_blocks,
    key_block_bounds,
    key_program,
    key_scores,
    key_scores_slope,
    load_tile,
    mask_arguments,
    masked_block_start,
    mma,
    modifier_arguments,
    query_block_range,
    query_block_tiles,
    query_program,
    rounded_mma,
    sink_scores,
)
from attnorm.kernels.triton.attention_launch import Problem, dot_operands, launch_options, problem, row_dot
from attnorm.kernels.triton.self_adjusted import _factor, _span

__all__ = ["STATS", "self_adjusted_attention_backward", "self_adjusted_attention_forward"]

BLOCK_CUDA = 64
"""Query and key block size on CUDA."""

BLOCK_INTERPRETED = 16
"""Query and key block size under Triton's interpreter (``tl.dot``'s smallest)."""

STATS = 7
"""Per-row stats: ``(max, log_sum, low, high, low_count, high_count, state)``.

``w = exp((x - max) - log_sum)`` are the softmax weights; ``low_count`` (``high_count``)
the keys attaining the row's finite min (max); ``state`` 1 for a finite row, 2 for a
row holding +inf (then ``max = 0``, ``log_sum = log(count of +inf keys)``: ``w`` is
uniform over them once they are read as 0), 0 for a row with no allowed key or a NaN.
The plain variant's backward reads only ``max``, ``log_sum`` and ``state``: its forward
does not track the min nor the tie counts (three row reductions a tile fewer) and
writes 0 for ``low``, ``high`` and the counts."""


_STATS_WIDTH = tl.constexpr(STATS)


# ---- Self-Adjusted device helpers ----------------------------------------------------------


@triton.jit
def _weights(x, c0, c1, state):
    """Scores (0 where unused), softmax weights ``w`` and SA weights ``y`` of a tile from the row stats."""
    posinf = (state == 2)[:, None]
    used = tl.where(posinf, x == float("inf"), (x > float("-inf")) & (x < float("inf"))) & (state > 0)[:, None]
    xs = tl.where(used & ~posinf, x, 0.0)
    w = tl.where(used, tl.exp((xs - c0[:, None]) - c1[:, None]), 0.0)
    return xs, w, used, posinf


@triton.jit
def _score_grad(xs, w, used, g, low, high, state, total, low_term, high_term, NORMALIZED: tl.constexpr):
    """``ds`` (without the factor ``scale``) in rows in state 1, 0 elsewhere.

    ``total`` is ``P = sum g y`` per row, ``low_term`` and ``high_term`` the paths through
    ``low`` and ``high`` per key attaining them (:func:`_span_terms`).  The terms over the
    span cancel in rows with a tiny span: they are summed here, in the accumulation
    dtype, before ``ds`` is rounded for ``tl.dot``.
    """
    if NORMALIZED:
        s, span = _span(low, high)
        phi = _factor(xs, low[:, None], s[:, None], span[:, None], True)
        ds = w * g * phi - w * total[:, None]  # g phi - P could overflow; each product cannot
        positive = span > 0
        at_low = used & (xs == low[:, None])  # a row min of exactly 0 counts (module docstring)
        at_high = used & (xs == high[:, None])
        through = g * w * (s / tl.where(positive, span, 1.0))[:, None] + tl.where(at_low, low_term[:, None], 0.0)
        through -= tl.where(at_high, high_term[:, None], 0.0)
        ds += tl.where(positive[:, None], through, 0.0)
    else:
        ds = tl.where(w > 0, w * (g * (1 + xs) - total[:, None]), 0.0)
    return tl.where((state == 1)[:, None] & used, ds, 0.0)


@triton.jit
def _lean_weights(x, c0, c1, low, s, span, state, NORMALIZED: tl.constexpr):
    """Scores, softmax weights ``w`` and factors ``phi`` of a tile, for the backward's score gradient.

    The general :func:`_weights` selects the used keys per score (finite keys, or the +inf
    ones of a state-2 row) and zeroes the rest.  Here the scores of rows off state 1 become
    -inf (one select per score), and then a masked key (-inf) gets ``w = exp(-inf) = 0`` by
    itself; ``phi`` is taken at ``max(x, low)`` (normalized: ``low`` at a masked key,
    ``phi = 0``, ``x`` elsewhere) or is ``x`` where ``w > 0``, else 0 (plain).  ``w`` and
    ``phi`` of the used keys of state-1 rows equal the general path's bit for bit (same
    operations on the same values); every other ``w`` is 0, so the ``ds`` of
    :func:`_lean_score_grad` is 0 there, as :func:`_score_grad` makes it.  A state-2 row's
    weights on its +inf keys (``dv`` only) are left to the caller.
    """
    x = tl.where((state == 1)[:, None], x, float("-inf"))
    w = tl.exp((x - c0[:, None]) - c1[:, None])
    if NORMALIZED:
        phi = _factor(tl.maximum(x, low[:, None]), low[:, None], s[:, None], span[:, None], True)
    else:
        phi = tl.where(w > 0, x, 0.0)
    return x, w, phi


@triton.jit
def _lean_score_grad(x, w, phi, g, total, low, high, through_scale, low_term, high_term, NORMALIZED: tl.constexpr):
    """:func:`_score_grad` of a tile from :func:`_lean_weights` (its ``x``), with no per-score predicate but the
    paths through ``low`` and ``high`` (normalized).

    ``through_scale`` is ``s / span`` in rows with a span in state 1, else 0 (as ``low_term`` and
    ``high_term`` are), so those paths need no select on the span; ``x == low`` never holds at a
    masked key (-inf), and ``w = 0`` there and off state 1 makes the rest of ``ds`` 0.
    """
    if NORMALIZED:
        ds = w * g * phi - w * total[:, None]
        through = g * w * through_scale[:, None] + tl.where(x == low[:, None], low_term[:, None], 0.0)
        through -= tl.where(x == high[:, None], high_term[:, None], 0.0)
        ds += through
    else:
        ds = w * (g * (1 + phi) - total[:, None])
    return ds


@triton.jit
def _through_scale(low, high, state):
    """``s / span`` per row with a span in state 1, 0 elsewhere (the factor of ``g w`` in ``ds``)."""
    s, span = _span(low, high)
    return tl.where((span > 0) & (state == 1), s / tl.where(span > 0, span, 1.0), 0.0)


@triton.jit
def _span_terms(total, weighted, low, high, low_count, high_count, state):
    """Per row, the paths through ``low`` and ``high`` of a key attaining them.

    ``(P - Q) / (n_low span)`` and ``P / (n_high span)``; 0 without a span or off state 1.
    """
    per_span = _through_scale(low, high, state)
    return (total - weighted) * per_span / tl.maximum(low_count, 1.0), total * per_span / tl.maximum(high_count, 1.0)


@triton.jit
def _finite_or_zero(value):
    """``value`` where finite, else 0: a row's reference point (running maxima start at -inf; +inf rows are redone)."""
    return tl.where((value > float("-inf")) & (value < float("inf")), value, 0.0)


@triton.jit
def finish(top, base, total, bottom, shifted, plain, NORMALIZED: tl.constexpr):
    """``out`` of finite rows from the sums ``A = sum e (x - base) v``, ``B`` (module docstring):
    ``(A + base B) / l`` or ``(A + (base - low) B) / (l span)``, 0 in rows without a finite key.

    Returns ``(out, top, low, high, divisor)``, the last four as the stats store them
    (``top`` 0 and ``divisor`` 1 in rows without a finite key).  Shared with the split-K
    decoding kernel's combine step.
    """
    live = total > 0
    top = tl.where(live, top, 0.0)
    low = tl.minimum(tl.where(live, bottom, 0.0), 0.0)
    high = tl.maximum(top, 0.0)
    divisor = tl.where(live, total, 1.0)
    base = tl.where(live, _finite_or_zero(base), 0.0)
    if NORMALIZED:
        s, span = _span(low, high)
        out = shifted * s[:, None] + (base * s - low * s)[:, None] * plain
        out = tl.where((span > 0)[:, None], out / (divisor * tl.where(span > 0, span, 1.0))[:, None], 0.0)
    else:
        out = (shifted + base[:, None] * plain) / divisor[:, None]
    return out, top, low, high, divisor


@triton.jit
def posinf_mass(x, NORMALIZED: tl.constexpr):
    """The weight of each score in a row holding +inf, before dividing by their count: the limit
    of the finite case puts the softmax mass uniformly on the +inf keys, with factor 1
    (normalized) or +inf (plain)."""
    if NORMALIZED:
        return tl.where(x == float("inf"), 1.0, 0.0)
    return tl.where(x == float("inf"), float("inf"), 0.0)


@triton.jit
def _load_stats(STATS_PTR, rows, offs_m, lq, ACC: tl.constexpr):
    ptrs = STATS_PTR + rows * _STATS_WIDTH
    live = offs_m < lq
    c0 = tl.load(ptrs, mask=live, other=0.0).to(ACC)
    c1 = tl.load(ptrs + 1, mask=live, other=0.0).to(ACC)
    low = tl.load(ptrs + 2, mask=live, other=0.0).to(ACC)
    high = tl.load(ptrs + 3, mask=live, other=0.0).to(ACC)
    low_count = tl.load(ptrs + 4, mask=live, other=0.0).to(ACC)
    high_count = tl.load(ptrs + 5, mask=live, other=0.0).to(ACC)
    state = tl.load(ptrs + 6, mask=live, other=0.0).to(tl.int32)
    return c0, c1, low, high, low_count, high_count, state


@triton.jit
def _load_total(TOTAL, rows, offs_m, lq, state):
    """``P`` per row, 0 off state 1: plain's pre-pass ``rowsum(dO * out)`` is NaN in a NaN or +inf row even
    where ``dO`` is 0, and those rows get no score gradient (``w = 0`` must not meet a NaN ``P``)."""
    return tl.where(state == 1, tl.load(TOTAL + rows, mask=offs_m < lq, other=0.0), 0.0)


# ---- kernels ---------------------------------------------------------------------------------


@triton.jit
def _lowest(ACC: tl.constexpr):
    """The accumulation dtype's lowest finite value (a masked score, -inf, clamped to it keeps ``0 x = 0``).

    One return: Triton 3.6 rejects returns of two types (float64, float32) even under a constexpr branch.
    """
    lowest = -3.4028234663852886e38
    if ACC == tl.float64:
        lowest = -1.7976931348623157e308
    return lowest


@triton.jit
def _forward_add(x, offs_n, sums, values, NORMALIZED: tl.constexpr, ONE_SUM: tl.constexpr, ACC: tl.constexpr):
    """The forward's online sums with one score tile ``x`` of keys ``offs_n`` added (V read once).

    ``sums`` = (top, base, bottom, top_count, bottom_count, total, A, B); ``values`` = (v_base,
    offs_dv, lk, value_dim, sv_n, sv_d).  ``ONE_SUM`` (plain, V not float16): ``A`` is ``sum e x v``
    and ``B`` unused; else ``A = sum e (x - base) v`` with ``base`` the running max of the keys alone (a
    sink is left out: as the row's max, far above the keys, it made ``A`` and ``base B`` cancel,
    5 % of a float16 output off), moved with ``B`` as ``base`` grows.

    No per-score test of special values: ``top`` is the raw running max (a max ignores NaN
    on the GPU and in the interpreter alike), so a row holding +inf ends with ``top = +inf``
    (its sums are left unread: the kernel's +inf pass replaces them); a masked key (-inf)
    gets ``e = exp(-inf) = 0`` and enters ``e x`` clamped to the lowest finite value; a NaN
    score gives ``e = NaN``, so a finite row holding one ends with ``total = NaN``.  Only
    the row max and min (normalized) of the finite scores and their tie counts look at
    each score.
    """
    top, base, bottom, top_count, bottom_count, total, shifted_sum, plain_sum = sums
    v_base, offs_dv, lk, value_dim, sv_n, sv_d = values
    block_top = tl.max(x, 1)
    if NORMALIZED:  # the min and the keys attaining min and max: only the normalized backward reads them
        block_bottom = tl.min(tl.where(x > float("-inf"), x, float("inf")), 1)
        at_top = tl.where(block_top > float("-inf"), tl.sum((x == block_top[:, None]).to(ACC), 1), 0.0)
        at_bottom = tl.where(block_bottom < float("inf"), tl.sum((x == block_bottom[:, None]).to(ACC), 1), 0.0)
        top_count = tl.where(block_top > top, at_top, tl.where(block_top == top, top_count + at_top, top_count))
        bottom_count = tl.where(block_bottom < bottom, at_bottom,
                                tl.where(block_bottom == bottom, bottom_count + at_bottom, bottom_count))
        bottom = tl.minimum(bottom, block_bottom)
    new_top = tl.maximum(top, block_top)
    ref = _finite_or_zero(new_top)
    rescale = tl.where(top > float("-inf"), tl.exp(top - ref), 0.0)
    shifted = x - ref[:, None]
    e = tl.exp(shifted)
    total = total * rescale + tl.sum(e, 1)
    v_tile = load_tile(v_base, offs_n, offs_dv, lk, value_dim, sv_n, sv_d)
    if ONE_SUM:
        shifted_sum = rescale[:, None] * shifted_sum + rounded_mma(e * tl.maximum(x, _lowest(ACC)), v_tile, ACC)
    else:
        new_base = tl.maximum(base, block_top)
        base_ref = _finite_or_zero(new_base)
        moved = tl.where(base > float("-inf"), base - base_ref, 0.0)
        shifted_sum = rescale[:, None] * (shifted_sum + moved[:, None] * plain_sum)
        shifted_sum += rounded_mma(e * tl.maximum(x - base_ref[:, None], _lowest(ACC)), v_tile, ACC)
        plain_sum = rescale[:, None] * plain_sum + mma(e.to(v_tile.dtype), v_tile, ACC)
        base = new_base
    return new_top, base, bottom, top_count, bottom_count, total, shifted_sum, plain_sum


@triton.jit
def _self_adjusted_forward_kernel(
    Q, K, V, OUT, OUT_FLOAT, STATS_PTR,
    sq_b, sq_h, sq_m, sq_d, sk_b, sk_h, sk_n, sk_d, sv_b, sv_h, sv_n, sv_d,
    heads, group, lq, lk, head_dim, value_dim, scale: tl.float64,
    key_start, key_stop, range_stride,
    dense, dense_sb, dense_sh, dense_sm, dense_sn, additive, add_sb, add_sh, add_sm, add_sn,
    softcap_ptr, sink, sink_sb, sink_sh, sink_sm,
    HAS_RANGE: tl.constexpr, HAS_DENSE: tl.constexpr, HAS_ADDITIVE: tl.constexpr, NORMALIZED: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_SINK: tl.constexpr, ONE_SUM: tl.constexpr, FLOAT_OUT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, ACC: tl.constexpr,
):
    """One query block: online max/sum/min/tie counts and the sums ``A``, ``B`` in one pass (module docstring).

    ``FLOAT_OUT``: the output is also stored unrounded, in the accumulation dtype, to ``OUT_FLOAT``.
    """
    scale = as_acc(scale, ACC)
    bh = tl.program_id(1).to(tl.int64)  # offsets pass 2^31 on long contexts
    batch, head, kv_head, offs_m, offs_d, offs_dv = query_program(bh, heads, group, BLOCK_M, BLOCK_D, BLOCK_DV)
    masking = (dense, dense_sb, dense_sh, dense_sm, dense_sn, additive, add_sb, add_sh, add_sm, add_sn)
    q_tile = load_tile(Q + batch * sq_b + head * sq_h, offs_m, offs_d, lq, head_dim, sq_m, sq_d)
    k_base = K + batch * sk_b + kv_head * sk_h
    v_base = V + batch * sv_b + kv_head * sv_h
    row_start, row_stop, lo, hi = key_block_bounds(key_start, key_stop, range_stride, batch, offs_m, lq, lk, HAS_RANGE)
    lo = lo // BLOCK_N * BLOCK_N  # aligned tiles: the backward recomputes the very same ones
    softcap = tl.load(softcap_ptr)

    # The sink, an allowed key of value zero, starts the row's max, min, counts and sum.
    sink_logit = sink_scores(sink, sink_sb, sink_sh, sink_sm, batch, head, offs_m, lq, HAS_SINK, BLOCK_M, ACC)
    sink_finite = (sink_logit > float("-inf")) & (sink_logit < float("inf"))
    top = tl.where(sink_logit == sink_logit, sink_logit, float("-inf"))  # +inf too: the row's top
    bottom = tl.where(sink_finite, sink_logit, float("inf"))
    top_count = sink_finite.to(ACC)
    bottom_count = sink_finite.to(ACC)
    total = sink_finite.to(ACC)
    base = tl.full((BLOCK_M,), float("-inf"), ACC)  # the keys' running max (the sink's left out)
    shifted_sum = tl.zeros((BLOCK_M, BLOCK_DV), ACC)  # A = sum e (x - base) v, or sum e x v (ONE_SUM)
    plain_sum = tl.zeros((BLOCK_M, BLOCK_DV), ACC)  # B = sum e v
    sums = (top, base, bottom, top_count, bottom_count, total, shifted_sum, plain_sum)
    values = (v_base, offs_dv, lk, value_dim, sv_n, sv_d)
    inner_lo, inner_hi, masked = inner_key_blocks(row_start, row_stop, offs_m, lq, lk, lo, hi, BLOCK_N)
    for i in range(0, masked):  # the masked key blocks, then the inner ones (sums that do not care about order)
        offs_n = masked_block_start(i, lo, inner_lo, inner_hi, BLOCK_N) + tl.arange(0, BLOCK_N)
        x = key_scores(q_tile, k_base, sk_n, sk_d, offs_m, offs_n, offs_d, head_dim, row_start, row_stop, lk, scale,
                       softcap, batch, head, masking, HAS_DENSE, HAS_ADDITIVE, SOFTCAP, ACC)
        sums = _forward_add(x, offs_n, sums, values, NORMALIZED, ONE_SUM, ACC)
    for start in range(inner_lo, inner_hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        x = key_scores(q_tile, k_base, sk_n, sk_d, offs_m, offs_n, offs_d, head_dim, row_start, row_stop, lk, scale,
                       softcap, batch, head, masking, HAS_DENSE, HAS_ADDITIVE, SOFTCAP, ACC, False)
        sums = _forward_add(x, offs_n, sums, values, NORMALIZED, ONE_SUM, ACC)
    top, base, bottom, top_count, bottom_count, total, shifted_sum, plain_sum = sums

    # Special values, per row: a +inf score leaves top = +inf; a NaN one (in a row without +inf) total = NaN.
    posinf_row = top == float("inf")
    nan_row = ~posinf_row & (total != total)
    total = tl.where(posinf_row | nan_row, 0.0, total)
    top = tl.where(posinf_row | nan_row, float("-inf"), top)
    if ONE_SUM:
        plain_sum = 0.0  # A is already sum e x v: out = A / l
    out, top, low, high, divisor = finish(top, base, total, bottom, shifted_sum, plain_sum, NORMALIZED)
    live = total > 0
    posinf_count = (sink_logit == float("inf")).to(ACC)
    if tl.max(posinf_row.to(tl.int32), 0) > 0:
        # The limit of the finite case: the softmax mass sits uniformly on the +inf keys (a NaN key still wins).
        limit = tl.zeros((BLOCK_M, BLOCK_DV), ACC)
        nan_count = (sink_logit != sink_logit).to(ACC)
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            x = key_scores(q_tile, k_base, sk_n, sk_d, offs_m, offs_n, offs_d, head_dim, row_start, row_stop, lk,
                           scale, softcap, batch, head, masking, HAS_DENSE, HAS_ADDITIVE, SOFTCAP, ACC)
            posinf_count += tl.sum((x == float("inf")).to(ACC), 1)
            nan_count += tl.sum((x != x).to(ACC), 1)
            v_tile = load_tile(v_base, offs_n, offs_dv, lk, value_dim, sv_n, sv_d)
            limit += mma(posinf_mass(x, NORMALIZED).to(v_tile.dtype), v_tile, ACC)
        out = tl.where(posinf_row[:, None], limit / tl.maximum(posinf_count, 1.0)[:, None], out)
        nan_row = nan_row | (posinf_row & (nan_count > 0))  # state 0 wins over 2 below
    nan_row = nan_row | (sink_logit != sink_logit)
    out = tl.where(nan_row[:, None], float("nan"), out)
    rows = bh * lq + offs_m
    out_offsets = rows[:, None] * value_dim + offs_dv[None, :]
    out_tile = (offs_m < lq)[:, None] & (offs_dv < value_dim)[None, :]
    tl.store(OUT + out_offsets, out.to(OUT.dtype.element_ty), mask=out_tile)
    if FLOAT_OUT:
        tl.store(OUT_FLOAT + out_offsets, out, mask=out_tile)

    state = tl.where(nan_row, 0, tl.where(posinf_row, 2, tl.where(live, 1, 0)))
    finite_row = state == 1
    ptrs = STATS_PTR + rows * _STATS_WIDTH
    live_rows = offs_m < lq
    tl.store(ptrs, tl.where(finite_row, top, 0.0), mask=live_rows)
    log_sum = tl.where(finite_row, tl.log(divisor), tl.where(state == 2, tl.log(tl.maximum(posinf_count, 1.0)), 0.0))
    tl.store(ptrs + 1, log_sum, mask=live_rows)
    normalized_row = finite_row & NORMALIZED  # plain does not track the min and the tie counts: zeros
    tl.store(ptrs + 2, tl.where(normalized_row, low, 0.0), mask=live_rows)
    tl.store(ptrs + 3, tl.where(normalized_row, high, 0.0), mask=live_rows)
    tl.store(ptrs + 4, tl.where(normalized_row, bottom_count, 0.0), mask=live_rows)
    tl.store(ptrs + 5, tl.where(normalized_row, top_count, 0.0), mask=live_rows)
    tl.store(ptrs + 6, state.to(ACC), mask=live_rows)


@triton.jit
def _gradient_sums_add(x, offs_n, sums, stats, values, ACC: tl.constexpr):
    """The normalized dq kernel's ``(P, Q) = (sum g w phi, sum g w)`` with one score tile added."""
    total, weighted = sums
    c0, c1, low, s, span, state = stats
    v_base, offs_dv, lk, value_dim, sv_n, sv_d, do_tile = values
    _, w, phi = _lean_weights(x, c0, c1, low, s, span, state, True)
    v_tile = load_tile(v_base, offs_n, offs_dv, lk, value_dim, sv_n, sv_d)
    g = mma(do_tile, tl.trans(v_tile), ACC)
    return total + tl.sum(g * w * phi, 1), weighted + tl.sum(g * w, 1)


@triton.jit
def _dq_add(x, slope, offs_n, dq, stats, values, terms, NORMALIZED: tl.constexpr, SOFTCAP: tl.constexpr,
            ACC: tl.constexpr):
    """``dq`` with one score tile's ``ds k`` added (:func:`_lean_score_grad`)."""
    c0, c1, low, s, span, state = stats
    v_base, offs_dv, lk, value_dim, sv_n, sv_d, do_tile = values
    total, high, through_scale, low_term, high_term, k_base, offs_d, head_dim, sk_n, sk_d = terms
    v_tile = load_tile(v_base, offs_n, offs_dv, lk, value_dim, sv_n, sv_d)
    g = mma(do_tile, tl.trans(v_tile), ACC)
    safe, w, phi = _lean_weights(x, c0, c1, low, s, span, state, NORMALIZED)
    ds = _lean_score_grad(safe, w, phi, g, total, low, high, through_scale, low_term, high_term, NORMALIZED)
    if SOFTCAP:
        ds = ds * slope
    k_tile = load_tile(k_base, offs_n, offs_d, lk, head_dim, sk_n, sk_d)
    return dq + rounded_mma(ds, k_tile, ACC)


@triton.jit
def _self_adjusted_dq_kernel(
    Q, K, V, DO, TOTAL, STATS_PTR, DQ, WEIGHTED, D_SINK,
    sq_b, sq_h, sq_m, sq_d, sk_b, sk_h, sk_n, sk_d, sv_b, sv_h, sv_n, sv_d, so_b, so_h, so_m, so_d,
    heads, group, lq, lk, head_dim, value_dim, scale: tl.float64,
    key_start, key_stop, range_stride,
    dense, dense_sb, dense_sh, dense_sm, dense_sn, additive, add_sb, add_sh, add_sm, add_sn,
    softcap_ptr, sink, sink_sb, sink_sh, sink_sm,
    HAS_RANGE: tl.constexpr, HAS_DENSE: tl.constexpr, HAS_ADDITIVE: tl.constexpr, NORMALIZED: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_SINK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, ACC: tl.constexpr,
):
    """One query block: ``dq = scale sum_j ds_j k_j`` over its key blocks.

    Plain: ``P`` comes from the pre-pass.  Normalized: a first loop sums ``P = sum g y``
    and ``Q = sum g w`` from the very ``g`` the dk/dv kernel sees (``P`` from the rounded
    ``out`` would not cancel ``g w`` in rows with a tiny span) and writes them for it.
    With softcap ``ds`` is multiplied by the cap's slope; with sinks, each row's sink
    (``g = 0``: its value is zero) gets its ``ds`` from the same formula, written to ``D_SINK``.
    """
    scale = as_acc(scale, ACC)
    bh = tl.program_id(1).to(tl.int64)  # offsets pass 2^31 on long contexts
    batch, head, kv_head, offs_m, offs_d, offs_dv = query_program(bh, heads, group, BLOCK_M, BLOCK_D, BLOCK_DV)
    masking = (dense, dense_sb, dense_sh, dense_sm, dense_sn, additive, add_sb, add_sh, add_sm, add_sn)
    q_tile = load_tile(Q + batch * sq_b + head * sq_h, offs_m, offs_d, lq, head_dim, sq_m, sq_d)
    do_tile = load_tile(DO + batch * so_b + head * so_h, offs_m, offs_dv, lq, value_dim, so_m, so_d)
    k_base = K + batch * sk_b + kv_head * sk_h
    v_base = V + batch * sv_b + kv_head * sv_h
    rows = bh * lq + offs_m
    c0, c1, low, high, low_count, high_count, state = _load_stats(STATS_PTR, rows, offs_m, lq, ACC)
    row_start, row_stop, lo, hi = key_block_bounds(key_start, key_stop, range_stride, batch, offs_m, lq, lk, HAS_RANGE)
    lo = lo // BLOCK_N * BLOCK_N
    softcap = tl.load(softcap_ptr)

    s, span = _span(low, high)
    inner_lo, inner_hi, masked = inner_key_blocks(row_start, row_stop, offs_m, lq, lk, lo, hi, BLOCK_N)
    values = (v_base, offs_dv, lk, value_dim, sv_n, sv_d, do_tile)
    stats = (c0, c1, low, s, span, state)
    if NORMALIZED:
        sums = (tl.zeros((BLOCK_M,), ACC), tl.zeros((BLOCK_M,), ACC))
        for i in range(0, masked):  # the masked key blocks, then the inner ones
            offs_n = masked_block_start(i, lo, inner_lo, inner_hi, BLOCK_N) + tl.arange(0, BLOCK_N)
            x = key_scores(q_tile, k_base, sk_n, sk_d, offs_m, offs_n, offs_d, head_dim, row_start, row_stop, lk, scale,
                           softcap, batch, head, masking, HAS_DENSE, HAS_ADDITIVE, SOFTCAP, ACC)
            sums = _gradient_sums_add(x, offs_n, sums, stats, values, ACC)
        for start in range(inner_lo, inner_hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            x = key_scores(q_tile, k_base, sk_n, sk_d, offs_m, offs_n, offs_d, head_dim, row_start, row_stop, lk, scale,
                           softcap, batch, head, masking, HAS_DENSE, HAS_ADDITIVE, SOFTCAP, ACC, False)
            sums = _gradient_sums_add(x, offs_n, sums, stats, values, ACC)
        total, weighted = sums
        tl.store(TOTAL + rows, total, mask=offs_m < lq)
        tl.store(WEIGHTED + rows, weighted, mask=offs_m < lq)
        low_term, high_term = _span_terms(total, weighted, low, high, low_count, high_count, state)
    else:
        total = _load_total(TOTAL, rows, offs_m, lq, state)
        low_term = tl.zeros((BLOCK_M,), ACC)
        high_term = low_term
    through_scale = _through_scale(low, high, state)
    dq = tl.zeros((BLOCK_M, BLOCK_D), ACC)
    terms = (total, high, through_scale, low_term, high_term, k_base, offs_d, head_dim, sk_n, sk_d)
    for i in range(0, masked):
        offs_n = masked_block_start(i, lo, inner_lo, inner_hi, BLOCK_N) + tl.arange(0, BLOCK_N)
        x, slope = key_scores_slope(q_tile, k_base, sk_n, sk_d, offs_m, offs_n, offs_d, head_dim, row_start, row_stop,
                                    lk, scale, softcap, batch, head, masking, HAS_DENSE, HAS_ADDITIVE, SOFTCAP, ACC)
        dq = _dq_add(x, slope, offs_n, dq, stats, values, terms, NORMALIZED, SOFTCAP, ACC)
    for start in range(inner_lo, inner_hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        x, slope = key_scores_slope(q_tile, k_base, sk_n, sk_d, offs_m, offs_n, offs_d, head_dim, row_start, row_stop,
                                    lk, scale, softcap, batch, head, masking, HAS_DENSE, HAS_ADDITIVE, SOFTCAP, ACC,
                                    False)
        dq = _dq_add(x, slope, offs_n, dq, stats, values, terms, NORMALIZED, SOFTCAP, ACC)
    tl.store(DQ + rows[:, None] * head_dim + offs_d[None, :], (dq * scale).to(DQ.dtype.element_ty),
             mask=(offs_m < lq)[:, None] & (offs_d < head_dim)[None, :])
    if HAS_SINK:
        sink_logit = sink_scores(sink, sink_sb, sink_sh, sink_sm, batch, head, offs_m, lq, HAS_SINK, BLOCK_M, ACC)
        sink_xs, sink_w, sink_used, _ = _weights(sink_logit[:, None], c0, c1, state)
        no_value = tl.zeros((BLOCK_M, 1), ACC)
        sink_ds = _score_grad(sink_xs, sink_w, sink_used, no_value, low, high, state, total, low_term, high_term,
                              NORMALIZED)
        tl.store(D_SINK + rows, tl.sum(sink_ds, 1), mask=offs_m < lq)


@triton.jit
def _self_adjusted_dkdv_kernel(
    Q, K, V, DO, TOTAL, STATS_PTR, WEIGHTED, DK, DV,
    sq_b, sq_h, sq_m, sq_d, sk_b, sk_h, sk_n, sk_d, sv_b, sv_h, sv_n, sv_d, so_b, so_h, so_m, so_d,
    heads, group, lq, lk, head_dim, value_dim, scale: tl.float64,
    key_start, key_stop, range_stride,
    dense, dense_sb, dense_sh, dense_sm, dense_sn, additive, add_sb, add_sh, add_sm, add_sn,
    softcap_ptr, sink, sink_sb, sink_sh, sink_sm,
    HAS_RANGE: tl.constexpr, HAS_DENSE: tl.constexpr, HAS_ADDITIVE: tl.constexpr, NORMALIZED: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_SINK: tl.constexpr, SCAN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, ACC: tl.constexpr,
):
    """One key block of one key/value head: ``dv = sum y^T dO``, ``dk = scale sum ds^T q`` over the group's queries."""
    scale = as_acc(scale, ACC)
    bh = tl.program_id(1).to(tl.int64)  # offsets pass 2^31 on long contexts
    batch, kv_head, start, offs_n, offs_d, offs_dv = key_program(bh, heads, group, BLOCK_N, BLOCK_D, BLOCK_DV)
    masking = (dense, dense_sb, dense_sh, dense_sm, dense_sn, additive, add_sb, add_sh, add_sm, add_sn)
    k_base = K + batch * sk_b + kv_head * sk_h
    v_tile = load_tile(V + batch * sv_b + kv_head * sv_h, offs_n, offs_dv, lk, value_dim, sv_n, sv_d)
    softcap = tl.load(softcap_ptr)
    dk = tl.zeros((BLOCK_N, BLOCK_D), ACC)
    dv = tl.zeros((BLOCK_N, BLOCK_DV), ACC)
    first, last = query_block_range(key_start, key_stop, range_stride, batch, start, lq, lk, HAS_RANGE, BLOCK_M,
                                    BLOCK_N, SCAN)
    for member in range(group):
        head = kv_head * group + member
        for query_block in range(first, last):  # no test per block: its loads are prefetched
            offs_m, row_start, row_stop, q_tile, do_tile = query_block_tiles(
                query_block, Q + batch * sq_b + head * sq_h, DO + batch * so_b + head * so_h, offs_d, offs_dv,
                head_dim, value_dim, sq_m, sq_d, so_m, so_d, key_start, key_stop, range_stride, batch, lq, lk,
                HAS_RANGE, BLOCK_M)
            rows = (batch * heads + head) * lq + offs_m
            c0, c1, low, high, low_count, high_count, state = _load_stats(STATS_PTR, rows, offs_m, lq, ACC)
            total = _load_total(TOTAL, rows, offs_m, lq, state)
            x, slope = key_scores_slope(q_tile, k_base, sk_n, sk_d, offs_m, offs_n, offs_d, head_dim, row_start,
                                        row_stop, lk, scale, softcap, batch, head, masking, HAS_DENSE,
                                        HAS_ADDITIVE, SOFTCAP, ACC)
            s, span = _span(low, high)
            if NORMALIZED:
                weighted = tl.load(WEIGHTED + rows, mask=offs_m < lq, other=0.0)
                low_term, high_term = _span_terms(total, weighted, low, high, low_count, high_count, state)
            else:
                low_term = tl.zeros((BLOCK_M,), ACC)
                high_term = low_term
            safe, w, phi = _lean_weights(x, c0, c1, low, s, span, state, NORMALIZED)
            y = phi * w
            if tl.max((state == 2).to(tl.int32), 0) > 0:
                # A +inf row's weights sit uniformly on its +inf keys, factor 1 (normalized) or +inf (plain).
                posinf_keys = (state == 2)[:, None] & (x == float("inf"))
                if NORMALIZED:
                    y += tl.where(posinf_keys, tl.exp((0.0 - c0) - c1)[:, None], 0.0)
                else:
                    y = tl.where(posinf_keys, float("inf"), y)
            dv += rounded_mma(tl.trans(y), do_tile, ACC)
            g = mma(do_tile, tl.trans(v_tile), ACC)
            ds = _lean_score_grad(safe, w, phi, g, total, low, high, _through_scale(low, high, state), low_term,
                                  high_term, NORMALIZED)
            if SOFTCAP:
                ds = ds * slope
            dk += rounded_mma(tl.trans(ds), q_tile, ACC)
    key_rows = bh * lk + offs_n
    tl.store(DK + key_rows[:, None] * head_dim + offs_d[None, :], (dk * scale).to(DK.dtype.element_ty),
             mask=(offs_n < lk)[:, None] & (offs_d < head_dim)[None, :])
    tl.store(DV + key_rows[:, None] * value_dim + offs_dv[None, :], dv.to(DV.dtype.element_ty),
             mask=(offs_n < lk)[:, None] & (offs_dv < value_dim)[None, :])


# ---- host functions ------------------------------------------------------------------------


def _common(shape: Problem, q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask, scale: float,
            softcap: float | None, sinks: Tensor | None) -> tuple:
    """The launch arguments every kernel takes: strides of q, k, v; sizes and scale; mask and modifier keywords."""
    strides = (*q.stride(), *k.stride(), *v.stride())
    sizes = (*shape.sizes, float(scale))
    acc = rules.accumulation_dtype(q.dtype)
    keywords = dict(**mask_arguments(mask, shape.score_shape, q.device),
                    **modifier_arguments(softcap, sinks, shape.score_shape, acc, q.device))
    return strides, sizes, keywords


@replay.replayable
def self_adjusted_attention_forward(
    q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask, scale: float, normalized: bool,
    softcap: float | None = None, sinks: Tensor | None = None, float_out: bool = False,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Self-Adjusted Softmax attention: ``out = (phi(x) softmax(x)) v``, ``x = cap(scale q k^T) + additive``.

    One pass over K and V per query block (two in query blocks holding a row with a +inf
    score); writes ``out`` and :data:`STATS` per-row stats.

    Args:
        q: ``(B, Hq, Lq, D)``; k: ``(B, Hkv, Lk, D)``; v: ``(B, Hkv, Lk, Dv)``; ``Hq % Hkv == 0``
            (query head ``h`` uses key/value head ``h // (Hq // Hkv)``), one float dtype.
        mask: which keys each query row may attend.
        scale: the score scale.
        normalized: ``phi(x) = (x - low) / (high - low)`` instead of ``x``.
        softcap: None, or the cap ``> 0``: ``cap(s) = softcap tanh(s / softcap)``.
        sinks: None, or each row's sink score, broadcastable to ``(B, Hq, Lq)``: one more key
            of value zero, inside the softmax, ``low`` and ``high``, its weight dropped.
        float_out: for float16 / bfloat16 inputs, also return the output unrounded, for the
            plain variant's ``P = rowsum(dO out)`` in :func:`self_adjusted_attention_backward`: one
            more store per row (``4 Dv`` bytes), no other work (normalized sums its own ``P``, so
            :func:`attnorm.kernels.attention_ops.self_adjusted_attention` asks for it for plain only).

    Returns:
        ``(out, stats, out_float)``: ``(B, Hq, Lq, Dv)`` in q's dtype (zero rows where no key is
        allowed, NaN rows where a score is NaN); ``(B, Hq, Lq, 7)`` in the accumulation dtype, laid
        out as :data:`STATS` says (the sink counted as a key); the output in the accumulation dtype
        with ``float_out`` and half-precision inputs, else None.
    """
    shape = problem(q, k, v)
    out = launch.empty((shape.batch, shape.heads, shape.lq, shape.value_dim), q.dtype, q.device)
    stats = shape.row_tensor(STATS, like=q)
    out_float = shape.float_output(q, float_out)
    if out.numel() == 0 and stats.numel() == 0:
        return out, stats, out_float
    q, k, v = dot_operands(q, k, v)
    strides, sizes, keywords = _common(shape, q, k, v, mask, scale, softcap, sinks)
    launch.launchable(_self_adjusted_forward_kernel)[shape.query_grid](
        q, k, v, out, out if out_float is None else out_float, stats, *strides, *sizes, **keywords,
        NORMALIZED=bool(normalized), ONE_SUM=not normalized and v.dtype != torch.float16,
        FLOAT_OUT=out_float is not None, **shape.constants, **launch_options(shape, q),
    )
    return out, stats, out_float


@replay.replayable
def self_adjusted_attention_backward(
    q: Tensor, k: Tensor, v: Tensor, out: Tensor, grad_out: Tensor, stats: Tensor, mask: AttentionMask,
    scale: float, normalized: bool, softcap: float | None = None, sinks: Tensor | None = None,
    out_float: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Gradients of :func:`self_adjusted_attention_forward` by recomputation (formulas in the module docstring).

    Plain: a pre-pass ``P = rowsum(dO * out)`` (no K/V; from ``out_float``, the forward's
    unrounded output, when given: ``g (1 + x) - P`` cancels, and from a float16 ``out`` dq and dk
    were 2-3x further from float64 than the other families'), the dq kernel (one pass over K
    and V per query block).  Normalized: the dq kernel sums ``P = sum g y`` and
    ``Q = sum g w`` in a first pass over K and V, then accumulates dq in a second.  Then
    the dk/dv kernel (one pass over the group's q and dO per key block).  Rows in state 0,
    2 or 3 (no key, +inf, NaN) get no score gradient; +inf rows still pass their weights to
    ``dv``.  Normalized tiles take the lean path (``_lean_weights``: one per-score select,
    then none but the paths through ``low`` and ``high``).

    Returns:
        ``(dq, dk, dv, d_sinks)``: shaped and typed like ``q``, ``k``, ``v``; the score
        gradient of each row's sink ``(B, Hq, Lq)`` in the accumulation dtype, or None
        without ``sinks``.
    """
    shape = problem(q, k, v)
    stats = stats.contiguous()
    dq = launch.empty(tuple(q.shape), q.dtype, q.device)
    dk = launch.empty(tuple(k.shape), k.dtype, k.device)
    dv = launch.empty(tuple(v.shape), v.dtype, v.device)
    # Plain: P = rowsum(dO * out) before the kernels; normalized: the dq kernel sums P itself.
    total = shape.row_tensor(like=q) if normalized else row_dot(shape, out if out_float is None else out_float,
                                                                grad_out)
    weighted = shape.row_tensor(like=q)
    d_sinks = None if sinks is None else shape.row_tensor(like=q)
    q, k, v, grad_out = dot_operands(q, k, v, grad_out)
    strides, sizes, keywords = _common(shape, q, k, v, mask, scale, softcap, sinks)
    arguments = (*strides, *grad_out.stride(), *sizes)
    constants = dict(**keywords, NORMALIZED=bool(normalized), **shape.constants, **launch_options(shape, q))
    if dq.numel():
        launch.launchable(_self_adjusted_dq_kernel)[shape.query_grid](
            q, k, v, grad_out, total, stats, dq, weighted, weighted if d_sinks is None else d_sinks, *arguments,
            **constants,
        )
    if dk.numel() or dv.numel():
        launch.launchable(_self_adjusted_dkdv_kernel)[shape.key_grid](
            q, k, v, grad_out, total, stats, weighted, dk, dv, *arguments, **constants, SCAN=RANGE_SCAN,
        )
    return dq, dk, dv, d_sinks
