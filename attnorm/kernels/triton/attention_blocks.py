"""What every fused attention kernel shares on the device: mask arguments, key-block bounds, tiles.

A fused kernel runs one program per (query block, batch x head).  It never builds
the ``(Lq, Lk)`` score matrix: each tile ``S = scale * Q_blk K_blk^T (+ additive)`` is
recomputed from ``q`` and ``k`` where it is needed, in float32 (float64 for float64
inputs).  The mask is an :class:`attnorm.kernels.rules.AttentionMask`:

* an **interval** ``[key_start[b, i], key_stop[b, i])`` per query row (causal in either
  alignment, sliding window, key padding, documents).  :func:`key_block_bounds` turns a
  query block's intervals into the key range ``[lo, hi)`` the block must visit, so
  key blocks no row of the block may attend are never loaded;
* an optional **dense** bool mask and an optional **additive** float mask, each read
  through four strides (``(B, Hq, Lq, Lk)``, stride 0 along broadcast dims).

Two score modifiers (:func:`modifier_arguments`) are shared too:

* **softcap** (constexpr ``SOFTCAP``): ``S = cap tanh(scale Q K^T / cap) (+ additive)``,
  the cap before the additive mask (Gemma 2).  ``tanh`` is the row kernels'
  :func:`.blocks.capping_tanh`: one ``exp`` of ``-2|x|`` (:func:`.blocks.stable_tanh`: no
  overflow, ±1 at ±inf, NaN stays NaN; libdevice is not available under the interpreter),
  and below ``|x| = 1/16``, where ``1 - exp(-2|x|)`` cancels (an error of ``cap eps``, all of
  a float64 score of 1e-10), its odd series: one exp, one division and ~8 multiply-adds
  per score more;
  :func:`score_tile_slope` also returns the cap's derivative ``1 - tanh^2`` for the
  backward kernels (``dS_raw = dS (1 - tanh^2)``);
* **sinks** (constexpr ``HAS_SINK``): a per-row sink logit ``(B, Hq, Lq)``, read through
  three strides (a per-head sink expands with stride 0), by :func:`row_values`: a
  virtual key of value zero, always allowed, never capped nor masked.  Each kernel
  adds it to its normaliser as a ``(BLOCK_M, 1)`` column, so per query block it costs
  one load of ``BLOCK_M`` numbers, no pass over K or V.

:func:`mask_arguments` packs the masks into the launch arguments every kernel takes in
the same order; :func:`score_tile` computes one tile with masked entries at -inf and
:func:`key_scores` the tile of a key block given by its base pointer and strides;
:func:`load_tile` loads any zero-padded block of a ``(rows, cols)`` matrix (query,
key, value or output-gradient rows, or their transposed view).  The host side
(block size, shapes, operands) is :mod:`.attention_launch`.

**Products.**  Every product is :func:`mma`, ``tl.dot`` with ``input_precision=DOT_PRECISION`` (``"ieee"``):
float32 operands are multiplied in full float32 (FMA units), as PyTorch's own float32
matmuls and SDPA are unless TF32 is switched on; Triton's default, TF32 (10-bit
mantissas), put errors of ~1e-3 into float32 attention on an H100 (measured, 2026-11-26:
scores off by up to 7e-3, outputs up to 2.5e-2).  bfloat16 and float16 operands still use
the tensor cores (wgmma) and float64 the float64 MMA: the precision applies to float32
operands only.  The score scale travels as a float64 kernel argument
(``scale: tl.float64``, then :func:`as_acc`): a Python float argument is float32 in a
Triton signature, which rounded float64 attention's scale to float32 precision.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from attnorm.kernels.rules import AttentionMask
from attnorm.kernels.triton import launch
from attnorm.kernels.triton.blocks import capping_tanh, stable_tanh

__all__ = [
    "DOT_PRECISION",
    "as_acc",
    "inner_key_blocks",
    "key_block_bounds",
    "key_program",
    "key_scores",
    "key_scores_slope",
    "load_tile",
    "mask_arguments",
    "masked_block_start",
    "mma",
    "modifier_arguments",
    "query_program",
    "row_arguments",
    "row_values",
    "score_tile",
    "score_tile_slope",
    "sink_scores",
    "stable_tanh",
]


DOT_PRECISION = tl.constexpr("ieee")
"""``tl.dot``'s ``input_precision`` in every fused kernel: float32 operands at full precision, not TF32."""


