"""Fused flash-style alpha-entmax and sparsemax attention: forward and backward, nothing of size Lq x Lk.

``out = p v`` with ``p = entmax_alpha(scale q k^T + additive)`` over the allowed keys of
each query row (Peters, Niculae & Martins, 2019; alpha = 2 is sparsemax, alpha = 1
softmax): ``p_ij = [z_ij - tau_i]_+^(1 / (alpha - 1)) / N_i`` with
``z_ij = (alpha - 1)(s_ij - m_i)``, ``m_i`` the row's largest score, ``tau_i`` its
threshold and ``N_i`` a normaliser (1 in exact arithmetic, kept so that rows sum to 1
to rounding).  The structure follows FlashAttention-2 (one program per query block
and batch x head, score tiles recomputed from ``q`` and ``k`` in float32 by
:func:`~attnorm.kernels.triton.attention_blocks.score_tile`, per-row statistics in
place of the score matrix) and AdaSplash (the threshold found by a safeguarded
root search whose every step is one pass over the keys).

Forward, per query block (``1 + I + 1`` passes over K, one over V):

1. one pass over K: each row's max ``m``, allowed count ``n`` and ``sum (s - m)``;
2. ``I`` Newton passes over K for ``tau``: Newton's method on the convex
   ``F(tau) = ||[z - tau]_+||_p = 1`` (``p = 1 / (alpha - 1) >= 1``) from the larger of
   two lower bounds, ``-1`` and Hölder's ``(sum z - n^(2 - alpha)) / n``, safeguarded
   by the bracket ``[-1, -n^(1 - alpha)]`` (bisection when a step leaves it).  Newton
   on a convex function climbs monotonically to the root, so each row stops when a
   step no longer climbs; the block stops when all its rows have (no host
   synchronisation; at most :data:`MAX_STEPS` passes).  For sparsemax these steps
   are Michelot's algorithm and the threshold is finished exactly,
   ``tau = (sum of the support's z - 1) / |support|`` (``N = 1``).  For a constant
   alpha of 2 or 1.5 each pass also takes its support's least ``z``: the threshold
   has a closed form on a known support (:func:`_settle`), and a row whose support
   keeps every ``z`` above it stops on that pass, without the pass that would only
   confirm it (1.5-entmax then also skips Newton's last quadratic steps, ``N = 1``).
   The first of these passes also bins each row's ``z`` over ``(-1, 0]``, where tau lies,
   into :data:`HIST_BITS` ``= 4``: 16 bins (:func:`_gap_histogram`: the packed 8-bit counts of
   the top-k kernel's radix select, ~14 integer operations a score, that pass only; not for
   softmax, alpha = 1); a key lies above its bin's lower edge, so the counts give ``F`` a lower
   bound whose root is a lower bound of tau (:func:`_histogram_floor`, no pass over the keys),
   and the second step starts there when Newton's own falls short of it;
3. one output pass over K and V accumulating ``p v`` in float32 (float64 for
   float64 inputs).  Under :data:`.attention_launch.SKIP_EMPTY_TILES` a tile where no
   row of the block has a positive weight loads no V and skips its ``p v`` product; by
   default every tile's loads are prefetched and its (zero) products computed.

The forward keeps per row ``(m, tau, N)``: 12 bytes (24 for float64), the ``stats``
tensor ``(B, Hq, Lq, 3)``.  ``I`` counts the pass that confirms convergence; measured
with random q, k (head dim 64, Lk = 512, blocks of 64, scale 1 to 3 / sqrt(64)) it is
4-7 for alpha in {1.1, 1.25, 1.5, 2}.  With the closed-form stop, a float32 model of
the loop (64-row blocks, q, k ~ N(0, 1), head dim 64, scale 1 / 8) takes, against
before: sparsemax 5.3 / 6.2 passes at Lk = 1024 / 16384 (6.5 / 7.5), 1.5-entmax
5.0 / 5.8 (7.0 / 8.0); the stop costs ~3 (sparsemax) and ~4 (1.5) SASS instructions
per score and pass (sm_90, ``scripts/sass_loops.py``: 15.1 -> 17.9 and 18.5 -> 22.5).
The histogram's floor, counted on the kernel itself under the interpreter with blocks of 64
(``scripts/threshold_passes.py``, same model of the scores), threshold passes per query block
without -> with it: sparsemax 4.91 -> 3.59 (causal, L = 1024), 5.50 -> 4.00 (one query
block, Lk = 4096), 6.00 -> 4.00 (Lk = 16384); 1.5-entmax 4.72 -> 4.00, 5.00 -> 4.00,
6.00 -> 4.50; alpha = 1.25 (a runtime alpha) 5.66 -> 5.62, 6.00 -> 6.00 (with ``p = 4`` the
counts bound ``F`` loosely).  32 bins (``HIST_BITS = 5``) gave 3.16 / 3.00 / 3.50 and
3.84 / 4.00 / 4.00, for ~8 operations a score more in the first pass and twice the
histogram's registers: untimed, a choice for a GPU run.
The output is exact for sparsemax (to the rounding of the scores), accurate to a few
ulps otherwise.

Backward, with ``g_ij = p_ij^(2 - alpha)`` on the support and ``dP = dO v^T``
(the closed-form entmax Jacobian): ``dS = g (dP - delta)``,
``delta_i = sum_j g_ij dP_ij / sum_j g_ij``, ``dq = scale dS k``, ``dk = scale dS^T q``,
``dv = p^T dO`` and, per row, ``d alpha = beta (sum(dP T) - sum(T) / sum(g) sum(g dP))``,
``beta = 1 / (alpha - 1)``, ``T = p (beta - log p)`` (0 for alpha = 1 heads); the rows'
alpha gradients are summed per head in torch.  Three kernels, none with atomics,
so the gradients are deterministic (bitwise equal from run to run):

* ``delta``: when alpha's gradient is not wanted, from ``W = sum_j g_j v_j / sum_j g_j``,
  which the forward's output pass accumulates beside ``p v`` (``weighted=True``; one more
  product per tile with support, none at alpha = 1 where ``W`` is the output) and keeps,
  ``Dv`` floats per row: ``delta = dO . W``, a per-row dot product with no pass over K
  and V, as FlashAttention-2 takes its ``delta`` from ``out``.  With alpha's gradient, a row
  pass per query block (one pass over K and V) computes ``delta`` and the row's alpha
  gradient: 4 bytes per row each (8 for float64), kept O(L);
* ``dq``: one program per query block, one more pass over K and V;
* ``dk, dv``: one program per key block and key/value head, looping over the
  query blocks (and the group's query heads, GQA) whose key range reaches it: one
  pass over Q and dO per key block.

So the backward makes one pass over K and V per query block (two with alpha's gradient)
and one over Q and dO per key block, as FlashAttention-2 (whose ``delta`` is
``rowsum(dO o)``: entmax's weighs ``dP`` by ``g``, not ``p``, hence ``W``).  Under ``SKIP_EMPTY_TILES`` tiles with no
positive weight skip every product after the scores in all three.  A dk/dv program loops over the query blocks that
reach its key block (:func:`~attnorm.kernels.triton.attention_blocks.query_block_range`), with no test around the
loads.  Key blocks outside a query block's key range
(:func:`~attnorm.kernels.triton.attention_blocks.key_block_bounds`: causal, sliding
window, key padding, documents) are never visited.

Supported: alpha in ``[1, 2]`` (python number, or a float32 tensor per query head);
for alpha > 2 the weights ``(z - tau)^p`` with ``p < 1`` amplify the rounding of
``z - tau`` (see :mod:`attnorm.kernels.triton.entmax`), which this kernel does not
correct, so python numbers above 2 raise ValueError.  Accuracy falls like
``eps / (alpha - 1)`` as alpha approaches 1 from above (1 itself is exact softmax).
float16 / bfloat16 / float32 with float32 accumulation; float64 with float64
accumulation (on an H100, 2026-11-26, float64 sparsemax matched to 1e-14).  Every product
is :func:`.attention_blocks.mma`: float32 operands at full float32 precision, not
TF32 (Triton's default, which put 1e-3 errors into float32 attention on the H100).  Head dims up to 256 (padded to
a power of 2, at least 16).  A row with no allowed key gives a zero output and zero
gradients; a NaN score at an allowed key makes its row NaN (output and gradients).  A
row holding +inf scores takes their limit, the rule of every attnorm normalizer: uniform
weights over its +inf keys (the sink's too when it is +inf), whatever alpha, and no
gradient to its scores, alpha, sink or logit multiplier.  Pass 1 counts +inf keys apart
from NaN ones; such a row skips the threshold search and keeps ``m = +inf`` (its flag
in the stats), ``N`` its +inf count and ``tau = -1`` (0 for softmax heads), so that the
weights read the gap ``inf - inf`` as 0 (:func:`_weights`: two operations a score in
every pass that computes weights) and the backward's ``g`` is 0 there (:func:`_gppr_scale`).

**Softcap, sinks and a logit multiplier.**  The logits are
``c_i (cap tanh(scale q k^T / cap) + additive)`` with the cap under ``SOFTCAP`` (one
``exp`` per score more, in every pass) and ``c_i`` a per-row multiplier under
``HAS_LOGIT_SCALE`` (temperature, Scalable-Softmax: softmax at alpha = 1); a sink is a
per-row logit ``sigma_i`` (``HAS_SINK``), one more allowed key of value zero: it starts
pass 1 (``m``, ``n``, ``sum (s - m)``), each Newton pass's sums, and, in the backward,
``sum g`` (and ``sum T`` for alpha) of the row pass; no pass over K or V is added.  The
backward chains ``dS = c G (1 - tanh^2)`` with ``G = g (dP - delta)`` the gradient of a
logit, and the dq kernel writes per row the sink's logit gradient ``-g_sink delta`` and
the multiplier's ``sum_j G_ij s_ij``: 4 bytes per row each (8 for float64), read back
by torch (summed over batch and rows for a sink per head).  A row whose keys are all
masked but which has a sink puts its whole weight on the sink: a zero output, zero
gradients.

Block size, shape checks and operands: :mod:`.attention_launch`; mask arguments,
key-block bounds and tiles: :mod:`.attention_blocks`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from attnorm.kernels import rules
from attnorm.kernels.rules import AttentionMask
from attnorm.kernels.triton import attention_launch, launch, replay
from attnorm.kernels.triton.attention_blocks import (
    RANGE_SCAN,
    inner_key_blocks,
    key_block_bounds,
    key_program,
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
    row_arguments,
    row_values,
    sink_scores,
)
from attnorm.kernels.triton.attention_launch import dot_operands, launch_options, narrow_cuda, problem, row_dot
from attnorm.kernels.triton.attention_topk import _digit_histogram
from attnorm.kernels.triton.entmax import _power

__all__ = ["entmax_attention_backward", "entmax_attention_forward"]

MAX_STEPS = 50
"""Cap on Newton passes per query block (twice as many for float64)."""

STATS = 3
"""Per-row statistics kept by the forward: row max ``m``, threshold ``tau``, normaliser ``N``."""

HIST_BITS = 4
"""The first threshold pass bins each row's ``z`` over ``(-1, 0]`` into ``2^HIST_BITS`` bins (:func:`_gap_histogram`);
each bit more doubles the packed counts' words (a row reduction each per tile)."""

