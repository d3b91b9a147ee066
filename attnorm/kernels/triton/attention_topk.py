"""Fused exact top-k attention: softmax of ``x / temperature`` over each row's ``k`` largest allowed scores.

``x = scale q k^T + additive``; row ``i`` keeps ``min(k, n)`` of its ``n`` allowed keys
(``max(1, ceil(k n - 1e-9))`` for a fraction ``0 < k < 1``, as
:func:`attnorm.kernels.rules.topk_row_count`); **ties at the k-th score: the lowest key
index wins**; ``out_i = sum_j p_ij v_j``.  A row holding +inf keeps (at most all of) its
+inf keys, uniformly weighted; a row with no allowed key gives zeros; a NaN row NaN.
No ``(Lq, Lk)`` matrix is stored: score tiles are recomputed by
:func:`.attention_blocks.score_tile` on the same aligned ``(BLOCK_M, BLOCK_N)`` tiles in
every kernel, so every pass sees bit-identical scores.

**Selection for k up to** :data:`CANDIDATE_KEEP` **(64): candidate buffers, one pass over K.**
Each row keeps a buffer in global memory, :data:`CANDIDATE_ROOM` tiles past ``kp`` slots
(``kp``: the power of two at or above the most keys a row may keep, ``K``; 256 slots of 4
bytes for k = 64 and 64-key blocks), that always holds a multiset of the row's scores
containing its ``K`` largest: a score joins it when it is at least the ``K``-th largest
held so far (:func:`_append`: one comparison a score; slots from a prefix sum along the
row, only in tiles where some row has a candidate), and a buffer past ``CAP - BLOCK_N``
is shrunk to its ``K`` largest (:func:`_reselect`: a running top ``KP`` merged with
``KP`` slots at a time by Triton's bitonic ``tl.topk``, ``KP`` the larger of that power of
two and :data:`CANDIDATE_CHUNK`, then compacted in place; ties at the ``K``-th score are
interchangeable; the largest score ever dropped is kept per row).  Past its first ``CAP - BLOCK_N`` scores a
row appends about ``K ln(n / m)`` of its scores ``m..n`` in a random order: a float32
model (64-row blocks, q, k ~ N(0, 1), head dim 64, scale 1 / 8, ``/tmp``-style, not in
the repository) appends 468 scores a row and shrinks 3 times a block at Lk = 2048, 683
and 5 at 16384 (k = 64); every tile still holds some row's candidate, so the prefix
sum runs in each.  The same pass counts allowed and NaN keys; at its end the row's exact ``keep``
gives the threshold, the ``keep``-th largest held score (:func:`_candidate_threshold`):
the scores above it are all held (fewer than ``keep``), and its ties are cut by key
order when the buffer holds more than ``keep - above`` of them or one was dropped, which
the output pass resolves as below.  sm_90 SASS (Triton 3.6, bf16, head dim 64, k = 5;
``scripts/sass_loops.py``, counts, not times): the candidate pass's loops take 38.0
(masked key blocks) and 32.9 (inner ones) instructions per score with the append, the
shrink compiled out to count them; the radix passes of the same build 38.7 (the first)
and 27.4-33.3 (the others), ~6-7 of them: the selection's ~190 instructions per score
become ~35 plus the shrinks.  Bytes per row: ``4 CAP`` written and read back per shrink
(L2-resident: a block's buffers are 64 KiB); ``4 CAP`` per row allocated per launch, at
most :data:`CANDIDATE_BYTES` or one (batch, head) pair's rows (a larger forward runs in
launches of whole pairs).  Float64 scores and larger k take the radix select.  Untimed:
no GPU in the session that wrote it (``benchmarks/bench_attention.py --providers sdpa
attnorm radix`` times both selections side by side).

**Selection otherwise: a radix select on the scores' bits, per query block.**  Each score maps to
an unsigned integer ordered like it (its signed magnitude plus the bits of +inf, so
masked keys, at -inf, are 0, both zeros are equal and NaN is largest: :func:`_sortable`).  The k-th largest key ``t``
is built :data:`RADIX_BITS` bits at a time, most significant first: a pass over the
query block's key blocks counts, for each row and each of the ``2^RADIX_BITS``
candidates ``prefix | d << shift``, the keys ``>= candidate`` (suffix sums of a per-row
histogram of the pass's digit, counted 8 bits to a field, four fields to a word:
:func:`_digit_histogram`), and keeps the largest ``d`` still reaching ``k``.  4 bits per
pass: 8 passes for float32 scores (16 for float64), each costing ~25 integer operations
a score and 4 row reductions per score tile on top of the scores (8 bits per pass would need 64
words; 1 bit per pass, a bisection, needs 32 passes).  The first
pass also counts each row's allowed, +inf and NaN keys; when every row of the query
block keeps all its keys the other passes are skipped.  The last pass leaves ``c``,
the number of keys above ``t``, so ``k - c`` keys tied at ``t`` are kept: the first
ones in key order (a running prefix count of ties across key blocks).  A row whose
settled candidate already has exactly ``k`` keys at or above it is cut there (its
threshold is that candidate, every tie kept: :func:`_cut`), and the block stops once
all its rows are cut or keep every key: the lower digits of a k-th score only
separate it from the next score down, which a candidate between them already does.
A float32 model of the selection (64-row blocks, q, k ~ N(0, 1), head dim 64, scale
1 / 8) stops after 6.0 passes at Lk = 2048 (k = 64 or 6 %), 6.25 (k = 64) and 6.75
(k = 6 %) at Lk = 16384, instead of 8.

**Forward passes over K and V per query block:** one over K with candidate buffers, else
at most ``32 / RADIX_BITS`` over K (scores only); then one over K and V (online softmax over the kept keys, the product
with V skipped in key blocks where no row keeps a key).  **Backward** (FlashAttention-2 style,
no atomics): ``delta = rowsum(dO * out)`` (a pre-pass over out, no K/V); the kept set
is rebuilt from the stats (``x >= t``; or ``x > t``, or ``x = t`` at a key index
``<= j_last``, in a row whose ties at ``t`` are cut); the dk/dv kernel (one program per
key block and key/value head, looping over the GQA group's query heads and their query
blocks that reach it) and the dq kernel (one per query block, looping over its key
blocks) compute ``ds = p (dP - delta) / temperature``.  One pass over K and V per query
block for dq, one over q and dO per key block for dk, dv.

**The kept test and the weights, per score.**  Ties cut by key order need the key index
and a running count of ties; they are rare (equal scores at a row's k-th), so a query
block without such a row compares ``x >= kept_from`` once per score (a per-row float that
also encodes "every key" and "no key", :func:`_kept`), and its forward output pass takes
the key blocks in any order, the inner ones without the interval test.  The weights are
``exp2(x slope - offset)`` with per-row ``slope`` and ``offset`` (:func:`_load_stats`):
the +inf-row and temperature cases folded into them, not tested per score.  sm_90 SASS of
the innermost loops (bf16, head dim 64, ``scripts/sass_loops.py``, counts, not times):
forward output pass 85.7 -> 15.6 instructions per score (60.0 in a block with cut ties),
dq 41.9 -> 15.4 (20.9), dk/dv 50.3 -> 38.6 (both variants in one loop); the selection
passes 42.1 -> 33.3 (the first, which also counts allowed, +inf and NaN keys) and
35.4 -> 27.4 (the others), from the three-operation key of :func:`_sortable` and the
digit read off ``key - prefix`` (:func:`_digit_histogram`).

Bytes per query row beyond q, k, v, out and their gradients: :data:`STATS` stats of
4 bytes (8 for float64) written by the forward, read by the backward with one per-row
``delta``.

**Softcap and sinks.**  Under ``SOFTCAP`` the scores are ``cap tanh(scale q k^T / cap)
+ additive`` (one ``exp`` more per score, in every pass) and ``ds`` is multiplied by the
cap's slope ``1 - tanh^2``.  A sink (``HAS_SINK``: a score per row, value zero) is a
candidate of every selection pass, counted like a key (no extra pass); it is key index
``Lk``, after every real key, so it loses ties (``last_tie = Lk`` records a kept sink
tie); a fraction ``k`` keeps ``max(1, ceil(k n))`` with ``n`` the real allowed keys, of
``n + 1`` candidates.  The kept sink joins the online softmax after the last key block;
the backward's dq kernel writes each row's sink score gradient ``-p_sink delta / T``
(4 bytes per row, 8 for float64).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from attnorm.kernels import rules
from attnorm.kernels.rules import AttentionMask
from attnorm.kernels.triton import attention_launch, launch, replay
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
from attnorm.kernels.triton.topk import _keep_count

__all__ = ["RADIX_BITS", "STATS", "topk_attention_backward", "topk_attention_forward"]

RADIX_BITS = 4
"""Bits of the k-th key settled per selection pass (a divisor of 32)."""

STATS = 5
"""Per-row stats: ``(max, log_sum, threshold, last_tie, state)``, the first two in base 2.

