"""Decoding kernels: split-K (flash-decoding) Self-Adjusted Softmax attention, and float32 scores for the rows route.

``out_i = sum_j phi(x_ij) w_ij v_j`` with ``x = scale q k^T + additive`` over row ``i``'s
allowed keys, ``w = softmax(x)`` and ``phi(x) = x`` (plain) or ``(x - low) / (high - low)``,
``low = min(min x, 0)``, ``high = max(max x, 0)`` (normalized; ``phi = 0`` when
``high = low``), as :mod:`.attention_self_adjusted` computes it for training shapes.

**Why split-K.**  In decoding (``Lq`` of 1 to 16 against ``Lk`` of thousands) a
query-block kernel has one program per (batch, head): 128 programs at batch 8 and 16
heads cannot keep 132 SMs streaming K and V.  Here the keys are cut into ``S``
splits processed in parallel and their partial results are merged, as in
flash-decoding.  SA's forward allows it because it is one pass over K and V with
mergeable state: with ``e_j = exp(x_j - m)`` over a set of keys, the partial
``(m, l = sum e, A = sum e (x - m) v, B = sum e v, min x)`` of two disjoint sets
merges exactly (:func:`_merge`): relative to ``M = max(m, m')`` and
``r = exp(m - M)``, ``l = r l + r' l'``, ``B = r B + r' B'``,
``A = r A + r (m - M) B + r' A' + r' (m' - M) B'``.  The output follows from the
merged sums: ``(A + m B) / l`` (plain) or ``(A + (m - low) B) / (l (high - low))``
(normalized).  The same merge adds each key block into a split's running sums and
each split into the result.

**Programs.**  The split kernel runs one program per (key split, batch x key/value
head) and stacks every query row of the GQA group into one tile: stacked row
``r = member Lq + i`` is query ``i`` of query head ``kv_head G + member``, so K and
V of a split are read once per key/value head, not once per query head (up to
:data:`MAX_STACKED_ROWS` stacked rows; more take a third grid axis of row blocks,
each reading the split's K and V).  It writes per-split partials in the accumulation
dtype (float32; float64 for float64 inputs).  The combine kernel runs one program per
(batch x key/value head, row block) and merges the splits of its rows into ``out``.

**Rules** (those of :mod:`.attention_self_adjusted` and its tests): a row with no
allowed key gives zeros; a row holding +inf scores gives the limit of the finite
case (uniform over its +inf keys: factor 1 normalized, +inf plain), taken by a
second pass over the split's keys, only in splits holding such a row, whose sum is
stored in the ``B`` slot; a NaN score makes the row NaN.  Masks are an
:class:`~attnorm.kernels.rules.AttentionMask` read by :mod:`.attention_blocks`: key
blocks outside every stacked row's interval are skipped.

**Passes and bytes** (``s`` bytes per element, ``G = Hq / Hkv`` query heads per
key/value head, ``S`` splits):

* per key and key/value head: K and V read once, ``(D + Dv) s`` (256 bytes at
  ``D = Dv = 64`` in bfloat16), one pass over K and V (two in a split holding a +inf
  row); a dense (1 byte) or additive (``s``) mask is read per query row and key;
* per query row: ``q`` read, ``out`` written, ``(D + Dv) s``; the split kernel writes
  and the combine kernel reads :data:`PARTIAL_STATS` numbers and the two sums
  ``A``, ``B`` per split, ``S (5 + 2 Dv) 4`` bytes each way (about 4.7 KiB at ``S = 9``,
  ``Dv = 64``, against 1 MiB of K and V per key/value head at ``Lk = 4096``).

**Why a combine kernel, not torch ops.**  The partials are
``S (5 + 2 Dv) 4 G Lq / (Lk (D + Dv) s)`` of the K and V bytes (0.2% above), so bytes
do not decide it; launches do.  The merge written in torch is about ten elementwise
ops over the partials, each a launch of a few microseconds, comparable to a whole
decoding step (8 x 16 heads x 4096 keys of K and V in bfloat16 are 134 MB: 40 us at
3.35 TB/s); one Triton kernel is one launch and reads the partials once.

**Why only Self-Adjusted has a split-K kernel.**  Entmax/sparsemax find their
threshold ``tau`` by a search over each row (:mod:`.attention_entmax`: one pass for
the max, ``I`` bisection or Newton passes, one for the output) and top-k finds its
k-th score by a radix select (:mod:`.attention_topk`): every pass needs a reduction
over all of the row's keys before the next can start.  A split-K kernel would have
to merge across splits after each pass, i.e. a launch (or grid-wide barrier) per
pass and K re-read once per pass, ``1 + I + 1`` (about 6 to 9) times.  Scores as rows
(``q k^T``, the row kernel, ``w v``) reads K once, and each later pass rereads only
the ``Lq x Lk`` float32 scores, ``4 / (D s)`` = 1/32 of K's bytes at ``D = 64`` in
bfloat16 (1/D in elements), so for those families scores-as-rows *is* the split-K
design: the matmuls split the keys over the SMs, and the row kernels' passes touch
a small matrix.  This is reasoning about bytes, not a measurement; the choice per
family is :data:`attnorm.routes.decoding.DECODING_ROUTES`, and
``benchmarks/bench_decoding.py`` times both routes.

**Scores for the rows route** (:func:`decoding_scores_forward`).  Half-precision scores
are wanted in float32, as the fused kernels compute them; ``torch.matmul`` needs both
operands in one dtype, and multiplying float32 copies wrote and read a float32 copy of K
on every decoding step: per key ``2 D`` bytes read, ``4 D`` written, ``4 D`` read again
(640 bytes at ``D = 64``, where SDPA reads 256 for K and V together).  The scores kernel
reads each key once in its own dtype, ``2 D`` bytes, and writes 4 bytes per stacked row.

Tiles: ``tl.dot`` needs 16 rows, so one query against a key/value head of one query
head fills 1 of 16 rows of the score tile; the wasted products are compute, which
decoding (bound by the bytes of K and V) has to spare.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from attnorm.kernels import ops, rules
from attnorm.kernels.rules import NO_MASK, AttentionMask, RowMask
from attnorm.kernels.triton import launch, replay
from attnorm.kernels.triton.attention_blocks import (
    as_acc,
    key_block_bounds,
    key_scores,
    load_tile,
    mask_arguments,
    mma,
    rounded_mma,
)
from attnorm.kernels.triton.attention_launch import dot_operands, head_width, launch_options, problem
from attnorm.kernels.triton.attention_self_adjusted import finish, posinf_mass

__all__ = [
    "INTERPRETED_SMS",
    "MAX_STACKED_ROWS",
    "PARTIAL_STATS",
    "PROGRAMS_PER_SM",
    "SCORE_BLOCKS_PER_PROGRAM",
    "decoding_scores_forward",
    "decoding_weights_forward",
    "self_adjusted_decoding_forward",
    "ssmax_queries_forward",
    "split_count",
]

PARTIAL_STATS = 5
"""Per-split, per-row stats: ``(m, l, min x, +inf count, NaN count)``; ``m`` and ``min x`` over finite scores."""

MAX_STACKED_ROWS = 128
"""Most stacked rows ``(Hq / Hkv) Lq`` one program holds (a 128 x 64 score tile, as a flash kernel's); more
rows take several row blocks, each reading the split's K and V."""

PROGRAMS_PER_SM = 8
"""Split-kernel programs aimed at per streaming multiprocessor.

Timed on an H200 (``scripts/decoding_probe.py``, CUDA-graph replay, 2026-11-26; bfloat16, batch 8,
16 heads, head dim 64, one query row, so 128 programs per split): 8 and 16 splits were the fastest
of 3 (the earlier 2 per SM), 8, 16, 32, 64 and 128 at every KV length, 3 splits taking 0.071 /
0.252 / 0.976 ms at 4k / 16k / 64k keys and 8 splits 0.065 / 0.199 / 0.740 (SDPA 0.038 / 0.137 /
0.535).  One program streams its split's K and V tile by tile, so more resident programs put
more loads in flight."""

INTERPRETED_SMS = 1
"""Streaming multiprocessors assumed off CUDA (Triton's interpreter), so small tests still get several splits
(:data:`PROGRAMS_PER_SM` of them for one program per split)."""

SCORE_BLOCKS_PER_PROGRAM = 8
"""Key blocks one program of the scores kernel streams (512 keys at the 64-key block: at batch 8, 16 key/value
heads and 64k keys, 16384 programs; at 4k, 1024)."""

_PARTIAL_WIDTH = tl.constexpr(PARTIAL_STATS)


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def split_count(lk: int, programs: int, block: int, device: torch.device) -> int:
    """Key splits for ``programs`` programs per split (batch x key/value head x row blocks) over ``lk`` keys.

    ``ceil(PROGRAMS_PER_SM * SMs / programs)``, at most one split per key block of ``block``
    keys, at least 1: at batch 8 and 16 key/value heads on an H100 or H200 (132 SMs) 9 splits;
    at batch 1 and 8 key/value heads 132 (at most ``Lk / 64``).
    """
    sms = _multiprocessors(device) if device.type == "cuda" else INTERPRETED_SMS
    wanted = launch.cdiv(PROGRAMS_PER_SM * sms, max(programs, 1))
    return max(1, min(launch.cdiv(lk, block), wanted))


# ---- device helpers ------------------------------------------------------------------------


@triton.jit
def _merge(top, total, shifted, plain, other_top, other_total, other_shifted, other_plain):
    """Merge the sums ``(m, l, A, B)`` of two disjoint key sets (module docstring); ``m = -inf`` for none.

    ``r (m - M)`` is formed before it multiplies ``B``: 0 where ``r`` underflows, never ``0 x inf``.
    """
    new_top = tl.maximum(top, other_top)
    ref = tl.where(new_top > float("-inf"), new_top, 0.0)
    keep = tl.where(top > float("-inf"), tl.exp(top - ref), 0.0)
    take = tl.where(other_top > float("-inf"), tl.exp(other_top - ref), 0.0)
    keep_moved = keep * tl.where(top > float("-inf"), top - ref, 0.0)
    take_moved = take * tl.where(other_top > float("-inf"), other_top - ref, 0.0)
    shifted = keep[:, None] * shifted + keep_moved[:, None] * plain
    shifted += take[:, None] * other_shifted + take_moved[:, None] * other_plain
    plain = keep[:, None] * plain + take[:, None] * other_plain
    return new_top, keep * total + take * other_total, shifted, plain


@triton.jit
def _stacked_rows(kv_head, group, lq, row_block, BLOCK_M: tl.constexpr):
    """Stacked rows of a GQA group's row block: ``(r, head, query)``; padding rows get query ``lq`` (no key)."""
    r = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
    live = r < group * lq
    head = kv_head * group + tl.where(live, r // lq, 0)
    return r, head, tl.where(live, r % lq, lq)


@triton.jit
def _split_scores(q_tile, k_base, sk_n, sk_d, query, offs_n, offs_d, head_dim, rows, scale, batch, head, masking,
                  HAS_DENSE: tl.constexpr, HAS_ADDITIVE: tl.constexpr, ACC: tl.constexpr):
    """:func:`.attention_blocks.key_scores` of the stacked rows (``rows``: their intervals and ``lk``), no softcap."""
    row_start, row_stop, lk = rows
    return key_scores(q_tile, k_base, sk_n, sk_d, query, offs_n, offs_d, head_dim, row_start, row_stop, lk, scale,
                      1.0, batch, head, masking, HAS_DENSE, HAS_ADDITIVE, False, ACC)


# ---- kernels ---------------------------------------------------------------------------------


@triton.jit
def _split_kernel(
    Q, K, V, PART_STATS, PART_SHIFTED, PART_PLAIN,
    sq_b, sq_h, sq_m, sq_d, sk_b, sk_h, sk_n, sk_d, sv_b, sv_h, sv_n, sv_d,
    heads, group, lq, lk, head_dim, value_dim, scale: tl.float64, split_keys, splits,
    key_start, key_stop, range_stride,
    dense, dense_sb, dense_sh, dense_sm, dense_sn, additive, add_sb, add_sh, add_sm, add_sn,
    HAS_RANGE: tl.constexpr, HAS_DENSE: tl.constexpr, HAS_ADDITIVE: tl.constexpr, NORMALIZED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, ACC: tl.constexpr,
):
    """Keys ``[split split_keys, (split + 1) split_keys)`` of one key/value head for a block of its stacked rows.

    One pass over the split's K and V (a second in a split holding a +inf row); writes the
    partial stats and sums ``A``, ``B`` (``B``: the +inf keys' mass in rows holding +inf).
    """
    scale = as_acc(scale, ACC)
    split, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)  # offsets pass 2^31 on long contexts
    kv_heads = heads // group
    batch, kv_head = bh // kv_heads, bh % kv_heads
    r, head, query = _stacked_rows(kv_head, group, lq, tl.program_id(2), BLOCK_M)
    head = head[:, None]  # a column: score_tile's mask pointers broadcast it over the keys
    offs_d, offs_dv = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    masking = (dense, dense_sb, dense_sh, dense_sm, dense_sn, additive, add_sb, add_sh, add_sm, add_sn)
    q_tile = load_tile(Q + batch * sq_b + head * sq_h, query, offs_d, lq, head_dim, sq_m, sq_d)
    k_base = K + batch * sk_b + kv_head * sk_h
    v_base = V + batch * sv_b + kv_head * sv_h
    row_start, row_stop, lo, hi = key_block_bounds(key_start, key_stop, range_stride, batch, query, lq, lk, HAS_RANGE)
    rows = (row_start, row_stop, lk)
    first = split * split_keys
    lo = tl.maximum(lo // BLOCK_N * BLOCK_N, first)
    hi = tl.minimum(hi, first + split_keys)

    top = tl.full((BLOCK_M,), float("-inf"), ACC)
    bottom = tl.full((BLOCK_M,), float("inf"), ACC)
    total = tl.zeros((BLOCK_M,), ACC)
    posinf_count = tl.zeros((BLOCK_M,), ACC)
    nan_count = tl.zeros((BLOCK_M,), ACC)
    shifted = tl.zeros((BLOCK_M, BLOCK_DV), ACC)  # A = sum e (x - top) v
    plain = tl.zeros((BLOCK_M, BLOCK_DV), ACC)  # B = sum e v
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        x = _split_scores(q_tile, k_base, sk_n, sk_d, query, offs_n, offs_d, head_dim, rows, scale, batch, head,
                          masking, HAS_DENSE, HAS_ADDITIVE, ACC)
        finite = (x > float("-inf")) & (x < float("inf"))
        posinf_count += tl.sum((x == float("inf")).to(ACC), 1)
        nan_count += tl.sum((x != x).to(ACC), 1)
        bottom = tl.minimum(bottom, tl.min(tl.where(finite, x, float("inf")), 1))
        block_top = tl.max(tl.where(finite, x, float("-inf")), 1)
        xs = tl.where(finite, x - tl.where(block_top > float("-inf"), block_top, 0.0)[:, None], 0.0)
        e = tl.where(finite, tl.exp(xs), 0.0)
        v_tile = load_tile(v_base, offs_n, offs_dv, lk, value_dim, sv_n, sv_d)
        top, total, shifted, plain = _merge(
            top, total, shifted, plain, block_top, tl.sum(e, 1),
            rounded_mma(e * xs, v_tile, ACC), mma(e.to(v_tile.dtype), v_tile, ACC),
        )
    if tl.max(posinf_count, 0) > 0:
        # The limit of the finite case: the softmax mass sits uniformly on the +inf keys.
        limit = tl.zeros((BLOCK_M, BLOCK_DV), ACC)
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            x = _split_scores(q_tile, k_base, sk_n, sk_d, query, offs_n, offs_d, head_dim, rows, scale, batch, head,
                              masking, HAS_DENSE, HAS_ADDITIVE, ACC)
            v_tile = load_tile(v_base, offs_n, offs_dv, lk, value_dim, sv_n, sv_d)
            limit += mma(posinf_mass(x, NORMALIZED).to(v_tile.dtype), v_tile, ACC)
        plain = tl.where((posinf_count > 0)[:, None], limit, plain)

    slots = (bh * splits + split) * group * lq + r
    live = r < group * lq
    ptrs = PART_STATS + slots * _PARTIAL_WIDTH
    tl.store(ptrs, top, mask=live)
    tl.store(ptrs + 1, total, mask=live)
    tl.store(ptrs + 2, bottom, mask=live)
    tl.store(ptrs + 3, posinf_count, mask=live)
    tl.store(ptrs + 4, nan_count, mask=live)
    sums = slots[:, None] * value_dim + offs_dv[None, :]
    tile = live[:, None] & (offs_dv < value_dim)[None, :]
    tl.store(PART_SHIFTED + sums, shifted, mask=tile)
    tl.store(PART_PLAIN + sums, plain, mask=tile)


@triton.jit
def _combine_kernel(
    PART_STATS, PART_SHIFTED, PART_PLAIN, OUT, rows, splits, value_dim,
    NORMALIZED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr, ACC: tl.constexpr,
):
    """One row block of a key/value head: merge its splits' partials into ``out`` (one read of each)."""
    bh = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    live = r < rows
    tile = live[:, None] & (offs_dv < value_dim)[None, :]
    top = tl.full((BLOCK_M,), float("-inf"), ACC)
    bottom = tl.full((BLOCK_M,), float("inf"), ACC)
    total = tl.zeros((BLOCK_M,), ACC)
    posinf_count = tl.zeros((BLOCK_M,), ACC)
    nan_count = tl.zeros((BLOCK_M,), ACC)
    shifted = tl.zeros((BLOCK_M, BLOCK_DV), ACC)
    plain = tl.zeros((BLOCK_M, BLOCK_DV), ACC)
    limit = tl.zeros((BLOCK_M, BLOCK_DV), ACC)
    for split in range(splits):
        slots = (bh * splits + split) * rows + r
        ptrs = PART_STATS + slots * _PARTIAL_WIDTH
        split_top = tl.load(ptrs, mask=live, other=float("-inf"))
        split_posinf = tl.load(ptrs + 3, mask=live, other=0.0)
        bottom = tl.minimum(bottom, tl.load(ptrs + 2, mask=live, other=float("inf")))
        posinf_count += split_posinf
        nan_count += tl.load(ptrs + 4, mask=live, other=0.0)
        sums = slots[:, None] * value_dim + offs_dv[None, :]
        split_plain = tl.load(PART_PLAIN + sums, mask=tile, other=0.0)
        limit += tl.where((split_posinf > 0)[:, None], split_plain, 0.0)
        top, total, shifted, plain = _merge(
            top, total, shifted, plain, split_top, tl.load(ptrs + 1, mask=live, other=0.0),
            tl.load(PART_SHIFTED + sums, mask=tile, other=0.0), split_plain,
        )
    out, _, _, _, _ = finish(top, top, total, bottom, shifted, plain, NORMALIZED)
    out = tl.where((posinf_count > 0)[:, None], limit / tl.maximum(posinf_count, 1.0)[:, None], out)
    out = tl.where((nan_count > 0)[:, None], float("nan"), out)
    out_rows = bh * rows + r
    tl.store(OUT + out_rows[:, None] * value_dim + offs_dv[None, :], out.to(OUT.dtype.element_ty), mask=tile)


@triton.jit
def _scores_kernel(
    Q, K, OUT, sq_b, sq_h, sq_m, sq_d, sk_b, sk_h, sk_n, sk_d, heads, group, lq, lk, head_dim, scale: tl.float64,
    chunk, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, ACC: tl.constexpr,
):
    """Scores ``scale q k^T`` in ``ACC`` of a row block of stacked rows against keys ``[c chunk, (c + 1) chunk)``.

    The stacked query tile is loaded once; each key block is read once in its own dtype and
    multiplied into ``ACC`` (no float32 copy of K); the scores go to ``OUT[b, head, query, key]``.
    """
    scale = as_acc(scale, ACC)
    bh = tl.program_id(1).to(tl.int64)
    kv_heads = heads // group
    batch, kv_head = bh // kv_heads, bh % kv_heads
    r, head, query = _stacked_rows(kv_head, group, lq, tl.program_id(2), BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_tile = load_tile(Q + batch * sq_b + head[:, None] * sq_h, query, offs_d, lq, head_dim, sq_m, sq_d)
    k_base = K + batch * sk_b + kv_head * sk_h
    out_rows = OUT + ((batch * heads + head) * lq + query).to(tl.int64) * lk
    live = (query < lq)[:, None]
    first = tl.program_id(0) * chunk
    for start in range(first, tl.minimum(first + chunk, lk), BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        x = mma(q_tile, load_tile(k_base, offs_d, offs_n, head_dim, lk, sk_d, sk_n), ACC) * scale
        tl.store(out_rows[:, None] + offs_n[None, :], x, mask=live & (offs_n < lk)[None, :])


# ---- host functions --------------------------------------------------------------------------


@replay.replayable
def self_adjusted_decoding_forward(
    q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask, scale: float, normalized: bool, splits: int = 0
) -> Tensor:
    """Self-Adjusted Softmax attention ``out = (phi(x) softmax(x)) v`` by key splits, forward only.

    Two launches: the split kernel (grid ``(S, B x Hkv, row blocks)``, one pass over K and V
    per row block) and the combine kernel (grid ``(B x Hkv, row blocks)``); a row block holds
    up to :data:`MAX_STACKED_ROWS` stacked rows (one block while ``(Hq / Hkv) Lq <= 128``).

    Args:
        q: ``(B, Hq, Lq, D)``; k: ``(B, Hkv, Lk, D)``; v: ``(B, Hkv, Lk, Dv)``; ``Hq % Hkv == 0``, one
            float dtype.
        mask: which keys each query row may attend.
        scale: the score scale.
        normalized: ``phi(x) = (x - low) / (high - low)`` instead of ``x``.
        splits: key splits ``S``; 0 chooses :func:`split_count`.  Rounded so every split
            holds whole key blocks and at least one key.

    Returns:
        ``out`` ``(B, Hq, Lq, Dv)`` in q's dtype: zero rows where no key is allowed, NaN rows where
        a score is NaN.

    Raises:
        ValueError: shapes :func:`.attention_launch.problem` rejects, or ``splits < 0``.
    """
    shape = problem(q, k, v)
    if splits < 0:
        raise ValueError(f"splits must be >= 0 (0: automatic), got {splits}")
    out = launch.empty((shape.batch, shape.heads, shape.lq, shape.value_dim), q.dtype, q.device)
    if out.numel() == 0:
        return out
    rows = shape.group * shape.lq
    block_m = min(MAX_STACKED_ROWS, max(16, launch.next_power_of_2(rows)))
    programs, row_blocks = shape.batch * shape.kv_heads, launch.cdiv(rows, block_m)
    blocks = max(1, launch.cdiv(shape.lk, shape.block))
    splits = min(splits or split_count(shape.lk, programs * row_blocks, shape.block, q.device), blocks)
    split_blocks = launch.cdiv(blocks, splits)
    splits = launch.cdiv(blocks, split_blocks)  # no split left without keys
    acc = rules.accumulation_dtype(q.dtype)
    part_stats = launch.empty((programs, splits, rows, PARTIAL_STATS), acc, q.device)
    part_shifted = launch.empty((programs, splits, rows, shape.value_dim), acc, q.device)
    part_plain = launch.empty((programs, splits, rows, shape.value_dim), acc, q.device)
    q, k, v = dot_operands(q, k, v)
    constants = dict(NORMALIZED=bool(normalized), BLOCK_M=block_m, BLOCK_DV=head_width(shape.value_dim), ACC=shape.acc)
    launch.launchable(_split_kernel)[(splits, programs, row_blocks)](
        q, k, v, part_stats, part_shifted, part_plain, *q.stride(), *k.stride(), *v.stride(),
        *shape.sizes, float(scale), split_blocks * shape.block, splits,
        **mask_arguments(mask, shape.score_shape, q.device),
        BLOCK_N=shape.block, BLOCK_D=head_width(shape.head_dim), **constants, **launch_options(shape, q),
    )
    launch.launchable(_combine_kernel)[(programs, row_blocks)](
        part_stats, part_shifted, part_plain, out, rows, splits, shape.value_dim, **constants,
    )
    return out


@replay.replayable
def decoding_scores_forward(q: Tensor, k: Tensor, scale: float) -> Tensor:
    """Scores ``scale q k^T`` ``(B, Hq, Lq, Lk)`` in the accumulation dtype, K read once in its own dtype.

    The first step of the scores-as-rows decoding route (:data:`attnorm.routes.decoding.DECODING_ROUTES`)
    for half-precision inputs: their scores are wanted in float32 (the fused kernels' precision),
    and ``torch.matmul`` of float32 copies would first write and then read a float32 copy of K
    (``6 D`` bytes per key more than reading K's ``2 D``; 384 at ``D = 64``).  Here each key is
    read once, ``2 D`` bytes, and each score written once, 4 bytes per stacked row.  One program
    per (:data:`SCORE_BLOCKS_PER_PROGRAM` key blocks, batch x key/value head, row block of up to
    :data:`MAX_STACKED_ROWS` stacked GQA rows): K is read once per key/value head, never per
    query head.  No mask: the row kernels apply it.

    Args:
        q: ``(B, Hq, Lq, D)``; k: ``(B, Hkv, Lk, D)``, ``Hq % Hkv == 0``, q's dtype.
        scale: the score scale (rounded to the accumulation dtype, as ``scores * scale`` rounds it).

    Raises:
        ValueError: shapes :func:`.attention_launch.problem` rejects.
    """
    shape = problem(q, k, k)
    out = launch.empty(shape.score_shape, rules.accumulation_dtype(q.dtype), q.device)
    if out.numel() == 0:
        return out
    rows = shape.group * shape.lq
    block_m = min(MAX_STACKED_ROWS, max(16, launch.next_power_of_2(rows)))
    chunk = SCORE_BLOCKS_PER_PROGRAM * shape.block
    grid = (launch.cdiv(shape.lk, chunk), shape.batch * shape.kv_heads, launch.cdiv(rows, block_m))
    q, k = dot_operands(q, k)
    options = {"num_warps": 4, "num_stages": 3 if q.device.type == "cuda" else 1}
    launch.launchable(_scores_kernel)[grid](
        q, k, out, *q.stride(), *k.stride(), shape.heads, shape.group, shape.lq, shape.lk, shape.head_dim,
        float(scale), chunk, BLOCK_M=block_m, BLOCK_N=shape.block, BLOCK_D=head_width(shape.head_dim), ACC=shape.acc,
        **options,
    )
    return out


@replay.replayable
def decoding_weights_forward(q: Tensor, k: Tensor, scale: float, kernel: str,
                             params: tuple[tuple[str, Any], ...], mask: RowMask = NO_MASK,
                             softcap: float | None = None, sinks: Tensor | None = None) -> Tensor:
    """Weights ``(B, Hq, Lq, Lk)`` of the rows route in one call, in ``q``'s dtype:
    :func:`decoding_scores_forward`, then the row kernel of ``kernel`` over the float32 scores
    (:func:`attnorm.kernels.ops.weights`), which rounds the weights it stores to ``q``'s dtype.

    The same two launches, in the same order, as the scores op followed by the normalizer
    module and ``.to(q.dtype)``, so the weights are bit for bit the same (the kernel rounds
    to nearest even on CUDA, as ``Tensor.to``; Triton's interpreter truncates to bfloat16, so
    there torch casts) without the cast's launch and float32 weights.  As
    one replayable function, an eager decoding step keys and replays both launches at once
    (:mod:`.replay`: one key, the scores and weights allocated, two direct launches) instead
    of passing through the scores op, the module, its rules and the row op's entry point
    with a key of its own.
    ``params``: the normalizer's ``kernel_params()`` as ``(name, number)`` pairs (numbers
    only: a learnable parameter takes the module's route); ``mask``: the row kernel's mask
    (a padded batch's bool mask, read in place); ``softcap``: the row kernel's cap; ``sinks``:
    a sink per query head ``(Hq,)`` (read in place, every batch and query of a head reading its
    value: :func:`.launch.sink_scores`).  Forward only: :func:`attnorm.routes.decoding.row_weights`
    says when a call qualifies.
    """
    scores = decoding_scores_forward(q, k, scale)
    rounded = q.is_cuda or q.dtype != torch.bfloat16  # Triton's interpreter truncates to bfloat16: torch rounds there
    sink = None if sinks is None else sinks.reshape(1, -1, 1, 1)  # (1, Hq, 1, 1): a view, per head
    weights = ops.weights(ops.functions("triton"), kernel, scores, mask, dict(params), sink=sink, softcap=softcap,
                          out_dtype=q.dtype if rounded else None)
    return weights if rounded else weights.to(q.dtype)


@triton.jit
def _ssmax_queries_kernel(
    Q, MASK, S, BIAS, OUT, ATTENDS, sq_b, sq_h, sq_m, sq_d, sm_b, sm_h, sm_m, sm_n, ss_b, ss_h, ss_m,
    sb_b, sb_h, sb_m, heads, lq, lk, head_dim, s_value: tl.float64, bias_value: tl.float64,
    HAS_MASK: tl.constexpr, S_TENSOR: tl.constexpr, BIAS_TENSOR: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, ACC: tl.constexpr,
):
    """Query row ``(b, h, i)`` (program ``(b H + h) Lq + i``): ``n`` = its allowed keys, ``c = s log max(n, 1) + bias``,
    ``OUT = c q`` rounded to q's dtype, ``ATTENDS = n > 0``.

    The mask row is read through its own strides (0 where it broadcasts), one byte a key,
    ``BLOCK_N`` keys a step; ``s`` and ``bias`` are numbers or read where they lie.
    """
    row = tl.program_id(0)
    query = (row % lq).to(tl.int64)
    head = ((row // lq) % heads).to(tl.int64)
    batch = (row // (lq * heads)).to(tl.int64)
    if HAS_MASK:
        base = MASK + batch * sm_b + head * sm_h + query * sm_m
        counts = tl.zeros([BLOCK_N], dtype=tl.int32)
        for start in range(0, lk, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            allowed = tl.load(base + offs_n.to(tl.int64) * sm_n, mask=offs_n < lk, other=0)
            counts += (allowed != 0).to(tl.int32)
        n = tl.sum(counts, axis=0)
    else:
        n = lk
    if S_TENSOR:
        s = tl.load(S + batch * ss_b + head * ss_h + query * ss_m).to(ACC)
    else:
        s = as_acc(s_value, ACC)
    if BIAS_TENSOR:
        bias = tl.load(BIAS + batch * sb_b + head * sb_h + query * sb_m).to(ACC)
    else:
        bias = as_acc(bias_value, ACC)
    c = s * tl.log(tl.maximum(n, 1).to(ACC)) + bias
    offs_d = tl.arange(0, BLOCK_D)
    inside = offs_d < head_dim
    x = tl.load(Q + batch * sq_b + head * sq_h + query * sq_m + offs_d * sq_d, mask=inside, other=0.0)
    tl.store(OUT + row.to(tl.int64) * head_dim + offs_d, (x.to(ACC) * c).to(OUT.dtype.element_ty), mask=inside)
    tl.store(ATTENDS + row, n > 0)


SSMAX_MASK_BLOCK = 1024
"""Mask bytes a step of :func:`ssmax_queries_forward`'s count loop reads (at most; fewer for short rows)."""


def _head_strides(value: float | Tensor, shape: tuple[int, int, int, int], device: torch.device
                  ) -> tuple[Tensor | None, int, int, int, float]:
    """A Scalable-Softmax parameter as ``(tensor or None, batch, head, query strides, number)``, read in place."""
    if not isinstance(value, Tensor):
        return None, 0, 0, 0, float(value)
    view = value.detach()
    if view.device != device:
        view = view.to(device)
    view = view.expand(*shape[:3], 1)
    return view, *view.stride()[:3], 0.0


@replay.replayable
def ssmax_queries_forward(q: Tensor, mask: Tensor | None, s: float | Tensor, bias: float | Tensor, lk: int = -1
                          ) -> tuple[Tensor, Tensor]:
    """Scalable-Softmax's scaled queries for one SDPA call under a bool mask, in one launch.

    ``softmax(c x)`` with ``c = s log n + bias`` per query row is SDPA on ``c q`` (the route of
    :mod:`attnorm.routes.sdpa`); under a bool mask ``n`` counts the row's allowed keys.  Done
    with torch ops that was a count (``sum``), a cast, ``clamp``, ``log``, a product and a sum
    for ``c``, an ``any`` for the rows that attend at all and the product ``c q``: six to eight
    launches of a few hundred bytes each per step, where a padded batch's decoding step
    (Hugging Face's ``(B, 1, 1, Lk)`` mask) spends its time issuing them (ScalableSoftmax 3.36x
    SDPA at KV 4k on an H200, its SDPA call alone 1x).  Here one program per query row reads
    the row's mask (``Lk`` bytes; a mask broadcast over heads is read from cache after its
    first head), computes ``c`` in the accumulation dtype, writes ``c q`` rounded to q's dtype
    (as ``torch.mul(q, c, out=...)`` rounds it: float32 product, one rounding) and whether
    the row attends any key.  ``s``/``bias``: numbers or tensors broadcastable to
    ``(B, H, Lq, 1)`` (per head ``(H, 1, 1)``), read where they lie in their own dtype.

    Args:
        q: ``(B, H, Lq, D)``.
        mask: bool ``(..., Lk)``, broadcastable to ``(B, H, Lq, Lk)`` (True = may attend); its last dim is
            the keys' count (a mask broadcast over the keys is expanded first).  None: every one of ``lk``
            keys allowed (a learnable Scalable-Softmax step without a mask: ``c`` and ``c q`` in one launch
            where ``bias + s log n`` and the product were two).
        lk: the keys' count without a mask (read from the mask otherwise).

    Returns:
        ``(c q, attends)``: ``(B, H, Lq, D)`` in q's dtype (contiguous) and bool ``(B, H, Lq, 1)``.
    """
    batch, heads, lq, head_dim = q.shape
    lk = mask.shape[-1] if mask is not None else lk
    if lk < 0:
        raise ValueError("lk (the keys' count) is needed without a mask")
    out = launch.empty((batch, heads, lq, head_dim), q.dtype, q.device)
    attends = launch.empty((batch, heads, lq, 1), torch.bool, q.device)
    if attends.numel() == 0:
        return out, attends
    shape = (batch, heads, lq, lk)
    allowed = mask.expand(shape) if mask is not None else None
    mask_strides = allowed.stride() if allowed is not None else (0, 0, 0, 0)
    s_arg, *s_strides, s_value = _head_strides(s, shape, q.device)
    bias_arg, *bias_strides, bias_value = _head_strides(bias, shape, q.device)
    launch.launchable(_ssmax_queries_kernel)[(batch * heads * lq,)](
        q, allowed, s_arg, bias_arg, out, attends, *q.stride(), *mask_strides, *s_strides, *bias_strides,
        heads, lq, lk, head_dim, s_value, bias_value, HAS_MASK=allowed is not None, S_TENSOR=s_arg is not None,
        BIAS_TENSOR=bias_arg is not None,
        BLOCK_N=min(SSMAX_MASK_BLOCK, max(16, launch.next_power_of_2(lk))) if allowed is not None else 16,
        BLOCK_D=max(16, launch.next_power_of_2(head_dim)), ACC=launch.compute_dtype(q), num_warps=4,
    )
    return out, attends