HISTOGRAM_FLOOR = False
"""Whether the first threshold pass bins ``z`` for a lower bound of tau (the ``HIST`` constexpr of the forward).

Off: it saves threshold passes but costs more time than they took.  Counted under the interpreter
(``scripts/threshold_passes.py``) it saves 2 of ~6 threshold passes at Lk = 16384 for sparsemax,
1.5 for 1.5-entmax; but it adds ~14 operations a score to the first pass and registers (the sm_90
forward for 2-byte inputs at head dim 64, 4 warps, at 255 registers without it, spills 56-136
bytes a thread with it; Triton 3.6, ``scripts/compile_check.py``).  Timed on an H200 (bf16, causal,
16 heads, head dim 64, L = 16384; ``scripts/tune_attention.py --settings 64x4x3 64x4x3+hist``,
``benchmarks/results/tune_attention_h200_c71da1d.md``): the forward takes 14.12 ms without it and
14.96 with it for sparsemax, 15.47 and 17.17 for 1.5-entmax.  ``+hist`` turns it on there.
"""

_HIST_BITS = tl.constexpr(HIST_BITS)
TALLY_BITS = 8
_TALLY_BITS = tl.constexpr(TALLY_BITS)  # the first pass's per-kind field width in its one integer row sum
_TALLY_INF = tl.constexpr(1 << TALLY_BITS)
_TALLY_NAN = tl.constexpr(1 << 2 * TALLY_BITS)
_TALLY_MASK = tl.constexpr((1 << TALLY_BITS) - 1)
_FLOOR_MARGIN = tl.constexpr(2.0**-20)
_HIST_BINS = tl.constexpr(1 << HIST_BITS)


# ---- tiles ---------------------------------------------------------------------------------


@triton.jit
def _score_parts(q_tile, keys, offs_m, start, rows, masks,
                 HAS_DENSE: tl.constexpr, HAS_ADDITIVE: tl.constexpr, SOFTCAP: tl.constexpr,
                 HAS_LOGIT_SCALE: tl.constexpr, BLOCK_N: tl.constexpr, ACC: tl.constexpr,
                 MASKED: tl.constexpr = True):
    """The logit tile of keys ``start + [0, BLOCK_N)``, with what the backward's chain rule needs.

    ``keys`` = (base, row stride, column stride, offs_d, head_dim) of the key rows,
    ``rows`` = (row_start, row_stop, lk, scale, b, h, softcap, logit_scale), ``masks`` the
    dense and additive arguments.  Returns ``(logits, scores, slope, offs_n)``: the masked
    (capped) scores times the row's logit multiplier (under ``HAS_LOGIT_SCALE``), the
    scores themselves and the cap's derivative (:func:`.attention_blocks.score_tile_slope`).
    ``MASKED`` False: an inner tile (:func:`.attention_blocks.inner_key_blocks`), no interval test.
    """
    offs_n = start + tl.arange(0, BLOCK_N)
    scores, slope = key_scores_slope(q_tile, keys[0], keys[1], keys[2], offs_m, offs_n, keys[3], keys[4],
                                     rows[0], rows[1], rows[2], rows[3], rows[6], rows[4], rows[5], masks,
                                     HAS_DENSE, HAS_ADDITIVE, SOFTCAP, ACC, MASKED)
    logits = scores
    if HAS_LOGIT_SCALE:
        logits = tl.where(scores == float("-inf"), scores, scores * rows[7][:, None])
    return logits, scores, slope, offs_n


@triton.jit
def _score_block(q_tile, keys, offs_m, start, rows, masks,
                 HAS_DENSE: tl.constexpr, HAS_ADDITIVE: tl.constexpr, SOFTCAP: tl.constexpr,
                 HAS_LOGIT_SCALE: tl.constexpr, BLOCK_N: tl.constexpr, ACC: tl.constexpr,
                 MASKED: tl.constexpr = True):
    """The masked logit tile of keys ``start + [0, BLOCK_N)`` and its keys (:func:`_score_parts`)."""
    logits, _, _, offs_n = _score_parts(q_tile, keys, offs_m, start, rows, masks, HAS_DENSE, HAS_ADDITIVE, SOFTCAP,
                                        HAS_LOGIT_SCALE, BLOCK_N, ACC, MASKED)
    return logits, offs_n


@triton.jit
def _mass(u, power, softmax):
    """Unnormalised weights ``[u]_+^p`` of gaps ``u = z - tau`` (``exp(u)`` for softmax heads)."""
    if softmax:
        mass = tl.exp(u)
    else:
        mass = _power(u, power)
    return mass


@triton.jit
def _weights(scores, row_max, tau, norm, multiplier, power, softmax):
    """Gaps, unnormalised and final weights of a tile (NaN at allowed keys of a NaN row, whose ``N`` is NaN).

    A row holding +inf has ``m = +inf``: its +inf keys' gap ``inf - inf`` (NaN) is read as 0, so ``u = -tau``
    gives them a mass of 1 (:func:`_posinf_rows`), and every finite key's gap is -inf.  One operation a score:
    ``tl.minimum`` returns the other operand of a NaN (IEEE minNum, on the GPU and under the interpreter), and
    every other gap is at most 0 already (``m`` is the row's largest score; a NaN row's result is NaN anyway).
    It was a test and a select, two operations a score in every pass that computes weights.
    """
    gap = scores - row_max[:, None]
    u = tl.minimum(gap, 0.0) * multiplier - tau[:, None]
    mass = _mass(u, power, softmax)
    p = tl.where(scores != float("-inf"), mass / norm[:, None], 0.0)
    return u, mass, p


@triton.jit
def _slope(u, mass, ALPHA: tl.constexpr):
    """``[u]_+^(p - 1)`` given ``mass = [u]_+^p``: 1 and ``u`` on the support for a constant alpha of 2 (sparsemax,
    ``p = 1``) and 1.5 (``p = 2``), no division; ``mass / u`` otherwise (one division per score, against a
    second power)."""
    on = u > 0
    if ALPHA == 2.0:
        slope = on.to(u.dtype)
    elif ALPHA == 1.5:
        slope = tl.where(on, u, 0.0)
    else:
        slope = tl.where(on, mass / tl.where(on, u, 1.0), 0.0)
    return slope


@triton.jit
def _gppr_scale(alpha, norm, row_max, softmax):
    """Per row, the factor of :func:`_gppr`: ``N^(alpha - 2)`` (1 for softmax heads), 0 in a row holding +inf.

    A +inf row's weights are uniform over its +inf keys whatever its scores and alpha, so its
    ``g``, hence every score gradient ``g (dP - delta)``, is 0 (:func:`_posinf_rows`).
    """
    factor = tl.where(softmax, 1.0, tl.exp2((alpha - 2) * tl.log2(norm)))
    return tl.where(row_max == float("inf"), 0.0, factor)


@triton.jit
def _gppr(u, mass, p, gppr_scale, softmax, ALPHA: tl.constexpr):
    """``p^(2 - alpha)`` on the support, as ``u^(p - 1) N^(alpha - 2)`` (no power of ``p`` needed); ``p`` times the
    row's 0-or-1 factor for softmax heads (:func:`_gppr_scale`)."""
    if softmax:
        gppr = p * gppr_scale[:, None]
    else:
        gppr = _slope(u, mass, ALPHA) * gppr_scale[:, None]
    return gppr


@triton.jit
def _pass_sums(z, tau, power, softmax, ALPHA: tl.constexpr):
    """Per row of shifted logits ``z`` at ``tau``: ``sum [u]_+^p``, ``sum [u]_+^(p-1)``, the support's size, its
    ``sum z`` and its least ``z`` (+inf where unused), ``u = z - tau``.

    For sparsemax (``p = 1``) from two row sums: ``sum [u]_+ = sum_S z - tau |S|`` and
    ``sum [u]_+^0 = |S|`` over the support ``S``, so a pass needs no power and no division
    (~10 operations per score against ~25).  The least ``z`` of the support (one row
    minimum more, on the support's own predicate) lets :func:`_settle` stop a row on the
    pass that finds its support; other alphas have no closed form for it and skip it.
    """
    if ALPHA == 2.0:
        on = z > tau[:, None]
        support = tl.sum(on.to(tl.int32), 1)
        support_z = tl.sum(tl.where(on, z, 0.0), 1)
        count = support.to(tau.dtype)
        mass, slope = support_z - tau * count, count
    else:
        u = z - tau[:, None]
        weights = _mass(u, power, softmax)
        on = u > 0
        mass, slope = tl.sum(weights, 1), tl.sum(_slope(u, weights, ALPHA), 1)
        support = tl.sum(on.to(tl.int32), 1)
        support_z = tl.sum(tl.where(on, z, 0.0), 1)
    if ALPHA == 2.0 or ALPHA == 1.5:
        least = tl.min(tl.where(on, z, float("inf")), 1)
    else:
        least = tl.full(tau.shape, float("inf"), tau.dtype)
    return mass, slope, support, support_z, least


@triton.jit
def _settle(tau, mass, slope, support, support_z, least, ALPHA: tl.constexpr):
    """Whether a pass at ``tau`` found the row's support, and the exact threshold on it (sparsemax, 1.5-entmax).

    The pass's support ``S = {z > tau}``, with ``tau`` at or below the root (``mass >= 1``),
    holds the true support.  On ``S`` the threshold has a closed form ``t``: sparsemax's
    ``(sum_S z - 1) / |S|`` (Michelot's step), and for 1.5-entmax the smaller root of
    ``sum_S (z - t)^2 = 1``, ``t = tau + (B - 1) / (A + sqrt(A^2 - |S| (B - 1)))`` with
    ``A = sum_S u``, ``B = sum_S u^2`` the pass's sums (``u = z - tau``; the rationalised
    form has no cancellation).  When every ``z`` of ``S`` stays above ``t``, ``S`` is the
    support at ``t`` and ``t`` is the root: the row stops on this pass instead of the
    next, which would only confirm it (Newton's iterate needs one more pass or several).
    1.5-entmax settles only where ``A^2 - |S| (B - 1) >= A^2 / 4``, so the root is as
    accurate as its inputs (near a double root the square root would amplify their
    rounding); such rows go on with Newton.
    """
    count = tl.maximum(support, 1).to(tau.dtype)
    if ALPHA == 2.0:
        closed = (support_z - 1) / count
        sound = support > 0
    else:
        excess = mass - 1
        disc = slope * slope - count * excess
        sound = (support > 0) & (disc >= 0.25 * slope * slope)
        closed = tau + excess / tl.where(sound, slope + tl.sqrt(tl.where(sound, disc, 0.0)), 1.0)
    return sound & (mass >= 1) & (least > closed), closed