@triton.jit
def mma(a, b, ACC: tl.constexpr):
    """``a @ b`` accumulated in ``ACC``: ``tl.dot`` at :data:`DOT_PRECISION` (the only product the kernels use)."""
    return tl.dot(a, b, out_dtype=ACC, input_precision=DOT_PRECISION)


@triton.jit
def rounded_mma(a, b, ACC: tl.constexpr):
    """``a @ b`` with ``a`` (in the accumulation dtype) rounded to ``b``'s dtype for the product.

    In float16 each row of ``a`` is first scaled by a power of two that puts its largest
    magnitude in (2^13, 2^14], and that row of the product scaled back (both exact): score
    gradients carry factors such as 1 / T, 1 / span or a logit multiplier, and rounded as
    they are they overflowed float16 (65504: inf, then NaN, where the exact gradient fits),
    and the Self-Adjusted forward's ``e x`` at a tiny spread sank into its subnormals.  Cost:
    a row max and a multiply of ``a`` and of the product, in float16 only; bfloat16 has
    float32's range and is rounded as is.
    """
    if b.dtype == tl.float16:
        top = tl.max(tl.abs(a), 1)
        exponent = tl.where(top > 0, tl.maximum(tl.ceil(tl.log2(tl.where(top > 0, top, 1.0))) - 14.0, -126.0), 0.0)
        return mma((a * tl.exp2(-exponent)[:, None]).to(tl.float16), b, ACC) * tl.exp2(exponent)[:, None]
    return mma(a.to(b.dtype), b, ACC)


@triton.jit
def as_acc(value, ACC: tl.constexpr):
    """A float64 scalar argument (``name: tl.float64``) in the accumulation dtype.

    Compiled, the argument is a float64 scalar, rounded here once (to nearest, as the launcher
    rounded a float32 argument before); under the interpreter it is a Python float, exact.
    """
    return tl.full((), value, ACC)


def _strides(t: Tensor | None, shape: tuple[int, int, int, int]) -> tuple[Any, int, int, int, int]:
    if t is None:
        return None, 0, 0, 0, 0
    while t.ndim < 4:
        t = t.unsqueeze(0)
    t = t.expand(shape)
    return (t, *t.stride())


def mask_arguments(mask: AttentionMask, shape: tuple[int, int, int, int], device: torch.device) -> dict[str, Any]:
    """Launch arguments for ``mask`` over scores of ``shape`` ``(B, Hq, Lq, Lk)``.

    Returns keyword arguments: the interval pointers and their batch stride, the dense
    and additive pointers with four strides each, and the three ``HAS_*`` constants.
    Absent parts pass a dummy pointer (never read: their ``HAS_*`` constant is False), a
    kept one-element tensor (:func:`.launch.constant`: no allocation per call).
    """
    dummy = launch.constant(0.0, torch.int32, torch.device(device))
    has_range = mask.key_start is not None
    start = mask.key_start if has_range else dummy
    stop = mask.key_stop if has_range else dummy
    range_stride = start.stride(0) if has_range and start.shape[0] > 1 else 0
    dense, db, dh, dm, dn = _strides(mask.dense, shape)
    additive, ab, ah, am, an = _strides(mask.additive, shape)
    return dict(
        key_start=start, key_stop=stop, range_stride=range_stride,
        dense=dummy if dense is None else dense.view(torch.uint8) if dense.dtype == torch.bool else dense,
        dense_sb=db, dense_sh=dh, dense_sm=dm, dense_sn=dn,
        additive=dummy if additive is None else additive, add_sb=ab, add_sh=ah, add_sm=am, add_sn=an,
        HAS_RANGE=has_range, HAS_DENSE=dense is not None, HAS_ADDITIVE=additive is not None,
    )