``p = exp2(x log2(e) / temperature - max - log_sum)`` on the kept keys, which are those
with ``x >= threshold``, except in a row whose ties at the threshold are cut by key order
(``last_tie >= 0``): there ``x > threshold``, and ``x = threshold`` at key index
``<= last_tie``.  The threshold is -inf when every allowed key is kept; ``state`` 1 for a
finite row, 2 for a row holding +inf (its kept +inf keys read as 0, uniform), 0 for a row
with no kept key or a NaN."""

_STATS_WIDTH = tl.constexpr(STATS)


@triton.jit
def _sortable(x, KEY: tl.constexpr, UKEY: tl.constexpr, KEY_BITS: tl.constexpr):
    """Unsigned keys ordered like ``x``: -inf (a masked key) 0, ``-0.0`` equal to ``0.0``, every NaN above +inf.

    The signed magnitude (a negative score's magnitude negated, so both zeros meet at 0)
    plus the bits of +inf: three integer operations a score.
    """
    bits = x.to(KEY, bitcast=True)
    sign = bits >> (KEY_BITS - 1)  # 0 or -1
    signed = ((bits & ((1 << (KEY_BITS - 1)) - 1)) ^ sign) - sign
    return signed.to(UKEY, bitcast=True) + _inf_bits(UKEY, KEY_BITS)


@triton.jit
def _inf_bits(UKEY: tl.constexpr, KEY_BITS: tl.constexpr):
    """The bits of +inf: the offset of :func:`_sortable`."""
    if KEY_BITS == 64:
        return tl.full((), 0x7FF0000000000000, UKEY)
    else:
        return tl.full((), 0x7F800000, UKEY)


@triton.jit
def _sortable_value(keys, ACC: tl.constexpr, KEY: tl.constexpr, UKEY: tl.constexpr, KEY_BITS: tl.constexpr):
    """The score whose :func:`_sortable` key is ``keys`` (-inf for key 0; ``+0.0`` for both zeros)."""
    signed = (keys - _inf_bits(UKEY, KEY_BITS)).to(KEY, bitcast=True)
    sign = signed >> (KEY_BITS - 1)
    bits = ((signed ^ sign) - sign) | (sign << (KEY_BITS - 1))
    return bits.to(ACC, bitcast=True)


@triton.jit
def _digit_histogram(keys, prefix, shift, BLOCK_M: tl.constexpr, UKEY: tl.constexpr, RADIX: tl.constexpr):
    """Per row of a key tile, the keys at each digit of this pass: ``(BLOCK_M, 2^RADIX)`` int32.

    A key whose bits above the digit equal the row's ``prefix`` counts at its digit (bits
    ``[shift, shift + RADIX)``); a key above the prefix counts at the top digit (it is at or
    above every candidate, and only suffix sums of the histogram are used); a key below it
    nowhere.  The counts go four to a 32-bit word, 8 bits each (a tile row has at most
    ``BLOCK_N < 256`` keys), so a word takes one row reduction: ``2^RADIX / 4`` reductions
    of a ``(BLOCK_M, BLOCK_N)`` tile per key block.  Per score that is ~20 integer
    operations; comparing every key with every candidate, a ``(BLOCK_M, BLOCK_N, 2^RADIX)``
    tile, took ~50 and all the registers (timed on an H200: 293 ms of a 310 ms top-k
    forward + backward at L = 16384).
    """
    top: tl.constexpr = 2**RADIX - 1
    words: tl.constexpr = 2**RADIX // 4
    # prefix has no bit below the digit: keys - prefix is the digit and the lower bits (and more above the prefix)
    digit = tl.minimum((keys - prefix[:, None]) >> shift.to(UKEY), top).to(tl.int32)
    one = tl.where(keys >= prefix[:, None], (1 << ((digit & 3) * 8)).to(tl.uint32), 0)
    word = digit >> 2
    digits = tl.arange(0, 2**RADIX)
    histogram = tl.zeros((BLOCK_M, 2**RADIX), tl.int32)
    for index in tl.static_range(words):
        packed = tl.sum(tl.where(word == index, one, 0).to(tl.uint32), 1)
        fields = ((packed[:, None] >> ((digits[None, :] & 3) * 8).to(tl.uint32)) & 255).to(tl.int32)
        histogram = tl.where((digits >> 2)[None, :] == index, fields, histogram)
    return histogram


@triton.jit
def _tally(x, tallies, prefix, shift, FIRST: tl.constexpr, BLOCK_M: tl.constexpr, KEY: tl.constexpr,
           UKEY: tl.constexpr, KEY_BITS: tl.constexpr, RADIX: tl.constexpr):
    """One score tile added to a selection pass's histogram (and, ``FIRST``, to the allowed, +inf and NaN counts)."""
    histogram, allowed_count, posinf_count, nan_count = tallies
    keys = _sortable(x, KEY, UKEY, KEY_BITS)
    histogram += _digit_histogram(keys, prefix, shift, BLOCK_M, UKEY, RADIX)
    if FIRST:
        allowed_count += tl.sum((x != float("-inf")).to(tl.int32), 1)
        posinf_count += tl.sum((x == float("inf")).to(tl.int32), 1)
        nan_count += tl.sum((x != x).to(tl.int32), 1)
    return histogram, allowed_count, posinf_count, nan_count