@triton.jit
def _live(p, nan_rows):
    """Whether a tile needs its products: some weight is positive, or a row of the block is NaN."""
    return (tl.max(tl.max((p > 0).to(tl.int32), 1), 0) > 0) | (tl.max(nan_rows.to(tl.int32), 0) > 0)


@triton.jit
def _head_alpha(alpha_ptr, alpha_stride, head, ALPHA: tl.constexpr):
    """Head ``head``'s alpha: whether it is softmax (alpha = 1), ``alpha - 1`` (1 for softmax) and ``p``.

    ``ALPHA`` 0: read from ``alpha_ptr``; else the constant alpha (:data:`SPECIALISED_ALPHAS`), and all four
    are compile-time constants, so the power and softmax branches on them are resolved, not selected per score.
    """
    if ALPHA == 0.0:
        alpha = tl.load(alpha_ptr + head * alpha_stride)
        softmax = alpha == 1
        multiplier = tl.where(softmax, 1.0, alpha - 1)
        return alpha, softmax, multiplier, 1.0 / multiplier
    else:
        multiplier: tl.constexpr = 1.0 if ALPHA == 1.0 else ALPHA - 1.0
        return ALPHA, ALPHA == 1.0, multiplier, 1.0 / multiplier


@triton.jit
def _load_stats(STATS_PTR, row_base, offs_m, lq):
    """The forward's ``(m, tau, N)`` of the rows ``offs_m`` (padding rows: 0, 0, 1)."""
    rows = offs_m < lq
    ptr = STATS_PTR + (row_base + offs_m) * 3
    return (tl.load(ptr, mask=rows, other=0.0), tl.load(ptr + 1, mask=rows, other=0.0),
            tl.load(ptr + 2, mask=rows, other=1.0))


@triton.jit
def _row_modifiers(sink, sink_sb, sink_sh, sink_sm, logit_scale, logit_scale_sb, logit_scale_sh, logit_scale_sm,
                   batch, head, offs_m, lq, HAS_SINK: tl.constexpr, HAS_LOGIT_SCALE: tl.constexpr,
                   BLOCK_M: tl.constexpr, ACC: tl.constexpr):
    """Per row: the sink's logit (-inf without a sink, and past ``lq``) and the logit multiplier (1 without)."""
    sink_logit = sink_scores(sink, sink_sb, sink_sh, sink_sm, batch, head, offs_m, lq, HAS_SINK, BLOCK_M, ACC)
    if HAS_LOGIT_SCALE:
        row_scale = row_values(logit_scale, logit_scale_sb, logit_scale_sh, logit_scale_sm, batch, head, offs_m, lq,
                               1.0, ACC)
    else:
        row_scale = tl.full((BLOCK_M,), 1.0, ACC)
    return sink_logit, row_scale


# ---- forward -------------------------------------------------------------------------------


@triton.jit
def _posinf_rows(row_max, tau, norm, posinf, infinite, softmax, ACC: tl.constexpr):
    """``(m, tau, N)`` with the rows ``posinf`` (holding +inf, and no NaN) set to their limit: uniform over the
    +inf keys (``infinite`` of them).

    Such a row gets ``m = +inf`` (its flag in the stats), ``N`` its count of +inf keys (the sink's
    included) and ``tau`` -1 (0 for a softmax head), so that :func:`_weights` gives each +inf key
    the mass 1 and every finite key 0, the rule of every attnorm normalizer; its score
    gradients are 0 (:func:`_gppr_scale`).
    """
    row_max = tl.where(posinf, float("inf"), row_max)
    tau = tl.where(posinf, tl.where(softmax, 0.0, -1.0), tau)
    norm = tl.where(posinf, infinite.to(ACC), norm)
    return row_max, tau, norm


@triton.jit
def _max_add(scores, row_max, below, count, bad, infinite, ACC: tl.constexpr):
    """The first pass's per-row max, ``sum(s - max)`` (rescaled as the max grows) and counts (finite and +inf
    keys; ``bad`` nonzero once a NaN is seen), one tile on.

    The three kinds are tallied in one integer row sum, 8 bits a kind (a tile has fewer than 256
    keys a row): three sums of their own took ~6 instructions a score more in this pass (sm_90
    SASS, ``scripts/sass_loops.py``), ~8 % of a sparsemax forward's count.
    """
    tl.static_assert(scores.shape[1] < _TALLY_INF)
    finite = tl.abs(scores) < float("inf")  # False for +-inf and NaN
    kinds = tl.where(finite, 1, tl.where(scores == float("inf"), _TALLY_INF, tl.where(scores != scores, _TALLY_NAN, 0)))
    tally = tl.sum(kinds, 1)
    new_max = tl.maximum(row_max, tl.max(tl.where(finite, scores, float("-inf")), 1))
    pivot = tl.where(new_max == float("-inf"), 0.0, new_max)  # -inf - -inf would be NaN
    shift = tl.where(count > 0, row_max, pivot) - pivot
    below += count.to(ACC) * shift + tl.sum(tl.where(finite, scores, pivot[:, None]) - pivot[:, None], 1)
    count += tally & _TALLY_MASK
    infinite += (tally >> _TALLY_BITS) & _TALLY_MASK
    bad |= tally >> (2 * _TALLY_BITS)
    return new_max, below, count, bad, infinite


@triton.jit
def _gap_histogram(z, BLOCK_M: tl.constexpr):
    """Per row of a tile of shifted logits ``z``, the keys in each of ``2^HIST_BITS`` bins of ``(-1, 0]``.

    Bin ``d`` holds ``-(B - d) / B < z <= -(B - 1 - d) / B`` (``B`` bins, the top bin ``z`` near the row's
    max); keys at or below -1 (masked ones too), +inf and NaN count nowhere.  The counts are
    :func:`.attention_topk._digit_histogram`'s (8-bit fields, four to a word, a row reduction per word).
    """
    scaled = -z * _HIST_BINS
    inside = (scaled >= 0) & (scaled < _HIST_BINS)  # False for NaN
    gap_bin = tl.where(inside, scaled, 0.0).to(tl.int32)  # floor: scaled >= 0
    keys = tl.where(inside, _HIST_BINS - gap_bin, 0).to(tl.uint32)  # 1..B, 0 for none; digit = keys - 1
    ones = tl.full((BLOCK_M,), 1, tl.uint32)
    return _digit_histogram(keys, ones, tl.full((), 0, tl.uint32), BLOCK_M, tl.uint32, _HIST_BITS)


@triton.jit
def _histogram_floor(histogram, power, ACC: tl.constexpr):
    """Per row, a lower bound of tau from :func:`_gap_histogram`'s counts ``c_d`` (-1, tau's own, without one).

    Every key of bin ``d`` lies above the bin's lower edge ``L_d = -(B - d) / B``, so
    ``F(e) = sum [z - e]_+^p`` is at least ``H(e) = sum_d c_d [L_d - e]_+^p`` (the keys below -1
    and the sink add ``>= 0``), and the root of ``H`` is at or below tau.  Found in two steps on
    the ``B`` counts alone: the largest edge ``L_j`` with ``H(L_j) >= 1`` (``H`` decreases), then
    Newton on ``H`` from it (``H`` is convex there, so Newton climbs to the root without passing
    it; exact after one step for sparsemax, where ``H`` is linear between edges), less a margin of
    ``2^-20 (1 + |root|)`` against rounding.  Costs no pass over the keys.
    """
    counts = histogram.to(ACC)
    digits = tl.arange(0, _HIST_BINS)
    edges = (digits - _HIST_BINS).to(ACC) / _HIST_BINS
    bound = tl.full((histogram.shape[0],), -1.0, ACC)
    found = tl.zeros((histogram.shape[0],), tl.int1)
    for j in tl.static_range(_HIST_BINS):
        known = tl.sum(counts * _power((digits - j).to(ACC) / _HIST_BINS, power)[None, :], 1) >= 1
        bound = tl.where(known, -(_HIST_BINS - j) / _HIST_BINS, bound)
        found = found | known
    for _ in tl.static_range(4):
        gap = edges[None, :] - bound[:, None]
        value = tl.sum(counts * _power(gap, power), 1)
        slope = power * tl.sum(counts * _power(gap, power - 1), 1)
        bound = tl.where(found & (slope > 0), bound + (value - 1) / tl.where(slope > 0, slope, 1.0), bound)
    return tl.where(found, bound - (1 + tl.abs(bound)) * _FLOOR_MARGIN, -1.0)


@triton.jit
def _newton_add(scores, row_max, tau, multiplier, power, softmax, sums, ALPHA: tl.constexpr, HIST: tl.constexpr,
                BLOCK_M: tl.constexpr):
    """``sums`` (:func:`_newton_sums`) with one tile's added (and under ``HIST`` its gap histogram)."""
    mass, slope, support, support_z, least, histogram = sums
    z = (scores - row_max[:, None]) * multiplier
    block_mass, block_slope, block_support, block_z, block_least = _pass_sums(z, tau, power, softmax, ALPHA)
    if HIST:
        histogram += _gap_histogram(z, BLOCK_M)
    return (mass + block_mass, slope + block_slope, support + block_support, support_z + block_z,
            tl.minimum(least, block_least), histogram)