@triton.jit
def query_program(bh, heads, group, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Where program ``(query block, bh)`` of a query-block grid works.

    Returns ``(batch, head, kv_head, offs_m, offs_d, offs_dv)``: ``bh`` split into batch and
    query head, the key/value head of its GQA group, the block's query rows and the
    padded head-dim and value-dim columns.
    """
    batch, head = bh // heads, bh % heads
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    return batch, head, head // group, offs_m, tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)


@triton.jit
def key_program(bh, heads, group, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Where program ``(key block, bh)`` of a key-block grid works (``bh``: batch x key/value head).

    Returns ``(batch, kv_head, start, offs_n, offs_d, offs_dv)``: the block's first key and
    its keys, and the padded head-dim and value-dim columns.
    """
    kv_heads = heads // group
    start = tl.program_id(0) * BLOCK_N
    offs_n = start + tl.arange(0, BLOCK_N)
    return bh // kv_heads, bh % kv_heads, start, offs_n, tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)


@triton.jit
def key_block_bounds(key_start, key_stop, range_stride, batch, offs_m, lq, lk, HAS_RANGE: tl.constexpr):
    """The intervals of the query rows ``offs_m`` and the key range ``[lo, hi)`` they reach together.

    Returns ``(row_start, row_stop, lo, hi)``: per-row vectors (rows past ``lq`` get the
    empty interval) and two scalars; ``hi <= lo`` when no row attends any key.
    """
    if HAS_RANGE:
        rows = offs_m < lq
        row_start = tl.load(key_start + batch * range_stride + offs_m, mask=rows, other=lk)
        row_stop = tl.load(key_stop + batch * range_stride + offs_m, mask=rows, other=0)
        lo = tl.min(tl.where(row_stop > row_start, row_start, lk), 0)
        hi = tl.max(tl.where(row_stop > row_start, row_stop, 0), 0)
    else:
        row_start = tl.zeros(offs_m.shape, dtype=tl.int32)
        row_stop = tl.where(offs_m < lq, lk, 0).to(tl.int32)
        lo = 0
        hi = tl.where(lq > 0, lk, 0)
    return row_start, row_stop, lo, hi


def row_arguments(name: str, values: Tensor | None, shape: tuple[int, int, int], dtype: torch.dtype,
                  device: torch.device) -> dict[str, Any]:
    """Launch arguments for per-row values broadcastable to ``shape`` ``(B, Hq, Lq)``.

    Returns ``{name}`` (``values`` in ``dtype``, or a dummy pointer), its batch, head and
    row strides ``{name}_sb, {name}_sh, {name}_sm`` (0 along broadcast dims) and the
    constant ``HAS_{NAME}``.
    """
    if values is None:
        pointer, strides = launch.constant(0.0, dtype, torch.device(device)), (0, 0, 0)  # kept, never read
    else:
        values = values.detach().to(device=device, dtype=dtype)
        while values.ndim < 3:
            values = values.unsqueeze(0)
        pointer = values.expand(shape)
        strides = pointer.stride()
    return {name: pointer, f"{name}_sb": strides[0], f"{name}_sh": strides[1], f"{name}_sm": strides[2],
            f"HAS_{name.upper()}": values is not None}


def modifier_arguments(softcap: float | None, sinks: Tensor | None, shape: tuple[int, int, int, int],
                       dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
    """Launch arguments for the score modifiers over scores of ``shape`` ``(B, Hq, Lq, Lk)``.

    ``softcap_ptr``, the cap (a number > 0, or None: 1 and ``SOFTCAP`` False) as one element
    in the accumulation ``dtype`` (a python float argument would be float32 on the GPU);
    ``sinks``, the sink logit of each query row, broadcastable to ``(B, Hq, Lq)`` (``(Hq, 1)``
    for one per head), as :func:`row_arguments` ``"sink"``.
    """
    cap = launch.constant(1.0 if softcap is None else float(softcap), dtype, device)
    return dict(softcap_ptr=cap, SOFTCAP=softcap is not None, **row_arguments("sink", sinks, shape[:3], dtype, device))


@triton.jit
def row_values(values, s_b, s_h, s_m, batch, head, offs_m, lq, other, ACC: tl.constexpr):
    """Per-row values of rows ``offs_m`` (:func:`row_arguments`) in ``ACC``; ``other`` past ``lq``."""
    ptrs = values + batch * s_b + head * s_h + offs_m * s_m
    return tl.load(ptrs, mask=offs_m < lq, other=other).to(ACC)


@triton.jit
def sink_scores(sink, sink_sb, sink_sh, sink_sm, batch, head, offs_m, lq, HAS_SINK: tl.constexpr,
                BLOCK_M: tl.constexpr, ACC: tl.constexpr):
    """Each row's sink score in ``ACC``; -inf (no key) without sinks and past ``lq``."""
    if HAS_SINK:
        scores = row_values(sink, sink_sb, sink_sh, sink_sm, batch, head, offs_m, lq, float("-inf"), ACC)
    else:
        scores = tl.full((BLOCK_M,), float("-inf"), ACC)
    return scores


@triton.jit
def score_tile_slope(
    q_tile, k_ptrs, k_mask, offs_m, offs_n, row_start, row_stop, scale, softcap, batch, head,
    dense, dense_sb, dense_sh, dense_sm, dense_sn,
    additive, add_sb, add_sh, add_sm, add_sn,
    HAS_DENSE: tl.constexpr, HAS_ADDITIVE: tl.constexpr, SOFTCAP: tl.constexpr, ACC: tl.constexpr,
    MASKED: tl.constexpr = True,
):
    """:func:`score_tile` and the softcap's derivative ``1 - tanh^2(scale q k / cap)`` (0 where the score is -inf).

    Without ``SOFTCAP`` the derivative is 1 (callers multiply by it only under ``SOFTCAP``).
    ``MASKED`` False: a tile inside every row's interval (:func:`inner_key_blocks`), whose
    keys need no interval test (the dense and additive masks still apply).
    """
    k_tile = tl.load(k_ptrs, mask=k_mask, other=0.0)
    # The last product and the additive mask are one explicit fma: left to the compiler, ``p * c + a``
    # may be contracted in one kernel and rounded twice in another, and the backward's recomputed scores
    # must equal the forward's bit for bit (top-k's threshold, Self-Adjusted's min and max are compared
    # with ==).  Seen on an H200: dk 2.5 off with candidate-buffer top-k under an additive mask.
    product = mma(q_tile, k_tile, ACC)
    factor = scale
    if SOFTCAP:
        t = capping_tanh(product * scale / softcap)
        product, factor = t, softcap
    if MASKED:
        keep = (offs_n[None, :] >= row_start[:, None]) & (offs_n[None, :] < row_stop[:, None])
        if HAS_DENSE:
            dense_ptrs = dense + batch * dense_sb + head * dense_sh
            dense_ptrs += offs_m[:, None] * dense_sm + offs_n[None, :] * dense_sn
            keep = keep & (tl.load(dense_ptrs, mask=keep, other=0) != 0)
        if HAS_ADDITIVE:
            add_ptrs = additive + batch * add_sb + head * add_sh + offs_m[:, None] * add_sm + offs_n[None, :] * add_sn
            scores = tl.fma(product, factor, tl.load(add_ptrs, mask=keep, other=0.0).to(ACC))
        else:
            scores = product * factor
        scores = tl.where(keep, scores, float("-inf"))
    else:
        if HAS_ADDITIVE:
            add_ptrs = additive + batch * add_sb + head * add_sh + offs_m[:, None] * add_sm + offs_n[None, :] * add_sn
            scores = tl.fma(product, factor, tl.load(add_ptrs).to(ACC))
        else:
            scores = product * factor
        if HAS_DENSE:
            dense_ptrs = dense + batch * dense_sb + head * dense_sh
            dense_ptrs += offs_m[:, None] * dense_sm + offs_n[None, :] * dense_sn
            scores = tl.where(tl.load(dense_ptrs) != 0, scores, float("-inf"))
    if SOFTCAP:
        slope = tl.where(scores == float("-inf"), 0.0, 1.0 - t * t)
    else:
        slope = tl.full(scores.shape, 1.0, ACC)
    return scores, slope


@triton.jit
def score_tile(
    q_tile, k_ptrs, k_mask, offs_m, offs_n, row_start, row_stop, scale, softcap, batch, head,
    dense, dense_sb, dense_sh, dense_sm, dense_sn,
    additive, add_sb, add_sh, add_sm, add_sn,
    HAS_DENSE: tl.constexpr, HAS_ADDITIVE: tl.constexpr, SOFTCAP: tl.constexpr, ACC: tl.constexpr,
):
    """Scores of the query rows ``offs_m`` against keys ``offs_n``: ``(BLOCK_M, BLOCK_N)``, masked at -inf.

    ``q_tile`` is the query block ``(BLOCK_M, D)`` already loaded; ``k_ptrs`` point at
    the key block as ``(D, BLOCK_N)`` (the transposed view, so ``tl.dot`` needs no
    transpose), loaded where ``k_mask`` holds (0 elsewhere).  ``scale q k`` is capped to
    ``softcap tanh(. / softcap)`` under ``SOFTCAP``, then the additive mask is added.
    Keys outside a row's interval (which ends at ``lk`` at most, so keys past it are out),
    dense-masked keys and -inf scores are -inf; NaN scores stay NaN.
    """
    scores, _ = score_tile_slope(q_tile, k_ptrs, k_mask, offs_m, offs_n, row_start, row_stop, scale, softcap, batch,
                                 head, dense, dense_sb, dense_sh, dense_sm, dense_sn,
                                 additive, add_sb, add_sh, add_sm, add_sn, HAS_DENSE, HAS_ADDITIVE, SOFTCAP, ACC)
    return scores


@triton.jit
def key_scores_slope(q_tile, k_base, sk_n, sk_d, offs_m, offs_n, offs_d, head_dim, row_start, row_stop, lk, scale,
                     softcap, batch, head, masking, HAS_DENSE: tl.constexpr, HAS_ADDITIVE: tl.constexpr,
                     SOFTCAP: tl.constexpr, ACC: tl.constexpr, MASKED: tl.constexpr = True):
    """:func:`score_tile_slope` for keys at ``k_base``; ``masking`` packs the dense and additive arguments.

    Columns past the head dim and keys past ``lk`` load as 0 (a mask, not clamped
    pointers: a clamped column index hides the key rows' contiguity from Triton's
    alignment analysis, which then loads a bfloat16 tile 2 bytes at a time with no
    ``cp.async`` pipelining; measured in the sm_90 PTX of the entmax forward: 48 scalar
    ``ld.global.b16`` per thread before, 16-byte vector loads after).  ``MASKED`` False
    (an inner tile, every key below ``lk``): no key test at all.
    """
    k_ptrs = k_base + offs_n[None, :] * sk_n + offs_d[:, None] * sk_d
    if MASKED:
        k_mask = (offs_d < head_dim)[:, None] & (offs_n < lk)[None, :]
    else:
        k_mask = (offs_d < head_dim)[:, None]  # broadcast over the keys
    dense, dense_sb, dense_sh, dense_sm, dense_sn, additive, add_sb, add_sh, add_sm, add_sn = masking
    return score_tile_slope(q_tile, k_ptrs, k_mask, offs_m, offs_n, row_start, row_stop, scale, softcap, batch,
                            head, dense, dense_sb, dense_sh, dense_sm, dense_sn,
                            additive, add_sb, add_sh, add_sm, add_sn, HAS_DENSE, HAS_ADDITIVE, SOFTCAP, ACC, MASKED)


@triton.jit
def key_scores(q_tile, k_base, sk_n, sk_d, offs_m, offs_n, offs_d, head_dim, row_start, row_stop, lk, scale, softcap,
               batch, head, masking, HAS_DENSE: tl.constexpr, HAS_ADDITIVE: tl.constexpr, SOFTCAP: tl.constexpr,
               ACC: tl.constexpr, MASKED: tl.constexpr = True):
    """:func:`score_tile` for keys at ``k_base`` (:func:`key_scores_slope` without the slope)."""
    scores, _ = key_scores_slope(q_tile, k_base, sk_n, sk_d, offs_m, offs_n, offs_d, head_dim, row_start, row_stop,
                                 lk, scale, softcap, batch, head, masking, HAS_DENSE, HAS_ADDITIVE, SOFTCAP, ACC,
                                 MASKED)
    return scores


RANGE_SCAN = 1024
"""Rows read at a time by :func:`query_block_range` (a kernel constexpr: ``SCAN``)."""


@triton.jit
def query_block_range(key_start, key_stop, range_stride, batch, start, lq, lk, HAS_RANGE: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SCAN: tl.constexpr):
    """The query blocks ``[first, last)`` that hold every row attending a key of ``[start, start + BLOCK_N)``.

    A key-block program (dk/dv) loops over exactly these, with no test per query block: a
    loop whose body holds no branch around its loads is one Triton's pipeliner prefetches
    (``cp.async`` over ``num_stages``), where a per-block ``if`` left every q and dO tile a
    synchronous load.  Blocks inside the range whose rows reach no key of the block (a
    document mask's gaps) give score tiles all -inf, whose weights and gradients are 0.
    With ``HAS_RANGE`` the rows' intervals are read ``SCAN`` at a time (``lq / SCAN`` loads
    of 2 x ``SCAN`` int32, once per program).
    """
    if HAS_RANGE:
        first = lq
        last = -1
        for chunk in range(0, lq, SCAN):
            offs = chunk + tl.arange(0, SCAN)
            rows = offs < lq
            row_start = tl.load(key_start + batch * range_stride + offs, mask=rows, other=lk)
            row_stop = tl.load(key_stop + batch * range_stride + offs, mask=rows, other=0)
            reach = (row_start < row_stop) & (row_start < start + BLOCK_N) & (row_stop > start)
            first = tl.minimum(first, tl.min(tl.where(reach, offs, lq), 0))
            last = tl.maximum(last, tl.max(tl.where(reach, offs, -1), 0))
        return first // BLOCK_M, (last + BLOCK_M) // BLOCK_M
    else:
        return 0, tl.where(lk > 0, tl.cdiv(lq, BLOCK_M), 0)


@triton.jit
def query_block_tiles(query_block, q_base, do_base, offs_d, offs_dv, head_dim, value_dim, sq_m, sq_d, so_m, so_d,
                      key_start, key_stop, range_stride, batch, lq, lk, HAS_RANGE: tl.constexpr,
                      BLOCK_M: tl.constexpr):
    """One trip of a dk/dv loop over :func:`query_block_range`: the block's rows, their intervals, q and dO tiles.

    Returns ``(offs_m, row_start, row_stop, q_tile, do_tile)``; the loads sit at the top of
    the loop body, outside any branch, where Triton's pipeliner prefetches them.
    """
    offs_m = query_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_start, row_stop, _, _ = key_block_bounds(key_start, key_stop, range_stride, batch, offs_m, lq, lk, HAS_RANGE)
    q_tile = load_tile(q_base, offs_m, offs_d, lq, head_dim, sq_m, sq_d)
    do_tile = load_tile(do_base, offs_m, offs_dv, lq, value_dim, so_m, so_d)
    return offs_m, row_start, row_stop, q_tile, do_tile


@triton.jit
def inner_key_blocks(row_start, row_stop, offs_m, lq, lk, first, hi, BLOCK_N: tl.constexpr):
    """Split a query block's key blocks ``[first, hi)`` into masked and inner ones (FlashAttention-2's causal split).

    Returns ``(inner_lo, inner_hi, masked)``: the key blocks of ``[inner_lo, inner_hi)`` lie
    inside every row's interval and below ``lk`` (scores need no interval test: ``MASKED``
    False), ``masked`` is the number of the other blocks, ``[first, inner_lo)`` then
    ``[inner_hi, hi)``, which :func:`masked_block_start` enumerates.  A block holding a row
    past ``lq`` (the last, partial query block) or a row with no key gets no inner block.
    ``first`` is a multiple of ``BLOCK_N``; so are ``inner_lo`` and ``inner_hi``.

    In a causal attention of ``L`` keys only the ``L / BLOCK_N`` diagonal tiles stay masked:
    the interval test cost ~4-6 of the 18-28 sm_90 instructions per score of the entmax
    passes (``scripts/sass_loops.py``, with and without it).
    """
    partial = tl.max((offs_m >= lq).to(tl.int32), 0) > 0
    inner_lo = tl.maximum((tl.max(row_start, 0) + BLOCK_N - 1) // BLOCK_N * BLOCK_N, first)
    inner_hi = tl.minimum(tl.minimum(tl.min(row_stop, 0), lk) // BLOCK_N * BLOCK_N, hi)
    empty = (inner_hi <= inner_lo) | partial
    end = tl.maximum(first + (hi - first + BLOCK_N - 1) // BLOCK_N * BLOCK_N, first)  # past the last key block
    inner_lo = tl.where(empty, end, inner_lo)
    inner_hi = tl.where(empty, end, inner_hi)
    masked = (inner_lo - first) // BLOCK_N + (hi - inner_hi + BLOCK_N - 1) // BLOCK_N
    return inner_lo, inner_hi, tl.maximum(masked, 0)


@triton.jit
def masked_block_start(i, first, inner_lo, inner_hi, BLOCK_N: tl.constexpr):
    """The first key of masked block ``i`` of :func:`inner_key_blocks` (below ``inner_lo``, then from ``inner_hi``)."""
    start = first + i * BLOCK_N
    return tl.where(start < inner_lo, start, start + (inner_hi - inner_lo))


@triton.jit
def load_tile(base, offs_r, offs_c, rows, cols, s_r, s_c):
    """The ``(len(offs_r), len(offs_c))`` block of a ``(rows, cols)`` matrix at ``base``, 0 outside it.

    Query rows: ``load_tile(q, offs_m, offs_d, lq, head_dim, sq_m, sq_d)``; key or value
    rows likewise with ``offs_n``; the transposed view ``(D, BLOCK_N)`` of keys:
    ``load_tile(k, offs_d, offs_n, head_dim, lk, sk_d, sk_n)``.
    """
    ptrs = base + offs_r[:, None] * s_r + offs_c[None, :] * s_c
    return tl.load(ptrs, mask=(offs_r < rows)[:, None] & (offs_c < cols)[None, :], other=0.0)