@triton.jit
def _candidate_counts(
    q_tile, k_base, sk_n, sk_d, offs_m, offs_d, head_dim, row_start, row_stop, span, lk, scale, softcap, batch,
    head, masking, prefix, shift, sink_key,
    HAS_DENSE: tl.constexpr, HAS_ADDITIVE: tl.constexpr, SOFTCAP: tl.constexpr, HAS_SINK: tl.constexpr,
    FIRST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ACC: tl.constexpr,
    KEY: tl.constexpr, UKEY: tl.constexpr, KEY_BITS: tl.constexpr, RADIX: tl.constexpr,
):
    """One selection pass: per row, the keys ``>= prefix | d << shift`` for each digit ``d``, ``(BLOCK_M, 2^RADIX)``.

    The suffix sums of the pass's digit histogram (:func:`_digit_histogram`).  The sink
    (``sink_key``, a candidate of every row) is counted with the keys.  The ``FIRST`` pass
    also returns each row's allowed, +inf and NaN key counts (real keys only; zeros otherwise).
    ``span`` = ``(first, inner_lo, inner_hi, masked)``: the masked key blocks, then the inner
    ones, whose tiles need no interval test (:func:`.attention_blocks.inner_key_blocks`; a
    histogram does not care in which order its keys come).
    """
    tl.static_assert(BLOCK_N < 256, "8-bit digit counts per key block")
    tl.static_assert(RADIX >= 2, "four digits to a word at least")
    histogram = tl.zeros((BLOCK_M, 1 << RADIX), tl.int32)
    allowed_count = tl.zeros((BLOCK_M,), tl.int32)
    posinf_count = tl.zeros((BLOCK_M,), tl.int32)
    nan_count = tl.zeros((BLOCK_M,), tl.int32)
    first, inner_lo, inner_hi, masked = span
    tallies = (histogram, allowed_count, posinf_count, nan_count)
    for i in range(0, masked):
        offs_n = masked_block_start(i, first, inner_lo, inner_hi, BLOCK_N) + tl.arange(0, BLOCK_N)
        x = key_scores(q_tile, k_base, sk_n, sk_d, offs_m, offs_n, offs_d, head_dim, row_start, row_stop, lk, scale,
                       softcap, batch, head, masking, HAS_DENSE, HAS_ADDITIVE, SOFTCAP, ACC)
        tallies = _tally(x, tallies, prefix, shift, FIRST, BLOCK_M, KEY, UKEY, KEY_BITS, RADIX)
    for start in range(inner_lo, inner_hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        x = key_scores(q_tile, k_base, sk_n, sk_d, offs_m, offs_n, offs_d, head_dim, row_start, row_stop, lk, scale,
                       softcap, batch, head, masking, HAS_DENSE, HAS_ADDITIVE, SOFTCAP, ACC, False)
        tallies = _tally(x, tallies, prefix, shift, FIRST, BLOCK_M, KEY, UKEY, KEY_BITS, RADIX)
    histogram, allowed_count, posinf_count, nan_count = tallies
    counts = tl.sum(histogram, 1)[:, None] - tl.cumsum(histogram, 1) + histogram
    if HAS_SINK:
        digits = tl.arange(0, 1 << RADIX).to(UKEY)
        candidates = prefix[:, None] | (digits[None, :] << shift.to(UKEY))
        counts += (sink_key[:, None] >= candidates).to(tl.int32)
    return counts, allowed_count, posinf_count, nan_count


@triton.jit
def _settle_digit(counts, prefix, above, keep, shift, UKEY: tl.constexpr, RADIX: tl.constexpr):
    """Settle one digit: the largest whose candidate keeps ``keep`` keys at or above it.

    ``above`` becomes the count at the next candidate when there is one: at the end, the keys above the k-th.
    Also returns the count at the settled candidate (``>= keep``).
    """
    digits = tl.arange(0, 1 << RADIX)
    digit = tl.sum((counts >= keep[:, None]).to(tl.int32), 1) - 1
    next_count = tl.sum(tl.where(digits[None, :] == digit[:, None] + 1, counts, 0), 1)
    at = tl.sum(tl.where(digits[None, :] == digit[:, None], counts, 0), 1)
    above = tl.where(digit < (1 << RADIX) - 1, next_count, above)
    return prefix | (digit.to(UKEY) << shift.to(UKEY)), above, at


@triton.jit
def _cut(prefix, at, keep, KEY: tl.constexpr, UKEY: tl.constexpr, KEY_BITS: tl.constexpr, ACC: tl.constexpr):
    """Rows whose settled candidate ``prefix`` (unsettled digits 0) already has exactly ``keep`` keys at or above it.

    Such a row keeps the keys ``>= prefix``: the threshold is ``prefix`` with every tie kept, and its lower
    digits need no pass.  Only where ``prefix`` is the key of a score (not NaN, above -inf), so that the
    threshold survives the stats' round trip through a float.
    """
    value = _sortable_value(prefix, ACC, KEY, UKEY, KEY_BITS)
    return (at == keep) & (value > float("-inf"))


@triton.jit
def _slots(allowed_count, sinks_here, K_PARAM, IS_FRACTION: tl.constexpr):
    """Keys a row keeps before the +inf rule: a fraction is of the real allowed keys; the sink may take a slot."""
    if IS_FRACTION:
        return tl.maximum(_keep_count(allowed_count, tl.load(K_PARAM), IS_FRACTION), sinks_here)
    else:
        return _keep_count(allowed_count + sinks_here, tl.load(K_PARAM), IS_FRACTION)


@triton.jit
def _append(x, bound, count, buffer_rows, live, upper):
    """Append a tile's scores ``>= bound`` to their rows' candidate buffers (in tile order); the new counts.

    A tile where no row has a candidate costs the comparison and a row sum.  Elsewhere
    a candidate's slot is its row's count plus the candidates before it in the tile: a
    prefix sum taken as a product with ``upper`` (ones on and above the diagonal, float16:
    counts up to ``BLOCK_N`` are exact) on the tensor cores, whose result lands in the
    scores' own layout (``tl.cumsum`` along the row compiled to ~8 more instructions a
    score on sm_90: shuffles and a trip through shared memory).
    """
    fresh = (x >= bound[:, None]) & live[:, None]
    added = tl.sum(fresh.to(tl.int32), 1)
    if tl.max(added, 0) > 0:
        before = tl.dot(fresh.to(tl.float16), upper).to(tl.int32)  # inclusive prefix counts
        tl.store(buffer_rows[:, None] + count[:, None] + before - 1, x, mask=fresh)
    return count + added


@triton.jit
def _chunk(buffer_rows, count, live, start, KP: tl.constexpr):
    """Slots ``[start, start + KP)`` of a block's candidate buffers: their scores (-inf past a row's count), held."""
    slots = start + tl.arange(0, KP)
    held = (slots[None, :] < count[:, None]) & live[:, None]
    return tl.load(buffer_rows[:, None] + slots[None, :], mask=held, other=float("-inf")), held


@triton.jit
def _nth_largest(buffer_rows, count, live, n, BLOCK_M: tl.constexpr, CAP: tl.constexpr, KP: tl.constexpr):
    """Per row the ``n``-th largest held score (``1 <= n <= KP``; -inf where ``n`` is 0 or past the count).

    A running top ``KP`` merged with the buffer ``KP`` slots at a time (Triton's bitonic
    ``tl.topk`` on ``(BLOCK_M, 2 KP)``): a loop, not one network over all ``CAP`` slots.
    """
    tl.debug_barrier()  # every thread's appends are visible
    best, _ = _chunk(buffer_rows, count, live, 0, KP)
    for start in range(KP, CAP, KP):
        values, _ = _chunk(buffer_rows, count, live, start, KP)
        best = tl.topk(tl.reshape(tl.join(best, values), (BLOCK_M, 2 * KP)), KP)
    best = tl.topk(best, KP)  # sorted, also when CAP == KP
    rank = tl.arange(0, KP)
    return tl.max(tl.where(rank[None, :] == n[:, None] - 1, best, float("-inf")), 1)


@triton.jit
def _reselect(buffer_rows, count, keep_bound, dropped, live, BLOCK_M: tl.constexpr, CAP: tl.constexpr,
              KP: tl.constexpr, ACC: tl.constexpr):
    """Shrink each row's candidates to its ``keep_bound`` largest; the new counts, append bounds and drop maxima.

    The buffer holds a multiset of the row's scores that contains its ``keep_bound``
    largest; keeping only those (of the scores tied at the ``keep_bound``-th, as many as
    fit: equal values are interchangeable) keeps that true.  ``dropped`` records the
    largest score ever dropped: the final selection tells from it whether some score tied
    at the k-th is not in the buffer.  The new bound is the ``keep_bound``-th score
    (-largest while a row holds fewer: every allowed score is a candidate).  Compacted in
    place ``KP`` slots at a time (a kept score moves to a slot at or before its own).
    """
    bound = _nth_largest(buffer_rows, count, live, count * 0 + keep_bound, BLOCK_M, CAP, KP)
    room = count * 0 + keep_bound
    for start in range(0, CAP, KP):
        values, _ = _chunk(buffer_rows, count, live, start, KP)
        room -= tl.sum((values > bound[:, None]).to(tl.int32), 1)
    kept_count = count * 0
    for start in range(0, CAP, KP):
        values, held = _chunk(buffer_rows, count, live, start, KP)
        ties = held & (values == bound[:, None])
        ranks = tl.cumsum(ties.to(tl.int32), 1)
        kept = held & ((values > bound[:, None]) | (ties & (ranks <= room[:, None])))
        room -= tl.sum(ties.to(tl.int32), 1)
        dropped = tl.maximum(dropped, tl.max(tl.where(held & ~kept, values, float("-inf")), 1))
        slots = kept_count[:, None] + tl.cumsum(kept.to(tl.int32), 1) - 1
        tl.debug_barrier()  # every thread has read this chunk before any of its slots is rewritten
        tl.store(buffer_rows[:, None] + slots, values, mask=kept)
        kept_count += tl.sum(kept.to(tl.int32), 1)
    bound = tl.where(bound > float("-inf"), bound, -_largest(ACC))
    return kept_count, bound, dropped


@triton.jit
def _candidate_tile(x, state, buffer_rows, live, keep_bound, upper, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    ACC: tl.constexpr, CAP: tl.constexpr, KP: tl.constexpr):
    """A score tile of :func:`_candidate_pass`: counted, its candidates appended, the buffers shrunk when near full."""
    count, bound, dropped, allowed_count, nan_count = state
    allowed_count += tl.sum((x != float("-inf")).to(tl.int32), 1)
    nan_count += tl.sum((x != x).to(tl.int32), 1)
    count = _append(x, bound, count, buffer_rows, live, upper)
    if tl.max(count, 0) > CAP - BLOCK_N:
        count, bound, dropped = _reselect(buffer_rows, count, keep_bound, dropped, live, BLOCK_M, CAP, KP, ACC)
    return count, bound, dropped, allowed_count, nan_count


@triton.jit
def _candidate_pass(
    q_tile, k_base, sk_n, sk_d, offs_m, offs_d, head_dim, row_start, row_stop, span, lk, scale, softcap, batch,
    head, masking, buffer_rows, live, keep_bound,
    HAS_DENSE: tl.constexpr, HAS_ADDITIVE: tl.constexpr, SOFTCAP: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, ACC: tl.constexpr, CAP: tl.constexpr, KP: tl.constexpr,
):
    """One pass over K: each row's candidates (a multiset holding its ``keep_bound`` largest scores) and key counts.

    Returns ``(count, bound, dropped, allowed_count, nan_count)``: the scores a row's buffer
    holds, the bound a score must reach to join it, the largest score dropped from it, its
    allowed keys (NaN included) and NaN keys.  A score joins the buffer when it is at least
    the ``keep_bound``-th largest held so far; a buffer past ``CAP - BLOCK_N`` is shrunk
    (:func:`_reselect`) before the next tile.  Masked key blocks first, then the inner ones
    (a multiset does not care in which order its scores come).
    """
    columns = tl.arange(0, BLOCK_N)
    upper = (columns[:, None] <= columns[None, :]).to(tl.float16)
    zeros = tl.zeros(live.shape, tl.int32)
    state = (zeros, tl.full(live.shape, -_largest(ACC), ACC), tl.full(live.shape, float("-inf"), ACC), zeros, zeros)
    first, inner_lo, inner_hi, masked = span
    for i in range(0, masked):
        offs_n = masked_block_start(i, first, inner_lo, inner_hi, BLOCK_N) + tl.arange(0, BLOCK_N)
        x = key_scores(q_tile, k_base, sk_n, sk_d, offs_m, offs_n, offs_d, head_dim, row_start, row_stop, lk, scale,
                       softcap, batch, head, masking, HAS_DENSE, HAS_ADDITIVE, SOFTCAP, ACC)
        state = _candidate_tile(x, state, buffer_rows, live, keep_bound, upper, BLOCK_M, BLOCK_N, ACC, CAP, KP)
    for start in range(inner_lo, inner_hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        x = key_scores(q_tile, k_base, sk_n, sk_d, offs_m, offs_n, offs_d, head_dim, row_start, row_stop, lk, scale,
                       softcap, batch, head, masking, HAS_DENSE, HAS_ADDITIVE, SOFTCAP, ACC, False)
        state = _candidate_tile(x, state, buffer_rows, live, keep_bound, upper, BLOCK_M, BLOCK_N, ACC, CAP, KP)
    return state


@triton.jit
def _candidate_threshold(buffer_rows, count, keep, dropped, live, BLOCK_M: tl.constexpr, CAP: tl.constexpr,
                         KP: tl.constexpr):
    """Per row ``(keep, posinf_row, threshold, above, tie_cut)`` from its candidates.

    A row holding +inf keeps at most its +inf scores (all in the buffer, or at least
    ``keep`` of them).  ``threshold`` is the ``keep``-th largest score; ``above`` counts the
    scores above it (all in the buffer: fewer than ``keep``); ``tie_cut`` is whether some
    score tied at it is left out (more ties than the ``keep - above`` slots, in the buffer
    or dropped from it).
    """
    tl.debug_barrier()  # every thread's appends are visible
    posinf_count = count * 0
    for start in range(0, CAP, KP):
        values, _ = _chunk(buffer_rows, count, live, start, KP)
        posinf_count += tl.sum((values == float("inf")).to(tl.int32), 1)
    posinf_row = posinf_count > 0
    keep = tl.where(posinf_row, tl.minimum(keep, posinf_count), keep)
    threshold = _nth_largest(buffer_rows, count, live, keep, BLOCK_M, CAP, KP)
    above = count * 0
    ties = count * 0
    for start in range(0, CAP, KP):
        values, held = _chunk(buffer_rows, count, live, start, KP)
        above += tl.sum((values > threshold[:, None]).to(tl.int32), 1)
        ties += tl.sum((held & (values == threshold[:, None])).to(tl.int32), 1)
    tie_cut = (ties > keep - above) | (dropped == threshold)
    return keep, posinf_row, threshold, above, tie_cut


_LOG2E = tl.constexpr(1.4426950408889634)
_NO_TIE_CUT = tl.constexpr(2**31 - 1)
"""A row's ``tie_until`` when every key tied at its threshold is kept (a key index beyond any)."""


@triton.jit
def _largest(ACC: tl.constexpr):
    """The largest finite number of ``ACC``."""
    if ACC == tl.float64:
        return tl.full((), 1.7976931348623157e308, ACC)
    else:
        return tl.full((), 3.4028234663852886e38, ACC)


@triton.jit
def _kept(x, kept_from, offs_n, tie_until, TIES: tl.constexpr):
    """The kept keys of a tile: ``x >= kept_from``, or with ``TIES`` above it or at it up to key index ``tie_until``.

    ``kept_from`` is the row's threshold as a float (compared as floats, not as sortable
    keys: ``-0.0`` ties with ``0.0`` in both orders), the lowest finite number for a row
    that keeps every allowed key (so masked ``-inf`` keys stay out), NaN for a row that
    keeps none (no comparison holds).  Only a row whose ties at the k-th score are cut by
    key order needs ``tie_until`` (:data:`_NO_TIE_CUT` otherwise); a block without one
    takes ``TIES`` False: one comparison a score instead of four.
    """
    if TIES:
        at = (x == kept_from[:, None]) & (offs_n[None, :] <= tie_until[:, None])
        return (x > kept_from[:, None]) | at
    else:
        return x >= kept_from[:, None]


@triton.jit
def _log2_logits(x, slope, ACC: tl.constexpr):
    """``x / temperature`` in base-2 units, ``slope = log2(e) / temperature`` per row.

    A row holding +inf (state 2) has slope 0 and keeps only its +inf keys, which read as
    ``largest * 0 = 0``: its weights are uniform.  Finite rows keep finite keys only.
    """
    return tl.minimum(x, _largest(ACC)) * slope[:, None]


@triton.jit
def _row_terms(state, every, threshold, inv_temperature, ACC: tl.constexpr):
    """Per row ``(kept_from, slope)`` of :func:`_kept` and :func:`_log2_logits` from its state and threshold."""
    kept_from = tl.where(state > 0, tl.where(every, -_largest(ACC), threshold), float("nan"))
    slope = tl.where(state == 2, 0.0, inv_temperature * _LOG2E)
    return kept_from, slope


@triton.jit
def _softmax_tile(kept, x, offs_n, running, slope, v_base, offs_dv, lk, value_dim, sv_n, sv_d, ACC: tl.constexpr):
    """One tile of the online softmax over the kept keys, in base 2: ``running = (top, total, acc)``.

    A tile where no row keeps a key reads no V (its row maxima, needed anyway, tell), whatever
    ``attention_launch.SKIP_EMPTY_TILES`` says: compiled for sm_90 (Triton 3.6), prefetching V here
    instead raised the radix passes of the same kernel from 27.4 to 31.4 instructions per score
    (register allocation: wgmma fences and moves) and its shared memory from 64 to 104 KiB, against
    one pass over K and V that prefetches.
    """
    top, total, acc = running
    logits = tl.where(kept, _log2_logits(x, slope, ACC), float("-inf"))
    tile_top = tl.max(logits, 1)
    if tl.max(tile_top, 0) > float("-inf"):
        new_top = tl.maximum(top, tile_top)
        rescale = tl.where(top > float("-inf"), tl.exp2(top - new_top), 0.0)
        p = tl.exp2(logits - tl.where(new_top > float("-inf"), new_top, 0.0)[:, None])
        v_tile = load_tile(v_base, offs_n, offs_dv, lk, value_dim, sv_n, sv_d)
        top = new_top
        total = total * rescale + tl.sum(p, 1)
        acc = acc * rescale[:, None] + mma(p.to(v_tile.dtype), v_tile, ACC)
    return top, total, acc


@triton.jit
def _topk_forward_kernel(
    Q, K, V, OUT, OUT_FLOAT, STATS_PTR, K_PARAM, BUFFER, keep_bound, first_bh,
    sq_b, sq_h, sq_m, sq_d, sk_b, sk_h, sk_n, sk_d, sv_b, sv_h, sv_n, sv_d,
    heads, group, lq, lk, head_dim, value_dim, scale: tl.float64, inv_temperature: tl.float64,
    key_start, key_stop, range_stride,
    dense, dense_sb, dense_sh, dense_sm, dense_sn, additive, add_sb, add_sh, add_sm, add_sn,
    softcap_ptr, sink, sink_sb, sink_sh, sink_sm,
    HAS_RANGE: tl.constexpr, HAS_DENSE: tl.constexpr, HAS_ADDITIVE: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_SINK: tl.constexpr, IS_FRACTION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, ACC: tl.constexpr,
    KEY: tl.constexpr, UKEY: tl.constexpr, KEY_BITS: tl.constexpr, RADIX: tl.constexpr, FLOAT_OUT: tl.constexpr,
    CANDIDATES: tl.constexpr, CAP: tl.constexpr, KP: tl.constexpr,
):
    """One query block: each row's k-th score (candidate buffers or radix select), then a flash pass over kept keys.

    ``FLOAT_OUT``: the output is also stored unrounded, in the accumulation dtype, to ``OUT_FLOAT``.
    """
    scale = as_acc(scale, ACC)
    inv_temperature = as_acc(inv_temperature, ACC)
    # int64: offsets pass 2^31 on long contexts; a launch may take some of the (batch, head) pairs (CANDIDATE_BYTES)
    bh = tl.program_id(1).to(tl.int64) + first_bh
    batch, head, kv_head, offs_m, offs_d, offs_dv = query_program(bh, heads, group, BLOCK_M, BLOCK_D, BLOCK_DV)
    masking = (dense, dense_sb, dense_sh, dense_sm, dense_sn, additive, add_sb, add_sh, add_sm, add_sn)
    q_tile = load_tile(Q + batch * sq_b + head * sq_h, offs_m, offs_d, lq, head_dim, sq_m, sq_d)
    k_base = K + batch * sk_b + kv_head * sk_h
    v_base = V + batch * sv_b + kv_head * sv_h
    row_start, row_stop, lo, hi = key_block_bounds(key_start, key_stop, range_stride, batch, offs_m, lq, lk, HAS_RANGE)
    lo = lo // BLOCK_N * BLOCK_N  # aligned tiles: the backward recomputes the very same ones
    inner_lo, inner_hi, masked = inner_key_blocks(row_start, row_stop, offs_m, lq, lk, lo, hi, BLOCK_N)
    span = (lo, inner_lo, inner_hi, masked)
    softcap = tl.load(softcap_ptr)
    sink_score = sink_scores(sink, sink_sb, sink_sh, sink_sm, batch, head, offs_m, lq, HAS_SINK, BLOCK_M, ACC)
    sink_allowed = sink_score != float("-inf")
    sink_key = _sortable(sink_score, KEY, UKEY, KEY_BITS)
    sinks_here = sink_allowed.to(tl.int32)

    if CANDIDATES:
        # One pass: candidate buffers holding each row's keep_bound largest scores, then the k-th among them.
        live = offs_m < lq
        buffer_rows = BUFFER + (tl.program_id(1).to(tl.int64) * lq + offs_m) * CAP
        count, bound, dropped, allowed_count, nan_count = _candidate_pass(
            q_tile, k_base, sk_n, sk_d, offs_m, offs_d, head_dim, row_start, row_stop, span, lk, scale, softcap,
            batch, head, masking, buffer_rows, live, keep_bound, HAS_DENSE, HAS_ADDITIVE, SOFTCAP, BLOCK_M, BLOCK_N,
            ACC, CAP, KP,
        )
        if HAS_SINK:  # the sink, after every key: one more candidate (the buffer has room for a tile)
            sink_fresh = (sink_score >= bound) & live
            tl.store(buffer_rows + count, sink_score, mask=sink_fresh)
            count += sink_fresh.to(tl.int32)
        keep = _slots(allowed_count, sinks_here, K_PARAM, IS_FRACTION)
        keep, posinf_row, threshold, above, ties_cut = _candidate_threshold(buffer_rows, count, keep, dropped, live,
                                                                             BLOCK_M, CAP, KP)
        every = keep >= allowed_count + sinks_here
        cut = ~ties_cut  # every tie at the threshold kept
        at = keep + ties_cut.to(tl.int32)  # more than keep at or above the threshold: ties cut by key order
        threshold = tl.where(every, float("-inf"), threshold)
    else:
        # Selection, most significant digit first; the first pass also counts the allowed keys.
        prefix = tl.zeros((BLOCK_M,), UKEY)
        above = tl.zeros((BLOCK_M,), tl.int32)
        shift = tl.full((), KEY_BITS - RADIX, tl.int32)
        counts, allowed_count, posinf_count, nan_count = _candidate_counts(
            q_tile, k_base, sk_n, sk_d, offs_m, offs_d, head_dim, row_start, row_stop, span, lk, scale, softcap, batch,
            head, masking, prefix, shift, sink_key, HAS_DENSE, HAS_ADDITIVE, SOFTCAP, HAS_SINK, True, BLOCK_M, BLOCK_N,
            ACC, KEY, UKEY, KEY_BITS, RADIX,
        )
        keep = _slots(allowed_count, sinks_here, K_PARAM, IS_FRACTION)
        posinf_count += (sink_score == float("inf")).to(tl.int32)
        posinf_row = posinf_count > 0
        keep = tl.where(posinf_row, tl.minimum(keep, posinf_count), keep)
        prefix, above, at = _settle_digit(counts, prefix, above, keep, shift, UKEY, RADIX)
        every = keep >= allowed_count + sinks_here
        # The block stops once each row keeps every key or has a candidate with exactly k keys at or above it.
        cut = _cut(prefix, at, keep, KEY, UKEY, KEY_BITS, ACC)
        level = 1
        while (level < KEY_BITS // RADIX) & (tl.min((every | cut).to(tl.int32), 0) == 0):
            shift = KEY_BITS - RADIX * (level + 1)
            counts, _, _, _ = _candidate_counts(
                q_tile, k_base, sk_n, sk_d, offs_m, offs_d, head_dim, row_start, row_stop, span, lk, scale, softcap,
                batch, head, masking, prefix, shift, sink_key, HAS_DENSE, HAS_ADDITIVE, SOFTCAP, HAS_SINK, False,
                BLOCK_M, BLOCK_N, ACC, KEY, UKEY, KEY_BITS, RADIX,
            )
            prefix, above, at = _settle_digit(counts, prefix, above, keep, shift, UKEY, RADIX)
            cut = _cut(prefix, at, keep, KEY, UKEY, KEY_BITS, ACC)
            level += 1
        # Rows keeping every allowed key: threshold below all of them (key 0), no ties.  Cut rows keep every tie
        # at their candidate; after the last digit the ties kept are the k - (keys above the k-th) first ones.
        threshold_key = tl.where(every, tl.zeros_like(prefix), prefix)
        # The threshold as a score (-inf: every allowed key kept); the output pass compares floats (see _kept).
        threshold = tl.where(every, float("-inf"), _sortable_value(threshold_key, ACC, KEY, UKEY, KEY_BITS))
    nan_count += (sink_score != sink_score).to(tl.int32)
    tie_slots = tl.where(every | cut, 1 << 30, keep - above)

    state = tl.where(nan_count > 0, 0, tl.where(keep > 0, tl.where(posinf_row, 2, 1), 0))
    kept_from, slope = _row_terms(state, every, threshold, inv_temperature, ACC)
    # Rows keeping only some of the keys tied at their threshold, the first in key order (rare: equal scores).
    tie_cut = (state > 0) & ~(every | cut) & (at > keep)
    running = (tl.full((BLOCK_M,), float("-inf"), ACC), tl.zeros((BLOCK_M,), ACC), tl.zeros((BLOCK_M, BLOCK_DV), ACC))
    ties_before = tl.zeros((BLOCK_M,), tl.int32)
    last_tie = tl.full((BLOCK_M,), -1, tl.int32)
    if tl.max(tie_cut.to(tl.int32), 0) > 0:
        # Key order matters: a running count of the ties before each tile.
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            x = key_scores(q_tile, k_base, sk_n, sk_d, offs_m, offs_n, offs_d, head_dim, row_start, row_stop, lk,
                           scale, softcap, batch, head, masking, HAS_DENSE, HAS_ADDITIVE, SOFTCAP, ACC)
            ties = x == kept_from[:, None]
            kept = x > kept_from[:, None]
            if tl.max(tl.max(ties.to(tl.int32), 1), 0) > 0:  # a tile holding some row's k-th score: few per row
                tie_count = ties.to(tl.int32)
                kept_ties = ties & (ties_before[:, None] + tl.cumsum(tie_count, 1) <= tie_slots[:, None])
                kept = kept | kept_ties
                last_tie = tl.maximum(last_tie, tl.max(tl.where(kept_ties, offs_n[None, :], -1), 1))
                ties_before += tl.sum(tie_count, 1)
            running = _softmax_tile(kept, x, offs_n, running, slope, v_base, offs_dv, lk, value_dim, sv_n, sv_d, ACC)
    else:
        # Every tie kept: ``x >= kept_from`` whatever the key order, so masked key blocks first, then inner ones.
        for i in range(0, masked):
            offs_n = masked_block_start(i, lo, inner_lo, inner_hi, BLOCK_N) + tl.arange(0, BLOCK_N)
            x = key_scores(q_tile, k_base, sk_n, sk_d, offs_m, offs_n, offs_d, head_dim, row_start, row_stop, lk,
                           scale, softcap, batch, head, masking, HAS_DENSE, HAS_ADDITIVE, SOFTCAP, ACC)
            running = _softmax_tile(x >= kept_from[:, None], x, offs_n, running, slope, v_base, offs_dv, lk,
                                    value_dim, sv_n, sv_d, ACC)
        for start in range(inner_lo, inner_hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            x = key_scores(q_tile, k_base, sk_n, sk_d, offs_m, offs_n, offs_d, head_dim, row_start, row_stop, lk,
                           scale, softcap, batch, head, masking, HAS_DENSE, HAS_ADDITIVE, SOFTCAP, ACC, False)
            running = _softmax_tile(x >= kept_from[:, None], x, offs_n, running, slope, v_base, offs_dv, lk,
                                    value_dim, sv_n, sv_d, ACC)
    top, total, acc = running
    if HAS_SINK:
        # The sink, key index lk, comes after every real key: the last tie; its value is zero.
        sink_tie = sink_score == kept_from
        kept_sink_tie = sink_tie & (ties_before + 1 <= tie_slots)
        sink_kept = (sink_score > kept_from) | kept_sink_tie
        last_tie = tl.where(kept_sink_tie, lk, last_tie)
        sink_z = tl.sum(_log2_logits(sink_score[:, None], slope, ACC), 1)
        new_top = tl.maximum(top, tl.where(sink_kept, sink_z, float("-inf")))
        rescale = tl.where(top > float("-inf"), tl.exp2(top - new_top), 0.0)
        sink_p = tl.where(sink_kept, tl.exp2(sink_z - tl.where(new_top > float("-inf"), new_top, 0.0)), 0.0)
        top = new_top
        total = total * rescale + sink_p
        acc = acc * rescale[:, None]
    last_tie = tl.where(tie_cut, last_tie, -1)  # -1: every tie at the threshold kept

    live = state > 0
    out = tl.where(live[:, None], acc / tl.where(live, total, 1.0)[:, None], 0.0)
    out = tl.where((nan_count > 0)[:, None], float("nan"), out)
    rows = bh * lq + offs_m
    out_offsets = rows[:, None] * value_dim + offs_dv[None, :]
    out_tile = (offs_m < lq)[:, None] & (offs_dv < value_dim)[None, :]
    tl.store(OUT + out_offsets, out.to(OUT.dtype.element_ty), mask=out_tile)
    if FLOAT_OUT:
        tl.store(OUT_FLOAT + out_offsets, out, mask=out_tile)
    ptrs = STATS_PTR + rows * _STATS_WIDTH
    live_rows = offs_m < lq
    tl.store(ptrs, tl.where(live, top, 0.0), mask=live_rows)
    tl.store(ptrs + 1, tl.where(live, tl.log2(tl.where(live, total, 1.0)), 0.0), mask=live_rows)
    tl.store(ptrs + 2, tl.where(live, threshold, 0.0), mask=live_rows)
    tl.store(ptrs + 3, last_tie.to(ACC), mask=live_rows)
    tl.store(ptrs + 4, state.to(ACC), mask=live_rows)


@triton.jit
def _load_stats(STATS_PTR, rows, offs_m, lq, inv_temperature, ACC: tl.constexpr):
    """Per row ``(kept_from, tie_until, slope, offset, factor)``: what the backward's tiles need.

    Kept keys: :func:`_kept` with ``tie_until`` (:data:`_NO_TIE_CUT` unless the forward
    recorded a last kept tie); weights ``exp2(x slope - offset)`` (:func:`_log2_logits`;
    ``offset = top + log2(sum)``); score gradients ``p (dP factor - delta factor)``, with
    ``factor = 1 / temperature`` in a finite row, 0 in a +inf row (uniform weights,
    no score gradient) and in a row keeping nothing.
    """
    ptrs = STATS_PTR + rows * _STATS_WIDTH
    live = offs_m < lq
    top = tl.load(ptrs, mask=live, other=0.0).to(ACC)
    log_sum = tl.load(ptrs + 1, mask=live, other=0.0).to(ACC)
    threshold = tl.load(ptrs + 2, mask=live, other=0.0).to(ACC)
    last_tie = tl.load(ptrs + 3, mask=live, other=-1.0).to(tl.int32)
    state = tl.load(ptrs + 4, mask=live, other=0.0).to(tl.int32)
    every = ~(threshold > float("-inf"))  # -inf (or a NaN): every allowed key kept
    kept_from, slope = _row_terms(state, every, threshold, inv_temperature, ACC)
    tie_until = tl.where((state > 0) & (last_tie >= 0), last_tie, _NO_TIE_CUT)
    factor = tl.where(state == 1, inv_temperature, 0.0)
    return kept_from, tie_until, slope, top + log_sum, factor


@triton.jit
def _delta_factor(delta, factor):
    """``delta factor`` per row, 0 where ``factor`` is (a NaN row's delta stays out of dq, dk and the sink's ds)."""
    return tl.where(factor != 0, delta * factor, 0.0)


@triton.jit
def _probabilities(x, offs_n, kept_from, tie_until, slope, offset, TIES: tl.constexpr, ACC: tl.constexpr):
    """The forward's weights ``p`` on a tile, from the row terms of :func:`_load_stats` (0 off the kept keys)."""
    logits = _log2_logits(x, slope, ACC) - offset[:, None]
    return tl.where(_kept(x, kept_from, offs_n, tie_until, TIES), tl.exp2(logits), 0.0)


@triton.jit
def _dq_add(x, slope, offs_n, dq, stats, operands, ties, SOFTCAP: tl.constexpr, SKIP: tl.constexpr,
            ACC: tl.constexpr):
    """``dq`` with one score tile's ``ds k`` added; under ``SKIP`` a tile keeping no key reads no V, no K."""
    kept_from, tie_until, row_slope, offset, factor, delta_factor = stats
    v_base, offs_dv, lk, value_dim, sv_n, sv_d, do_tile, k_base, offs_d, head_dim, sk_n, sk_d = operands
    if ties:  # a uniform branch: one pipelined loop for both kept tests
        p = _probabilities(x, offs_n, kept_from, tie_until, row_slope, offset, True, ACC)
    else:
        p = _probabilities(x, offs_n, kept_from, tie_until, row_slope, offset, False, ACC)
    live = True
    if SKIP:  # attention_launch.SKIP_EMPTY_TILES: a tile without support loads nothing more
        live = tl.max(tl.max(p, 1), 0) > 0
    if live:
        v_tile = load_tile(v_base, offs_n, offs_dv, lk, value_dim, sv_n, sv_d)
        g = mma(do_tile, tl.trans(v_tile), ACC)
        ds = p * (g * factor[:, None] - delta_factor[:, None])
        if SOFTCAP:
            ds = ds * slope
        k_tile = load_tile(k_base, offs_n, offs_d, lk, head_dim, sk_n, sk_d)
        dq += rounded_mma(ds, k_tile, ACC)
    return dq


@triton.jit
def _dq_loops(q_tile, k_base, sk_n, sk_d, offs_m, offs_d, head_dim, row_start, row_stop, lk, scale, softcap, batch,
              head, masking, span, dq, stats, operands, HAS_DENSE: tl.constexpr, HAS_ADDITIVE: tl.constexpr,
              ties, SOFTCAP: tl.constexpr, SKIP: tl.constexpr, BLOCK_N: tl.constexpr,
              ACC: tl.constexpr):
    """``dq`` over a query block's key blocks: the masked ones, then the inner ones (a sum: any order)."""
    lo, inner_lo, inner_hi, masked = span
    for i in range(0, masked):
        offs_n = masked_block_start(i, lo, inner_lo, inner_hi, BLOCK_N) + tl.arange(0, BLOCK_N)
        x, slope = key_scores_slope(q_tile, k_base, sk_n, sk_d, offs_m, offs_n, offs_d, head_dim, row_start, row_stop,
                                    lk, scale, softcap, batch, head, masking, HAS_DENSE, HAS_ADDITIVE, SOFTCAP, ACC)
        dq = _dq_add(x, slope, offs_n, dq, stats, operands, ties, SOFTCAP, SKIP, ACC)
    for start in range(inner_lo, inner_hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        x, slope = key_scores_slope(q_tile, k_base, sk_n, sk_d, offs_m, offs_n, offs_d, head_dim, row_start, row_stop,
                                    lk, scale, softcap, batch, head, masking, HAS_DENSE, HAS_ADDITIVE, SOFTCAP, ACC,
                                    False)
        dq = _dq_add(x, slope, offs_n, dq, stats, operands, ties, SOFTCAP, SKIP, ACC)
    return dq


@triton.jit
def _topk_dq_kernel(
    Q, K, V, DO, DELTA, STATS_PTR, DQ, D_SINK,
    sq_b, sq_h, sq_m, sq_d, sk_b, sk_h, sk_n, sk_d, sv_b, sv_h, sv_n, sv_d, so_b, so_h, so_m, so_d,
    heads, group, lq, lk, head_dim, value_dim, scale: tl.float64, inv_temperature: tl.float64,
    key_start, key_stop, range_stride,
    dense, dense_sb, dense_sh, dense_sm, dense_sn, additive, add_sb, add_sh, add_sm, add_sn,
    softcap_ptr, sink, sink_sb, sink_sh, sink_sm,
    HAS_RANGE: tl.constexpr, HAS_DENSE: tl.constexpr, HAS_ADDITIVE: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_SINK: tl.constexpr, SKIP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, ACC: tl.constexpr,
):
    """One query block: ``dq = scale sum_j ds_j k_j`` over its key blocks; the sinks' ``ds`` per row (``D_SINK``)."""
    scale = as_acc(scale, ACC)
    inv_temperature = as_acc(inv_temperature, ACC)
    bh = tl.program_id(1).to(tl.int64)  # offsets pass 2^31 on long contexts
    batch, head, kv_head, offs_m, offs_d, offs_dv = query_program(bh, heads, group, BLOCK_M, BLOCK_D, BLOCK_DV)
    masking = (dense, dense_sb, dense_sh, dense_sm, dense_sn, additive, add_sb, add_sh, add_sm, add_sn)
    q_tile = load_tile(Q + batch * sq_b + head * sq_h, offs_m, offs_d, lq, head_dim, sq_m, sq_d)
    do_tile = load_tile(DO + batch * so_b + head * so_h, offs_m, offs_dv, lq, value_dim, so_m, so_d)
    k_base = K + batch * sk_b + kv_head * sk_h
    v_base = V + batch * sv_b + kv_head * sv_h
    rows = bh * lq + offs_m
    kept_from, tie_until, row_slope, offset, factor = _load_stats(STATS_PTR, rows, offs_m, lq, inv_temperature, ACC)
    delta = tl.load(DELTA + rows, mask=offs_m < lq, other=0.0)
    row_start, row_stop, lo, hi = key_block_bounds(key_start, key_stop, range_stride, batch, offs_m, lq, lk, HAS_RANGE)
    lo = lo // BLOCK_N * BLOCK_N
    softcap = tl.load(softcap_ptr)
    dq = tl.zeros((BLOCK_M, BLOCK_D), ACC)
    stats = (kept_from, tie_until, row_slope, offset, factor, _delta_factor(delta, factor))
    operands = (v_base, offs_dv, lk, value_dim, sv_n, sv_d, do_tile, k_base, offs_d, head_dim, sk_n, sk_d)
    inner_lo, inner_hi, masked = inner_key_blocks(row_start, row_stop, offs_m, lq, lk, lo, hi, BLOCK_N)
    span = (lo, inner_lo, inner_hi, masked)
    ties = tl.min(tie_until, 0) < _NO_TIE_CUT  # a row keeping only some of its ties: the key index decides
    dq = _dq_loops(q_tile, k_base, sk_n, sk_d, offs_m, offs_d, head_dim, row_start, row_stop, lk, scale, softcap,
                   batch, head, masking, span, dq, stats, operands, HAS_DENSE, HAS_ADDITIVE, ties, SOFTCAP, SKIP,
                   BLOCK_N, ACC)
    tl.store(DQ + rows[:, None] * head_dim + offs_d[None, :], (dq * scale).to(DQ.dtype.element_ty),
             mask=(offs_m < lq)[:, None] & (offs_d < head_dim)[None, :])
    if HAS_SINK:
        # The sink is key lk (its value is zero: dP = 0): ds = -p delta / temperature.
        sink_score = sink_scores(sink, sink_sb, sink_sh, sink_sm, batch, head, offs_m, lq, HAS_SINK, BLOCK_M, ACC)
        sink_p = _probabilities(sink_score[:, None], tl.full((1,), lk, tl.int32), kept_from, tie_until, row_slope,
                                offset, True, ACC)
        tl.store(D_SINK + rows, -tl.sum(sink_p, 1) * stats[5], mask=offs_m < lq)


@triton.jit
def _topk_dkdv_kernel(
    Q, K, V, DO, DELTA, STATS_PTR, DK, DV,
    sq_b, sq_h, sq_m, sq_d, sk_b, sk_h, sk_n, sk_d, sv_b, sv_h, sv_n, sv_d, so_b, so_h, so_m, so_d,
    heads, group, lq, lk, head_dim, value_dim, scale: tl.float64, inv_temperature: tl.float64,
    key_start, key_stop, range_stride,
    dense, dense_sb, dense_sh, dense_sm, dense_sn, additive, add_sb, add_sh, add_sm, add_sn,
    softcap_ptr, sink, sink_sb, sink_sh, sink_sm,
    HAS_RANGE: tl.constexpr, HAS_DENSE: tl.constexpr, HAS_ADDITIVE: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_SINK: tl.constexpr, SKIP: tl.constexpr, SCAN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, ACC: tl.constexpr,
):
    """One key block of one key/value head: ``dv = sum p^T dO``, ``dk = scale sum ds^T q`` over the group's queries."""
    scale = as_acc(scale, ACC)
    inv_temperature = as_acc(inv_temperature, ACC)
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
        for query_block in range(first, last):  # no test around the loads: they are prefetched
            offs_m, row_start, row_stop, q_tile, do_tile = query_block_tiles(
                query_block, Q + batch * sq_b + head * sq_h, DO + batch * so_b + head * so_h, offs_d, offs_dv,
                head_dim, value_dim, sq_m, sq_d, so_m, so_d, key_start, key_stop, range_stride, batch, lq, lk,
                HAS_RANGE, BLOCK_M)
            rows = (batch * heads + head) * lq + offs_m
            kept_from, tie_until, row_slope, offset, factor = _load_stats(STATS_PTR, rows, offs_m, lq,
                                                                          inv_temperature, ACC)
            delta = tl.load(DELTA + rows, mask=offs_m < lq, other=0.0)
            x, slope = key_scores_slope(q_tile, k_base, sk_n, sk_d, offs_m, offs_n, offs_d, head_dim, row_start,
                                        row_stop, lk, scale, softcap, batch, head, masking, HAS_DENSE,
                                        HAS_ADDITIVE, SOFTCAP, ACC)
            if tl.min(tie_until, 0) < _NO_TIE_CUT:  # a row keeping only some of its ties: the key index decides
                p = _probabilities(x, offs_n, kept_from, tie_until, row_slope, offset, True, ACC)
            else:
                p = _probabilities(x, offs_n, kept_from, tie_until, row_slope, offset, False, ACC)
            live = True
            if SKIP:  # attention_launch.SKIP_EMPTY_TILES: products only in a tile with a kept key
                live = tl.max(tl.max(p, 1), 0) > 0
            if live:
                dv += mma(tl.trans(p.to(do_tile.dtype)), do_tile, ACC)
                g = mma(do_tile, tl.trans(v_tile), ACC)
                ds = p * (g * factor[:, None] - _delta_factor(delta, factor)[:, None])
                if SOFTCAP:
                    ds = ds * slope
                dk += rounded_mma(tl.trans(ds), q_tile, ACC)
    key_rows = bh * lk + offs_n
    tl.store(DK + key_rows[:, None] * head_dim + offs_d[None, :], (dk * scale).to(DK.dtype.element_ty),
             mask=(offs_n < lk)[:, None] & (offs_d < head_dim)[None, :])
    tl.store(DV + key_rows[:, None] * value_dim + offs_dv[None, :], dv.to(DV.dtype.element_ty),
             mask=(offs_n < lk)[:, None] & (offs_dv < value_dim)[None, :])


# ---- host functions ------------------------------------------------------------------------


def _check(k_keep: float, is_fraction: bool, temperature: float) -> None:
    if is_fraction and not 0 < k_keep < 1:
        raise ValueError(f"k_keep must be in (0, 1) when is_fraction, got {k_keep}")
    if not is_fraction and (k_keep < 1 or k_keep != int(k_keep)):
        raise ValueError(f"k_keep must be an integer >= 1, got {k_keep}")
    if not temperature > 0 or math.isinf(temperature):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}")


def _arguments(shape: Problem, q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask, scale: float,
               temperature: float, softcap: float | None, sinks: Tensor | None) -> tuple[tuple, dict]:
    """Strides of q, k, v; sizes, scale and ``1 / temperature``; mask and modifier keywords."""
    strides = (*q.stride(), *k.stride(), *v.stride())
    sizes = (*shape.sizes, float(scale), 1.0 / float(temperature))
    acc = rules.accumulation_dtype(q.dtype)
    constants = dict(**mask_arguments(mask, shape.score_shape, q.device),
                     **modifier_arguments(softcap, sinks, shape.score_shape, acc, q.device), **shape.constants)
    return strides, sizes, constants


CANDIDATE_KEEP = 64
"""The largest number of kept keys (an integer ``k``, or ``ceil(k Lk)`` for a fraction) selected by candidate buffers.

Above it, or for float64 scores, the forward takes the radix select (module docstring)."""

CANDIDATE_ROOM = 2
"""Tiles of scores a row's candidate buffer takes past its kept keys before it is shrunk (tests: 1, shrunk often)."""

CANDIDATE_BYTES = 64 << 20
"""Candidate buffer bytes per launch (or one (batch, head) pair's, if more): a forward needing more runs in launches."""


CANDIDATE_CHUNK = 32
"""Fewest buffer slots a shrink reads at a time (``KP``: at least the power of two at or above the kept keys)."""


class _Candidates(NamedTuple):
    """The candidate selection's sizes: kept keys at most, buffer slots read at a time, buffer slots per row."""

    keep_bound: int
    kp: int
    cap: int


def _candidates(shape: Problem, q: Tensor, k_keep: float, is_fraction: bool) -> _Candidates | None:
    """The candidate selection's sizes for this call, or None where the radix select runs."""
    if q.dtype == torch.float64:
        return None
    bound = math.ceil(k_keep * shape.lk) if is_fraction else int(k_keep)
    bound = max(1, min(bound, shape.lk + 1))
    if bound > CANDIDATE_KEEP:
        return None
    cap = launch.next_power_of_2(launch.next_power_of_2(bound) + CANDIDATE_ROOM * shape.block)
    return _Candidates(bound, min(cap, max(launch.next_power_of_2(bound), CANDIDATE_CHUNK)), cap)


def _key_constants(q: Tensor) -> dict[str, Any]:
    """The forward's sortable-key types (the backward compares scores as floats: :func:`_kept`)."""
    wide = q.dtype == torch.float64
    return dict(KEY=tl.int64 if wide else tl.int32, UKEY=tl.uint64 if wide else tl.uint32, KEY_BITS=64 if wide else 32)


@replay.replayable
def topk_attention_forward(
    q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask, scale: float, k_keep: float, is_fraction: bool,
    temperature: float, softcap: float | None = None, sinks: Tensor | None = None, float_out: bool = False,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Exact top-k attention: ``out = softmax(x / T over the kept keys) v``, ``x = cap(scale q k^T) + additive``.

    One pass over K with candidate buffers (k up to :data:`CANDIDATE_KEEP`, not float64),
    else up to ``32 / RADIX_BITS`` passes over K (``64 / RADIX_BITS`` for float64), select
    each row's k-th score; one pass over K and V accumulates the output (module docstring).

    Args:
        q: ``(B, Hq, Lq, D)``; k: ``(B, Hkv, Lk, D)``; v: ``(B, Hkv, Lk, Dv)``; ``Hq % Hkv == 0``.
        mask: which keys each query row may attend.
        scale: the score scale.
        k_keep: keys kept per row, ``min(k_keep, n)``; with ``is_fraction`` (``0 < k_keep < 1``)
            ``max(1, ceil(k_keep n - 1e-9))`` of the ``n`` allowed keys.  Ties at the k-th
            score: the lowest key index wins.
        is_fraction: read ``k_keep`` as a fraction.
        temperature: softmax temperature, ``> 0``.
        softcap: None, or the cap ``> 0``: ``cap(s) = softcap tanh(s / softcap)``.
        sinks: None, or each row's sink score, broadcastable to ``(B, Hq, Lq)``: a key of value
            zero after every real key (it loses ties), which may take one of the ``k_keep``
            slots (``n + 1`` keys to keep from) but is not among the ``n`` a fraction counts.
        float_out: for float16 / bfloat16 inputs, also return the output unrounded, for
            :func:`topk_attention_backward`'s ``delta``: one more store per row
            (``4 Dv`` bytes), no other work.

    Returns:
        ``(out, stats, out_float)``: ``(B, Hq, Lq, Dv)`` in q's dtype; ``(B, Hq, Lq, 5)`` in the
        accumulation dtype, laid out as :data:`STATS` says (``last_tie = Lk``: the sink is a
        kept tie); the output in the accumulation dtype with ``float_out`` and half-precision
        inputs, else None.

    Raises:
        ValueError: bad shapes, ``k_keep`` or ``temperature``.
    """
    _check(k_keep, is_fraction, temperature)
    shape = problem(q, k, v)
    out = launch.empty((shape.batch, shape.heads, shape.lq, shape.value_dim), q.dtype, q.device)
    stats = shape.row_tensor(STATS, like=q)
    out_float = shape.float_output(q, float_out)
    if stats.numel() == 0:
        return out, stats, out_float
    k_param = launch.constant(float(k_keep), torch.float64, q.device)  # kept: no fill kernel per call
    plan = _candidates(shape, q, k_keep, is_fraction)
    q, k, v = dot_operands(q, k, v)
    strides, sizes, constants = _arguments(shape, q, k, v, mask, scale, temperature, softcap, sinks)
    constants.update(IS_FRACTION=bool(is_fraction), RADIX=RADIX_BITS, FLOAT_OUT=out_float is not None,
                     **_key_constants(q), **launch_options(shape, q))
    blocks, pairs = shape.query_grid
    if plan is None:  # the radix select: one launch, no buffer (stats stands in for the unread pointer)
        plan, per_launch, buffer = _Candidates(0, 1, 1), pairs, stats
    else:  # candidate buffers for as many (batch, head) pairs as CANDIDATE_BYTES holds, reused launch after launch
        per_launch = max(1, min(pairs, CANDIDATE_BYTES // (4 * plan.cap * shape.lq)))
        buffer = launch.empty((per_launch * shape.lq * plan.cap,), torch.float32, q.device)  # scratch
    for first in range(0, pairs, per_launch):
        launch.launchable(_topk_forward_kernel)[blocks, min(per_launch, pairs - first)](
            q, k, v, out, out if out_float is None else out_float, stats, k_param, buffer, plan.keep_bound, first,
            *strides, *sizes, CANDIDATES=plan.keep_bound > 0, CAP=plan.cap, KP=plan.kp, **constants,
        )
    return out, stats, out_float


@replay.replayable
def topk_attention_backward(
    q: Tensor, k: Tensor, v: Tensor, out: Tensor, grad_out: Tensor, stats: Tensor, mask: AttentionMask,
    scale: float, k_keep: float, is_fraction: bool, temperature: float, softcap: float | None = None,
    sinks: Tensor | None = None, out_float: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Gradients of :func:`topk_attention_forward` by recomputation with the forward's threshold and tie cut.

    ``ds = p (dP - delta) / temperature`` on the kept keys (``delta = rowsum(dO * out)``;
    times the cap's slope with ``softcap``); rows in state 0 or 2 get no score gradient
    (+inf rows still pass their weights to dv).  ``k_keep`` and ``is_fraction`` are not
    needed (the stats hold the kept set).  ``out_float``: the forward's unrounded output
    (``float_out=True``), read for ``delta`` instead of ``out``.  ``dP - delta`` cancels where a
    row's weight sits on few keys; from a bfloat16 ``out`` (8 bits) the cancelled difference
    kept ~1 % of ``dP`` in such rows, from float32 a millionth (``tests/kernels/test_attention_topk.py``).

    Returns:
        ``(dq, dk, dv, d_sinks)``: shaped and typed like ``q``, ``k``, ``v``; each row's sink
        score gradient ``-p_sink delta / temperature`` ``(B, Hq, Lq)`` in the accumulation
        dtype, or None without ``sinks``.
    """
    _check(k_keep, is_fraction, temperature)
    shape = problem(q, k, v)
    stats = stats.contiguous()
    dq = launch.empty(tuple(q.shape), q.dtype, q.device)
    dk = launch.empty(tuple(k.shape), k.dtype, k.device)
    dv = launch.empty(tuple(v.shape), v.dtype, v.device)
    d_sinks = None if sinks is None else shape.row_tensor(like=q)
    delta = row_dot(shape, out if out_float is None else out_float, grad_out)
    q, k, v, grad_out = dot_operands(q, k, v, grad_out)
    strides, sizes, constants = _arguments(shape, q, k, v, mask, scale, temperature, softcap, sinks)
    arguments = (*strides, *grad_out.stride(), *sizes)
    constants.update(launch_options(shape, q), SKIP=attention_launch.SKIP_EMPTY_TILES)
    if dq.numel():
        launch.launchable(_topk_dq_kernel)[shape.query_grid](
            q, k, v, grad_out, delta, stats, dq, delta if d_sinks is None else d_sinks, *arguments, **constants,
        )
    if dk.numel() or dv.numel():
        launch.launchable(_topk_dkdv_kernel)[shape.key_grid](
            q, k, v, grad_out, delta, stats, dk, dv, *arguments, **constants, SCAN=RANGE_SCAN,
        )
    return dq, dk, dv, d_sinks