@triton.jit
def _newton_sums(q_tile, keys, offs_m, span, rows, masks, row_max, tau, multiplier, power, softmax, sink_logit,
                 HAS_DENSE: tl.constexpr, HAS_ADDITIVE: tl.constexpr, SOFTCAP: tl.constexpr,
                 HAS_LOGIT_SCALE: tl.constexpr, HAS_SINK: tl.constexpr, ALPHA: tl.constexpr, HIST: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ACC: tl.constexpr):
    """One pass over the keys at ``tau``: ``sum [u]_+^p``, ``sum [u]_+^(p-1)``, support size, its ``sum z``,
    least ``z`` of the support, and under ``HIST`` the gap histogram (:func:`_gap_histogram`; else a 0).

    The sink, a column of its own, starts the sums.  ``span`` = ``(first, inner_lo, inner_hi,
    masked)``: the masked key blocks, then the inner ones (:func:`.attention_blocks.inner_key_blocks`).
    """
    if HAS_SINK:
        mass, slope, support, support_z, least = _pass_sums(((sink_logit - row_max) * multiplier)[:, None], tau,
                                                            power, softmax, ALPHA)
    else:
        mass, slope, support = tl.zeros((BLOCK_M,), ACC), tl.zeros((BLOCK_M,), ACC), tl.zeros((BLOCK_M,), tl.int32)
        support_z, least = tl.zeros((BLOCK_M,), ACC), tl.full((BLOCK_M,), float("inf"), ACC)
    if HIST:
        histogram = tl.zeros((BLOCK_M, _HIST_BINS), tl.int32)
    else:
        histogram = tl.zeros((), tl.int32)
    sums = (mass, slope, support, support_z, least, histogram)
    first, inner_lo, inner_hi, masked = span
    for i in range(0, masked):
        start = masked_block_start(i, first, inner_lo, inner_hi, BLOCK_N)
        scores, _ = _score_block(q_tile, keys, offs_m, start, rows, masks, HAS_DENSE, HAS_ADDITIVE, SOFTCAP,
                                 HAS_LOGIT_SCALE, BLOCK_N, ACC)
        sums = _newton_add(scores, row_max, tau, multiplier, power, softmax, sums, ALPHA, HIST, BLOCK_M)
    for start in range(inner_lo, inner_hi, BLOCK_N):
        scores, _ = _score_block(q_tile, keys, offs_m, start, rows, masks, HAS_DENSE, HAS_ADDITIVE, SOFTCAP,
                                 HAS_LOGIT_SCALE, BLOCK_N, ACC, False)
        sums = _newton_add(scores, row_max, tau, multiplier, power, softmax, sums, ALPHA, HIST, BLOCK_M)
    return sums


@triton.jit
def _newton_step(sums, tau, low, high, active, settled, floor, step_count, alpha, max_steps, ALPHA: tl.constexpr):
    """One pass's update of the threshold search: the closed-form stop (alpha 2, 1.5), the bracket, the step.

    ``floor`` is a known lower bound of the root (the first pass's :func:`_histogram_floor`, else
    ``low``): the step, then the bracket's low end, are raised to it.  A step from below the root
    stays at or below it (Newton's on the convex ``F`` undershoots; the floor is below it too), so
    the search still only climbs.
    """
    mass, slope, support, support_z, least = sums
    if ALPHA == 2.0 or ALPHA == 1.5:
        found, closed = _settle(tau, mass, slope, support, support_z, least, ALPHA)
        found = found & active
        settled = settled | found
        tau = tl.where(found, closed, tau)
        active = active & ~found
    above = mass >= 1
    low = tl.where(above, tau, low)
    high = tl.where(above, high, tau)
    sloped = slope > 0
    newton = tau + (mass - _power(mass, 2 - alpha)) / tl.where(sloped, slope, 1.0)
    step = tl.where(sloped & (newton >= low) & (newton <= high), newton, 0.5 * (low + high))
    # After the step: a bracket raised first would send a Newton step below the floor to bisection,
    # whose midpoint may pass the root (and a search that then steps back stops there).
    step = tl.maximum(step, floor)
    low = tl.maximum(low, floor)
    step_count += 1
    # A Newton step on the convex F only climbs (the first may descend once, should
    # rounding put the start above the root): a step back is rounding noise at the root.
    climbing = tl.where(step_count == 1, True, step > tau)
    active = active & (step != tau) & climbing & (step_count < max_steps)
    tau = tl.where(active, step, tau)
    return tau, low, high, active, settled, step_count


@triton.jit
def _output_add(scores, offs_n, sums, stats, values, WEIGHTED: tl.constexpr, SPLIT: tl.constexpr,
                ALPHA: tl.constexpr, SKIP: tl.constexpr, ACC: tl.constexpr):
    """The output pass's sums one tile on: ``p v``, and under ``WEIGHTED`` ``g v`` and ``g`` (``g = p^(2 - alpha)``).

    ``stats`` = (row_max, tau, norm, multiplier, power, softmax, nan_rows, gppr_scale); ``values`` =
    (v_base, offs_dv, value_dim, lk, sv_n, sv_d).  Under ``SKIP`` a tile where no row has a positive weight
    loads no V.  Under ``SPLIT`` (2-byte V) ``g v`` is two products, ``g``'s 2-byte rounding and its remainder,
    so ``W`` carries no rounding of ``g``; for alpha = 1 ``weighted`` holds the remainder's product alone
    (``W`` = ``acc`` + it).
    """
    acc, weighted, gppr_sum = sums
    row_max, tau, norm, multiplier, power, softmax, nan_rows, gppr_scale = stats
    v_base, offs_dv, value_dim, lk, sv_n, sv_d = values
    u, mass, p = _weights(scores, row_max, tau, norm, multiplier, power, softmax)
    live = True
    if SKIP:  # attention_launch.SKIP_EMPTY_TILES: a tile without support loads nothing more
        live = _live(p, nan_rows)
    if live:
        v_tile = load_tile(v_base, offs_n, offs_dv, lk, value_dim, sv_n, sv_d)
        p_rounded = p.to(v_tile.dtype)
        acc += mma(p_rounded, v_tile, ACC)
        if WEIGHTED:
            g, g_rounded = p, p_rounded  # softmax: g = p, whose product is acc's
            if ALPHA != 1.0:
                g = _gppr(u, mass, p, gppr_scale, softmax, ALPHA)  # 0 off the support (NaN rows: set after)
                gppr_sum += tl.sum(g, 1)
                g_rounded = g.to(v_tile.dtype)
                weighted += mma(g_rounded, v_tile, ACC)
            if SPLIT:
                weighted += mma((g - g_rounded.to(ACC)).to(v_tile.dtype), v_tile, ACC)
    return acc, weighted, gppr_sum


@triton.jit
def _entmax_attention_forward_kernel(
    Q, K, V, OUT, STATS_PTR, WEIGHTED_PTR, scale_ptr, alpha_ptr, alpha_stride,
    sq_b, sq_h, sq_m, sq_d, sk_b, sk_h, sk_n, sk_d, sv_b, sv_h, sv_n, sv_d,
    heads, group, lq, lk, head_dim, value_dim, max_steps,
    key_start, key_stop, range_stride,
    dense, dense_sb, dense_sh, dense_sm, dense_sn,
    additive, add_sb, add_sh, add_sm, add_sn,
    softcap_ptr, sink, sink_sb, sink_sh, sink_sm, logit_scale, logit_scale_sb, logit_scale_sh, logit_scale_sm,
    HAS_RANGE: tl.constexpr, HAS_DENSE: tl.constexpr, HAS_ADDITIVE: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_SINK: tl.constexpr, HAS_LOGIT_SCALE: tl.constexpr, ALPHA: tl.constexpr,
    WEIGHTED: tl.constexpr, SPLIT: tl.constexpr, SKIP: tl.constexpr, HIST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, ACC: tl.constexpr,
):
    """One query block of one (batch, head): threshold search, then ``out = p v`` (module docstring).

    ``ALPHA`` 2 (sparsemax): the threshold passes take :func:`_pass_sums`' two-sum form.
    ``WEIGHTED``: the output pass also writes ``W = sum_j g_j v_j / sum_j g_j`` per row
    (``g = p^(2 - alpha)``, the sink's ``g`` in the denominator), so the backward's
    ``delta = dO . W`` needs no pass over K and V; ``SPLIT``: without ``g``'s 2-byte rounding
    (:func:`_output_add`).
    """
    bh = tl.program_id(1).to(tl.int64)
    batch, head, kv_head, offs_m, offs_d, offs_dv = query_program(bh, heads, group, BLOCK_M, BLOCK_D, BLOCK_DV)
    scale = tl.load(scale_ptr)
    alpha, softmax, multiplier, power = _head_alpha(alpha_ptr, alpha_stride, head, ALPHA)
    q_tile = load_tile(Q + batch * sq_b + head * sq_h, offs_m, offs_d, lq, head_dim, sq_m, sq_d)
    keys = (K + batch * sk_b + kv_head * sk_h, sk_n, sk_d, offs_d, head_dim)
    v_base = V + batch * sv_b + kv_head * sv_h
    row_start, row_stop, lo, hi = key_block_bounds(key_start, key_stop, range_stride, batch, offs_m, lq, lk, HAS_RANGE)
    first = (lo // BLOCK_N) * BLOCK_N
    inner_lo, inner_hi, masked = inner_key_blocks(row_start, row_stop, offs_m, lq, lk, first, hi, BLOCK_N)
    span = (first, inner_lo, inner_hi, masked)
    sink_logit, row_scale = _row_modifiers(sink, sink_sb, sink_sh, sink_sm, logit_scale, logit_scale_sb,
                                           logit_scale_sh, logit_scale_sm, batch, head, offs_m, lq, HAS_SINK,
                                           HAS_LOGIT_SCALE, BLOCK_M, ACC)
    rows = (row_start, row_stop, lk, scale, batch, head, tl.load(softcap_ptr), row_scale)
    masks = (dense, dense_sb, dense_sh, dense_sm, dense_sn, additive, add_sb, add_sh, add_sm, add_sn)

    # Pass 1: max, allowed count and sum(s - max) per row (the sum rescaled as the max grows);
    # the sink, an allowed key of every row, starts them.
    sink_bad = sink_logit != sink_logit
    sink_infinite = sink_logit == float("inf")
    sink_counts = (sink_logit != float("-inf")) & ~sink_bad & ~sink_infinite
    row_max = tl.where(sink_counts, sink_logit, float("-inf"))
    below = tl.zeros((BLOCK_M,), ACC)
    count = sink_counts.to(tl.int32)
    bad = sink_bad.to(tl.int32)
    infinite = sink_infinite.to(tl.int32)
    for i in range(0, masked):  # the masked key blocks, then the inner ones
        start = masked_block_start(i, first, inner_lo, inner_hi, BLOCK_N)
        scores, _ = _score_block(q_tile, keys, offs_m, start, rows, masks, HAS_DENSE, HAS_ADDITIVE, SOFTCAP,
                                 HAS_LOGIT_SCALE, BLOCK_N, ACC)
        row_max, below, count, bad, infinite = _max_add(scores, row_max, below, count, bad, infinite, ACC)
    for start in range(inner_lo, inner_hi, BLOCK_N):
        scores, _ = _score_block(q_tile, keys, offs_m, start, rows, masks, HAS_DENSE, HAS_ADDITIVE, SOFTCAP,
                                 HAS_LOGIT_SCALE, BLOCK_N, ACC, False)
        row_max, below, count, bad, infinite = _max_add(scores, row_max, below, count, bad, infinite, ACC)
    nan_rows = bad > 0
    row_max = tl.where(count > 0, row_max, 0.0)
    posinf_rows = (infinite > 0) & ~nan_rows

    # Passes 2..I+1: safeguarded Newton on ||[z - tau]_+||_p = 1, scores shifted so that max z = 0.
    n = tl.maximum(count, 1).to(ACC)
    low = tl.full((BLOCK_M,), -1.0, ACC)
    high = -tl.exp2((1 - alpha) * tl.log2(n))
    hoelder = (below * multiplier - tl.exp2((2 - alpha) * tl.log2(n))) / n
    tau = tl.where(softmax, tl.zeros((BLOCK_M,), ACC), tl.maximum(low, hoelder))
    active = tl.where(softmax, False, (count > 0) & ~nan_rows & ~posinf_rows)
    mass = tl.zeros((BLOCK_M,), ACC)
    support = tl.zeros((BLOCK_M,), tl.int32)
    support_z = tl.zeros((BLOCK_M,), ACC)
    settled = tl.zeros((BLOCK_M,), tl.int1)
    # The first pass also bins each row's z over (-1, 0], whose counts bound tau from below: the
    # next step starts there when Newton's own step falls short of it (fewer passes, same root).
    # Softmax (alpha = 1) has no threshold: this pass only sums its normaliser, and bins nothing.
    binned: tl.constexpr = HIST and ALPHA != 1.0
    mass, slope, support, support_z, least, histogram = _newton_sums(
        q_tile, keys, offs_m, span, rows, masks, row_max, tau, multiplier, power, softmax, sink_logit,
        HAS_DENSE, HAS_ADDITIVE, SOFTCAP, HAS_LOGIT_SCALE, HAS_SINK, ALPHA, binned, BLOCK_M, BLOCK_N, ACC,
    )
    floor = low
    if binned:
        floor = tl.maximum(_histogram_floor(histogram, power, ACC), low)
    tau, low, high, active, settled, step_count = _newton_step(
        (mass, slope, support, support_z, least), tau, low, high, active, settled, floor, 0, alpha, max_steps, ALPHA)
    searching = tl.max(active.to(tl.int32), 0) > 0
    while searching:
        mass, slope, support, support_z, least, _ = _newton_sums(
            q_tile, keys, offs_m, span, rows, masks, row_max, tau, multiplier, power, softmax, sink_logit,
            HAS_DENSE, HAS_ADDITIVE, SOFTCAP, HAS_LOGIT_SCALE, HAS_SINK, ALPHA, False, BLOCK_M, BLOCK_N, ACC,
        )
        tau, low, high, active, settled, step_count = _newton_step(
            (mass, slope, support, support_z, least), tau, low, high, active, settled, low, step_count, alpha,
            max_steps, ALPHA)
        searching = tl.max(active.to(tl.int32), 0) > 0
    exact = (alpha != 1) & (power == 1)
    tau = tl.where(exact, (support_z - 1) / tl.maximum(support, 1).to(ACC), tau)
    norm = tl.where(exact, 1.0, tl.where(mass > 0, mass, 1.0))
    if ALPHA == 1.5:
        norm = tl.where(settled, 1.0, norm)  # sum [z - tau]_+^2 = 1 at the closed-form root, to its rounding
    norm = tl.where(nan_rows, float("nan"), norm)
    row_max, tau, norm = _posinf_rows(row_max, tau, norm, posinf_rows, infinite, softmax, ACC)

    # Last pass: out = p v (under SKIP, no V for tiles without support; the sink's value is 0); under WEIGHTED
    # also sum g v and sum g for the backward's delta.
    gppr_scale = _gppr_scale(alpha, norm, row_max, softmax)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), ACC)
    weighted = tl.zeros((BLOCK_M, BLOCK_DV), ACC)
    gppr_sum = tl.zeros((BLOCK_M,), ACC)
    if WEIGHTED and HAS_SINK:
        sink_u, sink_mass, sink_p = _weights(sink_logit[:, None], row_max, tau, norm, multiplier, power, softmax)
        gppr_sum += tl.sum(_gppr(sink_u, sink_mass, sink_p, gppr_scale, softmax, ALPHA), 1)
    sums = (acc, weighted, gppr_sum)
    stats = (row_max, tau, norm, multiplier, power, softmax, nan_rows, gppr_scale)
    values = (v_base, offs_dv, value_dim, lk, sv_n, sv_d)
    for i in range(0, masked):
        start = masked_block_start(i, first, inner_lo, inner_hi, BLOCK_N)
        scores, offs_n = _score_block(q_tile, keys, offs_m, start, rows, masks, HAS_DENSE, HAS_ADDITIVE, SOFTCAP,
                                      HAS_LOGIT_SCALE, BLOCK_N, ACC)
        sums = _output_add(scores, offs_n, sums, stats, values, WEIGHTED, SPLIT, ALPHA, SKIP, ACC)
    for start in range(inner_lo, inner_hi, BLOCK_N):
        scores, offs_n = _score_block(q_tile, keys, offs_m, start, rows, masks, HAS_DENSE, HAS_ADDITIVE, SOFTCAP,
                                      HAS_LOGIT_SCALE, BLOCK_N, ACC, False)
        sums = _output_add(scores, offs_n, sums, stats, values, WEIGHTED, SPLIT, ALPHA, SKIP, ACC)
    acc, weighted, gppr_sum = sums
    acc = tl.where(nan_rows[:, None], float("nan"), acc)
    row_base = bh * lq
    inside = offs_m < lq
    tile = inside[:, None] & (offs_dv < value_dim)[None, :]
    out_ptrs = OUT + (row_base + offs_m)[:, None] * value_dim + offs_dv[None, :]
    tl.store(out_ptrs, acc.to(OUT.dtype.element_ty), mask=tile)
    if WEIGHTED:
        if ALPHA == 1.0:  # softmax: g = p, whose sum with the sink's is 1
            weighted = acc + weighted if SPLIT else acc
        else:
            weighted = weighted / tl.where(gppr_sum > 0, gppr_sum, 1.0)[:, None]
            weighted = tl.where(nan_rows[:, None], float("nan"), weighted)
        w_ptrs = WEIGHTED_PTR + (row_base + offs_m)[:, None] * value_dim + offs_dv[None, :]
        tl.store(w_ptrs, weighted.to(WEIGHTED_PTR.dtype.element_ty), mask=tile)
    stats_ptrs = STATS_PTR + (row_base + offs_m) * 3
    tl.store(stats_ptrs, row_max, mask=inside)
    tl.store(stats_ptrs + 1, tau, mask=inside)
    tl.store(stats_ptrs + 2, norm, mask=inside)


# ---- backward ------------------------------------------------------------------------------


@triton.jit
def _delta_add(scores, offs_n, sums, stats, values, ALPHA_GRAD: tl.constexpr, ALPHA: tl.constexpr,
               SKIP: tl.constexpr, ACC: tl.constexpr):
    """The rows kernel's four sums (``g``, ``g dP``, and under ``ALPHA_GRAD`` the entropy terms), one tile on.

    ``stats`` = (row_max, tau, norm, multiplier, power, softmax, nan_rows, gppr_scale, beta);
    ``values`` = (do_tile, v_base, offs_dv, value_dim, lk, sv_d, sv_n).  Under ``SKIP`` a tile
    without support reads no V.
    """
    gppr_sum, gppr_dp, entropy_sum, entropy_dp = sums
    row_max, tau, norm, multiplier, power, softmax, nan_rows, gppr_scale, beta = stats
    do_tile, v_base, offs_dv, value_dim, lk, sv_d, sv_n = values
    u, mass, p = _weights(scores, row_max, tau, norm, multiplier, power, softmax)
    live = True
    if SKIP:  # attention_launch.SKIP_EMPTY_TILES: a tile without support loads nothing more
        live = _live(p, nan_rows)
    if live:
        v_t = load_tile(v_base, offs_dv, offs_n, value_dim, lk, sv_d, sv_n)
        dp = mma(do_tile, v_t, ACC)
        gppr = _gppr(u, mass, p, gppr_scale, softmax, ALPHA)
        gppr_sum += tl.sum(gppr, 1)
        gppr_dp += tl.sum(gppr * dp, 1)
        if ALPHA_GRAD:
            on = p > 0
            entropy = tl.where(on, p * (beta - tl.log(tl.where(on, p, 1.0))), 0.0)
            entropy = tl.where(p != p, p, entropy)
            entropy_sum += tl.sum(entropy, 1)
            entropy_dp += tl.sum(entropy * dp, 1)
    return gppr_sum, gppr_dp, entropy_sum, entropy_dp


@triton.jit
def _dq_add(logits, scores, slope, offs_n, grads, stats, operands, SOFTCAP: tl.constexpr,
            HAS_LOGIT_SCALE: tl.constexpr, ALPHA: tl.constexpr, SKIP: tl.constexpr, ACC: tl.constexpr):
    """``(dq, d_row_scale)`` with one tile's terms added; under ``SKIP`` a tile without support reads no V, no K.

    ``stats`` = (row_max, tau, norm, multiplier, power, softmax, nan_rows, gppr_scale, delta,
    row_scale); ``operands`` = (do_tile, v_base, offs_dv, value_dim, lk, sv_d, sv_n, k_base,
    offs_d, head_dim, sk_n, sk_d).
    """
    dq, d_row_scale = grads
    row_max, tau, norm, multiplier, power, softmax, nan_rows, gppr_scale, delta, row_scale = stats
    do_tile, v_base, offs_dv, value_dim, lk, sv_d, sv_n, k_base, offs_d, head_dim, sk_n, sk_d = operands
    u, mass, p = _weights(logits, row_max, tau, norm, multiplier, power, softmax)
    live = True
    if SKIP:  # attention_launch.SKIP_EMPTY_TILES: a tile without support loads nothing more
        live = _live(p, nan_rows)
    if live:
        v_t = load_tile(v_base, offs_dv, offs_n, value_dim, lk, sv_d, sv_n)
        dp = mma(do_tile, v_t, ACC)
        ds = _gppr(u, mass, p, gppr_scale, softmax, ALPHA) * (dp - delta[:, None])
        if HAS_LOGIT_SCALE:
            d_row_scale += tl.sum(ds * tl.where(scores != float("-inf"), scores, 0.0), 1)
            ds = ds * row_scale[:, None]
        if SOFTCAP:
            ds = ds * slope
        k_tile = load_tile(k_base, offs_n, offs_d, lk, head_dim, sk_n, sk_d)
        dq += rounded_mma(ds, k_tile, ACC)
    return dq, d_row_scale


@triton.jit
def _entmax_attention_rows_kernel(
    Q, K, V, DO, STATS_PTR, DELTA, D_ALPHA, scale_ptr, alpha_ptr, alpha_stride,
    sq_b, sq_h, sq_m, sq_d, sk_b, sk_h, sk_n, sk_d, sv_b, sv_h, sv_n, sv_d, so_b, so_h, so_m, so_d,
    heads, group, lq, lk, head_dim, value_dim,
    key_start, key_stop, range_stride,
    dense, dense_sb, dense_sh, dense_sm, dense_sn,
    additive, add_sb, add_sh, add_sm, add_sn,
    softcap_ptr, sink, sink_sb, sink_sh, sink_sm, logit_scale, logit_scale_sb, logit_scale_sh, logit_scale_sm,
    HAS_RANGE: tl.constexpr, HAS_DENSE: tl.constexpr, HAS_ADDITIVE: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_SINK: tl.constexpr, HAS_LOGIT_SCALE: tl.constexpr, ALPHA_GRAD: tl.constexpr,
    ALPHA: tl.constexpr, SKIP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, ACC: tl.constexpr,
):
    """Per row: ``delta = sum(g dP) / sum(g)`` and (ALPHA_GRAD) the row's alpha gradient, in one pass over K and V.

    The sink (``dP = 0``: its value is zero) adds its ``g`` and ``T`` to the sums.
    """
    bh = tl.program_id(1).to(tl.int64)
    batch, head, kv_head, offs_m, offs_d, offs_dv = query_program(bh, heads, group, BLOCK_M, BLOCK_D, BLOCK_DV)
    scale = tl.load(scale_ptr)
    alpha, softmax, multiplier, power = _head_alpha(alpha_ptr, alpha_stride, head, ALPHA)
    beta = tl.where(softmax, 0.0, power)
    row_base = bh * lq
    q_tile = load_tile(Q + batch * sq_b + head * sq_h, offs_m, offs_d, lq, head_dim, sq_m, sq_d)
    do_tile = load_tile(DO + batch * so_b + head * so_h, offs_m, offs_dv, lq, value_dim, so_m, so_d)
    keys = (K + batch * sk_b + kv_head * sk_h, sk_n, sk_d, offs_d, head_dim)
    v_base = V + batch * sv_b + kv_head * sv_h
    row_max, tau, norm = _load_stats(STATS_PTR, row_base, offs_m, lq)
    nan_rows = norm != norm
    gppr_scale = _gppr_scale(alpha, norm, row_max, softmax)
    row_start, row_stop, lo, hi = key_block_bounds(key_start, key_stop, range_stride, batch, offs_m, lq, lk, HAS_RANGE)
    sink_logit, row_scale = _row_modifiers(sink, sink_sb, sink_sh, sink_sm, logit_scale, logit_scale_sb,
                                           logit_scale_sh, logit_scale_sm, batch, head, offs_m, lq, HAS_SINK,
                                           HAS_LOGIT_SCALE, BLOCK_M, ACC)
    rows = (row_start, row_stop, lk, scale, batch, head, tl.load(softcap_ptr), row_scale)
    masks = (dense, dense_sb, dense_sh, dense_sm, dense_sn, additive, add_sb, add_sh, add_sm, add_sn)
    gppr_sum = tl.zeros((BLOCK_M,), ACC)
    gppr_dp = tl.zeros((BLOCK_M,), ACC)
    entropy_sum = tl.zeros((BLOCK_M,), ACC)
    entropy_dp = tl.zeros((BLOCK_M,), ACC)
    if HAS_SINK:
        sink_u, sink_mass, sink_p = _weights(sink_logit[:, None], row_max, tau, norm, multiplier, power, softmax)
        gppr_sum += tl.sum(_gppr(sink_u, sink_mass, sink_p, gppr_scale, softmax, ALPHA), 1)
        if ALPHA_GRAD:
            sink_on = sink_p > 0
            sink_entropy = sink_p * (beta - tl.log(tl.where(sink_on, sink_p, 1.0)))
            entropy_sum += tl.sum(tl.where(sink_on, sink_entropy, 0.0), 1)
    sums = (gppr_sum, gppr_dp, entropy_sum, entropy_dp)
    stats = (row_max, tau, norm, multiplier, power, softmax, nan_rows, gppr_scale, beta)
    values = (do_tile, v_base, offs_dv, value_dim, lk, sv_d, sv_n)
    first = (lo // BLOCK_N) * BLOCK_N
    inner_lo, inner_hi, masked = inner_key_blocks(row_start, row_stop, offs_m, lq, lk, first, hi, BLOCK_N)
    for i in range(0, masked):  # the masked key blocks, then the inner ones
        start = masked_block_start(i, first, inner_lo, inner_hi, BLOCK_N)
        scores, offs_n = _score_block(q_tile, keys, offs_m, start, rows, masks, HAS_DENSE, HAS_ADDITIVE, SOFTCAP,
                                      HAS_LOGIT_SCALE, BLOCK_N, ACC)
        sums = _delta_add(scores, offs_n, sums, stats, values, ALPHA_GRAD, ALPHA, SKIP, ACC)
    for start in range(inner_lo, inner_hi, BLOCK_N):
        scores, offs_n = _score_block(q_tile, keys, offs_m, start, rows, masks, HAS_DENSE, HAS_ADDITIVE, SOFTCAP,
                                      HAS_LOGIT_SCALE, BLOCK_N, ACC, False)
        sums = _delta_add(scores, offs_n, sums, stats, values, ALPHA_GRAD, ALPHA, SKIP, ACC)
    gppr_sum, gppr_dp, entropy_sum, entropy_dp = sums
    safe_sum = tl.where(gppr_sum > 0, gppr_sum, 1.0)
    delta = tl.where(nan_rows, float("nan"), gppr_dp / safe_sum)
    inside = offs_m < lq
    tl.store(DELTA + row_base + offs_m, delta, mask=inside)
    if ALPHA_GRAD:
        d_alpha = tl.where(softmax, 0.0, beta * (entropy_dp - entropy_sum / safe_sum * gppr_dp))
        d_alpha = tl.where(row_max == float("inf"), 0.0, d_alpha)  # uniform whatever alpha
        tl.store(D_ALPHA + row_base + offs_m, tl.where(nan_rows, float("nan"), d_alpha), mask=inside)


@triton.jit
def _entmax_attention_dq_kernel(
    Q, K, V, DO, STATS_PTR, DELTA, DQ, D_SINK, D_LOGIT_SCALE, scale_ptr, alpha_ptr, alpha_stride,
    sq_b, sq_h, sq_m, sq_d, sk_b, sk_h, sk_n, sk_d, sv_b, sv_h, sv_n, sv_d, so_b, so_h, so_m, so_d,
    heads, group, lq, lk, head_dim, value_dim,
    key_start, key_stop, range_stride,
    dense, dense_sb, dense_sh, dense_sm, dense_sn,
    additive, add_sb, add_sh, add_sm, add_sn,
    softcap_ptr, sink, sink_sb, sink_sh, sink_sm, logit_scale, logit_scale_sb, logit_scale_sh, logit_scale_sm,
    HAS_RANGE: tl.constexpr, HAS_DENSE: tl.constexpr, HAS_ADDITIVE: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_SINK: tl.constexpr, HAS_LOGIT_SCALE: tl.constexpr,
    ALPHA: tl.constexpr, SKIP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, ACC: tl.constexpr,
):
    """``dq = scale dS k`` for one query block, one pass over K and V.

    With ``G = g (dP - delta)`` the gradient of a logit: ``dS = c G (1 - tanh^2)`` (``c``
    the row's logit multiplier, the last factor the cap's); per row, the sink's logit
    gradient ``-g_sink delta`` and the multiplier's ``sum_j G_j s_j``.
    """
    bh = tl.program_id(1).to(tl.int64)
    batch, head, kv_head, offs_m, offs_d, offs_dv = query_program(bh, heads, group, BLOCK_M, BLOCK_D, BLOCK_DV)
    scale = tl.load(scale_ptr)
    alpha, softmax, multiplier, power = _head_alpha(alpha_ptr, alpha_stride, head, ALPHA)
    row_base = bh * lq
    q_tile = load_tile(Q + batch * sq_b + head * sq_h, offs_m, offs_d, lq, head_dim, sq_m, sq_d)
    do_tile = load_tile(DO + batch * so_b + head * so_h, offs_m, offs_dv, lq, value_dim, so_m, so_d)
    keys = (K + batch * sk_b + kv_head * sk_h, sk_n, sk_d, offs_d, head_dim)
    v_base = V + batch * sv_b + kv_head * sv_h
    row_max, tau, norm = _load_stats(STATS_PTR, row_base, offs_m, lq)
    nan_rows = norm != norm
    gppr_scale = _gppr_scale(alpha, norm, row_max, softmax)
    inside = offs_m < lq
    delta = tl.load(DELTA + row_base + offs_m, mask=inside, other=0.0)
    row_start, row_stop, lo, hi = key_block_bounds(key_start, key_stop, range_stride, batch, offs_m, lq, lk, HAS_RANGE)
    sink_logit, row_scale = _row_modifiers(sink, sink_sb, sink_sh, sink_sm, logit_scale, logit_scale_sb,
                                           logit_scale_sh, logit_scale_sm, batch, head, offs_m, lq, HAS_SINK,
                                           HAS_LOGIT_SCALE, BLOCK_M, ACC)
    rows = (row_start, row_stop, lk, scale, batch, head, tl.load(softcap_ptr), row_scale)
    masks = (dense, dense_sb, dense_sh, dense_sm, dense_sn, additive, add_sb, add_sh, add_sm, add_sn)
    dq = tl.zeros((BLOCK_M, BLOCK_D), ACC)
    d_row_scale = tl.zeros((BLOCK_M,), ACC)
    grads = (dq, d_row_scale)
    stats = (row_max, tau, norm, multiplier, power, softmax, nan_rows, gppr_scale, delta, row_scale)
    operands = (do_tile, v_base, offs_dv, value_dim, lk, sv_d, sv_n, keys[0], offs_d, head_dim, sk_n, sk_d)
    first = (lo // BLOCK_N) * BLOCK_N
    inner_lo, inner_hi, masked = inner_key_blocks(row_start, row_stop, offs_m, lq, lk, first, hi, BLOCK_N)
    for i in range(0, masked):  # the masked key blocks, then the inner ones
        start = masked_block_start(i, first, inner_lo, inner_hi, BLOCK_N)
        logits, scores, slope, offs_n = _score_parts(q_tile, keys, offs_m, start, rows, masks, HAS_DENSE,
                                                     HAS_ADDITIVE, SOFTCAP, HAS_LOGIT_SCALE, BLOCK_N, ACC)
        grads = _dq_add(logits, scores, slope, offs_n, grads, stats, operands, SOFTCAP, HAS_LOGIT_SCALE, ALPHA, SKIP,
                        ACC)
    for start in range(inner_lo, inner_hi, BLOCK_N):
        logits, scores, slope, offs_n = _score_parts(q_tile, keys, offs_m, start, rows, masks, HAS_DENSE,
                                                     HAS_ADDITIVE, SOFTCAP, HAS_LOGIT_SCALE, BLOCK_N, ACC, False)
        grads = _dq_add(logits, scores, slope, offs_n, grads, stats, operands, SOFTCAP, HAS_LOGIT_SCALE, ALPHA, SKIP,
                        ACC)
    dq, d_row_scale = grads
    dq = tl.where(nan_rows[:, None], float("nan"), dq * scale)
    tl.store(DQ + (row_base + offs_m)[:, None] * head_dim + offs_d[None, :], dq.to(DQ.dtype.element_ty),
             mask=inside[:, None] & (offs_d < head_dim)[None, :])
    if HAS_SINK:
        sink_u, sink_mass, sink_p = _weights(sink_logit[:, None], row_max, tau, norm, multiplier, power, softmax)
        d_sink = -tl.sum(_gppr(sink_u, sink_mass, sink_p, gppr_scale, softmax, ALPHA), 1) * delta
        tl.store(D_SINK + row_base + offs_m, tl.where(nan_rows, float("nan"), d_sink), mask=inside)
    if HAS_LOGIT_SCALE:
        d_row_scale = tl.where(row_max == float("inf"), 0.0, d_row_scale)  # its 0 ds times +inf scores: NaN
        tl.store(D_LOGIT_SCALE + row_base + offs_m, tl.where(nan_rows, float("nan"), d_row_scale), mask=inside)


@triton.jit
def _entmax_attention_dkdv_kernel(
    Q, K, V, DO, STATS_PTR, DELTA, DK, DV_PTR, scale_ptr, alpha_ptr, alpha_stride,
    sq_b, sq_h, sq_m, sq_d, sk_b, sk_h, sk_n, sk_d, sv_b, sv_h, sv_n, sv_d, so_b, so_h, so_m, so_d,
    heads, group, lq, lk, head_dim, value_dim,
    key_start, key_stop, range_stride,
    dense, dense_sb, dense_sh, dense_sm, dense_sn,
    additive, add_sb, add_sh, add_sm, add_sn,
    softcap_ptr, sink, sink_sb, sink_sh, sink_sm, logit_scale, logit_scale_sb, logit_scale_sh, logit_scale_sm,
    HAS_RANGE: tl.constexpr, HAS_DENSE: tl.constexpr, HAS_ADDITIVE: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_SINK: tl.constexpr, HAS_LOGIT_SCALE: tl.constexpr,
    ALPHA: tl.constexpr, SKIP: tl.constexpr, SCAN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, ACC: tl.constexpr,
):
    """``dk = scale dS^T q`` and ``dv = p^T dO`` for one key block of one (batch, kv head), no atomics."""
    bkv = tl.program_id(1).to(tl.int64)
    batch, kv_head, key_lo, offs_n, offs_d, offs_dv = key_program(bkv, heads, group, BLOCK_N, BLOCK_D, BLOCK_DV)
    scale = tl.load(scale_ptr)
    softcap = tl.load(softcap_ptr)
    keys = (K + batch * sk_b + kv_head * sk_h, sk_n, sk_d, offs_d, head_dim)
    v_t = load_tile(V + batch * sv_b + kv_head * sv_h, offs_dv, offs_n, value_dim, lk, sv_d, sv_n)
    masks = (dense, dense_sb, dense_sh, dense_sm, dense_sn, additive, add_sb, add_sh, add_sm, add_sn)
    dk = tl.zeros((BLOCK_N, BLOCK_D), ACC)
    dv = tl.zeros((BLOCK_N, BLOCK_DV), ACC)
    first, last = query_block_range(key_start, key_stop, range_stride, batch, key_lo, lq, lk, HAS_RANGE, BLOCK_M,
                                    BLOCK_N, SCAN)
    for member in range(0, group):
        head = kv_head * group + member
        row_base = (batch * heads + head) * lq
        alpha, softmax, multiplier, power = _head_alpha(alpha_ptr, alpha_stride, head, ALPHA)
        for query_block in range(first, last):  # no test around the loads: they are prefetched
            offs_m, row_start, row_stop, q_tile, do_tile = query_block_tiles(
                query_block, Q + batch * sq_b + head * sq_h, DO + batch * so_b + head * so_h, offs_d, offs_dv,
                head_dim, value_dim, sq_m, sq_d, so_m, so_d, key_start, key_stop, range_stride, batch, lq, lk,
                HAS_RANGE, BLOCK_M)
            row_max, tau, norm = _load_stats(STATS_PTR, row_base, offs_m, lq)
            delta = tl.load(DELTA + row_base + offs_m, mask=offs_m < lq, other=0.0)
            _, row_scale = _row_modifiers(sink, sink_sb, sink_sh, sink_sm, logit_scale, logit_scale_sb,
                                          logit_scale_sh, logit_scale_sm, batch, head, offs_m, lq, False,
                                          HAS_LOGIT_SCALE, BLOCK_M, ACC)
            rows = (row_start, row_stop, lk, scale, batch, head, softcap, row_scale)
            scores, _, slope, _ = _score_parts(q_tile, keys, offs_m, key_lo, rows, masks, HAS_DENSE,
                                               HAS_ADDITIVE, SOFTCAP, HAS_LOGIT_SCALE, BLOCK_N, ACC)
            u, mass, p = _weights(scores, row_max, tau, norm, multiplier, power, softmax)
            live = True
            if SKIP:  # attention_launch.SKIP_EMPTY_TILES
                live = _live(p, norm != norm)
            if live:
                dp = mma(do_tile, v_t, ACC)
                gppr_scale = _gppr_scale(alpha, norm, row_max, softmax)
                ds = _gppr(u, mass, p, gppr_scale, softmax, ALPHA) * (dp - delta[:, None])
                if HAS_LOGIT_SCALE:
                    ds = ds * row_scale[:, None]
                if SOFTCAP:
                    ds = ds * slope
                dv += mma(tl.trans(p).to(do_tile.dtype), do_tile, ACC)
                dk += rounded_mma(tl.trans(ds), q_tile, ACC)
    rows_out = (bkv * lk + offs_n)[:, None]
    inside = (offs_n < lk)[:, None]
    tl.store(DK + rows_out * head_dim + offs_d[None, :], (dk * scale).to(DK.dtype.element_ty),
             mask=inside & (offs_d < head_dim)[None, :])
    tl.store(DV_PTR + rows_out * value_dim + offs_dv[None, :], dv.to(DV_PTR.dtype.element_ty),
             mask=inside & (offs_dv < value_dim)[None, :])


# ---- launchers -----------------------------------------------------------------------------


def _check_alpha(heads: int, alpha: float, alpha_heads: Tensor | None) -> None:
    if alpha_heads is None and not 1 <= alpha <= 2:
        raise ValueError(f"alpha must be in [1, 2] for the fused entmax attention, got {alpha}")
    if alpha_heads is not None and alpha_heads.shape != (heads,):
        raise ValueError(f"alpha_heads must have shape (Hq,) = ({heads},), got {tuple(alpha_heads.shape)}")


SPECIALISED_ALPHAS = (1.0, 1.5, 2.0)
"""Python alphas compiled as constants: softmax, 1.5-entmax and sparsemax.

With alpha a runtime value, Triton if-converts the per-score branches on it (``exp`` for
softmax heads; ``[u]_+^p`` as itself, its square, its square root or ``exp2(p log2 u)``) and
computes every one of them for every score: the sm_90 SASS of the sparsemax output pass
held 66 instructions per score and its backward kernels 91-111, against 15 for a plain
flash-attention forward (``scripts/sass_loops.py``).  Other alphas, and per-head alphas
(a tensor), keep the runtime path; specialising every alpha would compile a kernel per value.
"""


def _constant_alpha(alpha: float | None) -> float:
    """The kernels' ``ALPHA`` constexpr: ``alpha`` when it is one of :data:`SPECIALISED_ALPHAS`, else 0 (each head's
    alpha read at run time)."""
    return float(alpha) if alpha is not None and float(alpha) in SPECIALISED_ALPHAS else 0.0


class _Launch:
    """One entmax call: the shared :func:`.attention_launch.problem`, its alphas and scale, warps and stages.

    The block is :func:`.attention_launch.block_size`'s (smaller for wide float32/float64
    rows); warps and pipeline stages are :func:`.attention_launch.launch_options`'.
    """

    def __init__(self, q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask, scale: float, alpha: float,
                 alpha_heads: Tensor | None, softcap: float | None, sinks: Tensor | None,
                 logit_scale: Tensor | None) -> None:
        shape = problem(q, k, v)
        _check_alpha(shape.heads, alpha, alpha_heads)
        self.q, self.k, self.v = dot_operands(q, k, v)
        acc = rules.accumulation_dtype(q.dtype)
        if alpha_heads is None:
            alpha_values, alpha_stride = launch.constant(float(alpha), acc, q.device), 0
        else:
            alpha_values, alpha_stride = alpha_heads.detach().to(device=q.device, dtype=acc).contiguous(), 1
        self.options = launch_options(shape, q)
        self.narrow = narrow_cuda(shape, q)
        self.constant_alpha = _constant_alpha(alpha if alpha_heads is None else None)
        self.shape = shape
        self.acc_dtype = acc
        self.head_args = (launch.constant(float(scale), acc, q.device), alpha_values, alpha_stride)
        self.strides = (*self.q.stride(), *self.k.stride(), *self.v.stride())
        self.mask_args = dict(
            **mask_arguments(mask, shape.score_shape, q.device),
            **modifier_arguments(softcap, sinks, shape.score_shape, acc, q.device),
            **row_arguments("logit_scale", logit_scale, shape.score_shape[:3], acc, q.device),
        )

    def launch(self, kernel, grid: tuple[int, int], *pointers, extra_strides: tuple[int, ...] = (),
               **constants) -> None:
        if grid[0] * grid[1] == 0:
            return
        constants = {**self.shape.constants, **constants}  # a kernel's own constants win (the dk/dv BLOCK_M)
        launch.launchable(kernel)[grid](*pointers, *self.head_args, *self.strides, *extra_strides, *self.shape.sizes,
                                        **self.mask_args, ALPHA=self.constant_alpha,
                                        SKIP=attention_launch.SKIP_EMPTY_TILES, **constants, **self.options)


@replay.replayable
def entmax_attention_forward(
    q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask, scale: float, alpha: float, alpha_heads: Tensor | None,
    softcap: float | None = None, sinks: Tensor | None = None, logit_scale: Tensor | None = None,
    weighted: bool = False,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Fused alpha-entmax attention ``out = entmax_alpha(c (cap(scale q k^T) + additive) | sink) v``.

    Over the allowed keys and, with ``sinks``, each row's sink (a key of value 0 whose
    weight is dropped); ``cap(x) = softcap tanh(x / softcap)`` when ``softcap`` is given,
    ``c`` the row's ``logit_scale`` (1 when None).

    Args:
        q: queries ``(B, Hq, Lq, D)``, float16/bfloat16/float32/float64.
        k: keys ``(B, Hkv, Lk, D)``, ``Hq % Hkv == 0`` (query head ``h`` uses key/value head
            ``h // (Hq // Hkv)``).
        v: values ``(B, Hkv, Lk, Dv)``.
        mask: which keys each query row may attend (intervals, dense, additive).
        scale: multiplier of ``q k^T``.
        alpha: the entmax alpha, in ``[1, 2]`` (1 softmax, 2 sparsemax), used when
            ``alpha_heads`` is None.
        alpha_heads: None, or per query head alphas ``(Hq,)`` in ``[1, 2]`` (not checked:
            reading them would synchronise the device).
        softcap: None, or the cap ``> 0`` of the scaled scores (before the additive mask).
        sinks: None, or the sink logit of each row, broadcastable to ``(B, Hq, Lq)``
            (``(Hq, 1)``: one per head); already multiplied by ``c``, not capped, not masked.
        logit_scale: None, or the logit multiplier ``c`` of each row (temperature,
            Scalable-Softmax), broadcastable to ``(B, Hq, Lq)``, applied after the cap.
        weighted: also return ``W``, the rows' ``sum_j g_j v_j / sum_j g_j`` (``g = p^(2 - alpha)``,
            the sink's ``g`` in the denominator): :func:`entmax_attention_backward` then gets
            ``delta = dO . W`` without its row pass over K and V.  One more product per tile
            with support in the output pass (none for alpha = 1: ``W`` is ``out``), and
            ``(B, Hq, Lq, Dv)`` more in memory in the accumulation dtype: ``W`` rounded to
            bfloat16 (FlashAttention-2 takes its ``delta`` from the bfloat16 ``out``) moved a
            learnable Scalable-Softmax multiplier's gradient, summed over rows, by 0.1 in a test
            where the row pass's float32 ``delta`` was within 0.05.  With 2-byte inputs and
            ``sinks`` or ``logit_scale`` (whose gradients are sums over rows, where a rounding of
            ``delta`` adds up) ``g v`` is also taken without ``g``'s 2-byte rounding: one product
            more per tile (``g``'s remainder times ``v``).  Without it, ``p`` rounded to bfloat16
            in ``W`` left that multiplier's gradient 0.056 off (of 0.053) on an H200, where
            interpreted bfloat16 (read as float32) was exact.

    Returns:
        ``(out, stats, W)``: ``out`` ``(B, Hq, Lq, Dv)`` in ``q``'s dtype; ``stats``
        ``(B, Hq, Lq, 3)`` in the accumulation dtype, per row ``(m, tau, N)``: the row's
        largest allowed logit (the sink's included), its threshold on ``(alpha - 1)(s - m)``
        and the weights' normaliser (NaN in NaN rows); ``W`` ``(B, Hq, Lq, Dv)`` in the
        accumulation dtype (NaN in NaN rows), or None without ``weighted``.

    Raises:
        ValueError: shapes that do not fit, or a python ``alpha`` outside ``[1, 2]``.
    """
    call = _Launch(q, k, v, mask, scale, alpha, alpha_heads, softcap, sinks, logit_scale)
    shape = call.shape
    out = launch.empty((shape.batch, shape.heads, shape.lq, shape.value_dim), q.dtype, q.device)
    stats = shape.row_tensor(STATS, like=q)
    w = launch.empty(tuple(out.shape), call.acc_dtype, q.device) if weighted else None
    split = w is not None and call.v.element_size() == 2 and (sinks is not None or logit_scale is not None)
    call.launch(_entmax_attention_forward_kernel, shape.query_grid, call.q, call.k, call.v, out, stats,
                out if w is None else w, max_steps=2 * MAX_STEPS if q.dtype == torch.float64 else MAX_STEPS,
                WEIGHTED=w is not None, SPLIT=split, HIST=HISTOGRAM_FLOOR)
    return out, stats, w


@replay.replayable
def entmax_attention_backward(
    q: Tensor, k: Tensor, v: Tensor, out: Tensor, grad_out: Tensor, stats: Tensor, mask: AttentionMask,
    scale: float, alpha: float, alpha_heads: Tensor | None, alpha_grad: bool, softcap: float | None = None,
    sinks: Tensor | None = None, logit_scale: Tensor | None = None, weighted: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """Gradients of :func:`entmax_attention_forward` by the closed-form entmax Jacobian (module docstring).

    Deterministic: no atomics, every gradient element is written by one program.

    Args:
        q, k, v, mask, scale, alpha, alpha_heads, softcap, sinks, logit_scale: the forward's arguments.
        out: the forward's output (unused: entmax's ``delta`` needs its own pass).
        grad_out: gradient of ``out``, ``(B, Hq, Lq, Dv)``.
        stats: the forward's per-row statistics.
        alpha_grad: also return alpha's gradient per query head (it takes the row pass over K and V).
        weighted: the forward's ``W`` (``weighted=True``), or None: without ``alpha_grad``,
            ``delta = rowsum(dO W)`` replaces the row pass over K and V.

    Returns:
        ``(dq, dk, dv, d_alpha, d_sinks, d_logit_scale)``: shapes and dtypes of ``q``, ``k``,
        ``v``; ``d_alpha`` ``(Hq,)`` summed over batch and rows, or None; the gradients of
        each row's sink logit and logit multiplier, ``(B, Hq, Lq)`` (None without ``sinks``,
        ``logit_scale``); these three in the accumulation dtype (float64 for float64 inputs).
    """
    call = _Launch(q, k, v, mask, scale, alpha, alpha_heads, softcap, sinks, logit_scale)
    shape = call.shape
    (grad_out,) = dot_operands(grad_out.to(q.dtype))
    stats = stats.contiguous()
    delta = shape.row_tensor(like=q)
    d_alpha_rows = shape.row_tensor(like=q) if alpha_grad else delta
    d_sinks = shape.row_tensor(like=q) if sinks is not None else None
    d_logit_scale = shape.row_tensor(like=q) if logit_scale is not None else None
    dq = launch.empty(tuple(q.shape), q.dtype, q.device)
    dk = launch.empty(tuple(k.shape), k.dtype, k.device)
    dv = launch.empty(tuple(v.shape), v.dtype, v.device)
    common = (call.q, call.k, call.v, grad_out, stats, delta)
    # With 8 warps (float32, float64, head dims above 64) the backward kernels step half a block at a time
    # along the axis they loop over (keys for the rows and dq kernels, queries for dk/dv), as
    # FlashAttention-2's backward does: the BLOCK_M x BLOCK_N intermediates hold most of the registers.  On
    # sm_90 at head dim 128 (bfloat16) this cut the spills of dk/dv from 816 B a thread to 24 B, of dq from
    # 568 to 16 B, of rows from 256 to 8 B.  With 4 warps (narrow_cuda: 2-byte inputs up to head dim 64) the
    # rows and dq kernels step the forward's whole block when alpha is a compile-time constant (half a block
    # for a runtime alpha), and dk/dv always does: in the sm_90 SASS (scripts/sass_loops.py, causal
    # sparsemax) the dk/dv loop then takes 38 instructions per score against 52, rows 33 against 39, dq 34
    # against 35, with no spill inside the loops.  Whole dk/dv blocks spill 80-200 B with a softcap or an
    # additive mask and 264-520 B with a runtime alpha; they used to keep half blocks there, until an H200
    # (Triton 3.6, 2026-11-26) gave a dk 90 % wrong from the half-block dk/dv with a softcap in float16 and
    # bfloat16 (4 warps), while whole blocks without the cap and half blocks with 8 warps (float32) were
    # right.  The suspect, not a finding: with 4 warps a 32-row product cannot be one Hopper warpgroup MMA
    # (64 rows), so such tiles mix two MMA layouts.  The runtime-alpha half-block dk/dv in half precision
    # never ran on a GPU.  Whole blocks mended the capped dk: on an H200 (2026-11-27, 346fb76) the capped
    # half-precision kernel tests pass, so attention() takes the fused backward with a softcap too.
    # Another tile shape is safe here, not in the Self-Adjusted or top-k backward: a recomputed score may
    # differ from the forward's in its last bit, which moves an entmax weight by about as much but would drop
    # a key from their min/max or top-k set.
    half = max(16, shape.block // 2)
    whole = call.narrow and call.constant_alpha != 0.0
    step = shape.block if whole else half
    key_step = shape.block if call.narrow else half
    if weighted is not None and not alpha_grad:
        delta = row_dot(shape, weighted, grad_out)  # no pass over K and V
        common = (call.q, call.k, call.v, grad_out, stats, delta)
    else:
        call.launch(_entmax_attention_rows_kernel, shape.query_grid, *common, d_alpha_rows,
                    extra_strides=grad_out.stride(), ALPHA_GRAD=bool(alpha_grad), BLOCK_N=step)
    call.launch(_entmax_attention_dq_kernel, shape.query_grid, *common, dq,
                delta if d_sinks is None else d_sinks, delta if d_logit_scale is None else d_logit_scale,
                extra_strides=grad_out.stride(), BLOCK_N=step)
    if shape.lq == 0:  # no query attends any key: the key-block programs would write zeros anyway
        dk.zero_()
        dv.zero_()
    else:
        call.launch(_entmax_attention_dkdv_kernel, shape.key_grid, *common, dk, dv, extra_strides=grad_out.stride(),
                    BLOCK_M=key_step, SCAN=RANGE_SCAN)
    d_alpha = None
    if alpha_grad:
        d_alpha = d_alpha_rows.sum((0, 2)) if shape.lq else torch.zeros(shape.heads, dtype=call.acc_dtype,
                                                                           device=q.device)
    return dq, dk, dv, d_alpha, d_sinks, d_logit_scale
