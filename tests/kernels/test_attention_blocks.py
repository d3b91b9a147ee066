"""The fused attention kernels' shared pieces: mask arguments, key-block bounds and score tiles.

A small kernel writes every score tile (and each query block's key range) of a tiny
problem; the result must equal scores computed with torch and masked by the
materialised mask.  With softcap, the tiles and the cap's slope equal ``torch.tanh``'s.
"""

from __future__ import annotations

import math

import pytest
import torch

import attnorm
from attnorm.kernels.rules import AttentionMask, attention_allowed

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from attnorm.kernels.triton.attention_blocks import (  # noqa: E402
    key_block_bounds,
    mask_arguments,
    query_block_range,
    score_tile,
    score_tile_slope,
    stable_tanh,
)

BLOCK_M, BLOCK_N, D = 16, 16, 16


@triton.jit
def _tiles(q, k, out, bounds, lq, lk, heads, scale,
           key_start, key_stop, range_stride,
           dense, dense_sb, dense_sh, dense_sm, dense_sn,
           additive, add_sb, add_sh, add_sm, add_sn,
           HAS_RANGE: tl.constexpr, HAS_DENSE: tl.constexpr, HAS_ADDITIVE: tl.constexpr,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr):
    block, bh = tl.program_id(0), tl.program_id(1)
    batch, head = bh // heads, bh % heads
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    row_start, row_stop, lo, hi = key_block_bounds(key_start, key_stop, range_stride, batch, offs_m, lq, lk, HAS_RANGE)
    tl.store(bounds + (bh * tl.num_programs(0) + block) * 2, lo)
    tl.store(bounds + (bh * tl.num_programs(0) + block) * 2 + 1, hi)
    q_tile = tl.load(q + bh * lq * D + offs_m[:, None] * D + offs_d[None, :], mask=(offs_m < lq)[:, None], other=0.0)
    for start in range(0, lk, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        k_ptrs = k + bh * lk * D + offs_n[None, :] * D + offs_d[:, None]
        k_mask = (offs_n < lk)[None, :]
        tile = score_tile(q_tile, k_ptrs, k_mask, offs_m, offs_n, row_start, row_stop, scale, 1.0, batch, head,
                          dense, dense_sb, dense_sh, dense_sm, dense_sn,
                          additive, add_sb, add_sh, add_sm, add_sn, HAS_DENSE, HAS_ADDITIVE, False, tl.float32)
        tl.store(out + bh * lq * lk + offs_m[:, None] * lk + offs_n[None, :], tile,
                 mask=(offs_m < lq)[:, None] & (offs_n < lk)[None, :])


MASKS = {
    "none": lambda b, lq, lk: (None, None),
    "causal": lambda b, lq, lk: (attnorm.causal_mask(), None),
    "bottom-right": lambda b, lq, lk: (attnorm.causal_mask(lk - lq), None),
    "window": lambda b, lq, lk: (attnorm.sliding_window_mask(5, lk - lq), None),
    "padding": lambda b, lq, lk: (attnorm.key_padding_mask(torch.tensor([lk, 7])[:b]), None),
    "documents": lambda b, lq, lk: (attnorm.document_mask(torch.tensor([0, 3, 20, 21])) & attnorm.causal_mask(), None),
    "dense": lambda b, lq, lk: (torch.rand(b, 1, lq, lk, generator=torch.Generator().manual_seed(0)) > 0.3, None),
    "additive": lambda b, lq, lk: (None, torch.where(torch.rand(lq, lk) > 0.3, torch.randn(lq, lk), -math.inf)),
}


@pytest.mark.parametrize("kind", list(MASKS))
def test_score_tiles_equal_masked_torch_scores(kind, device):
    batch, heads, lq, lk = 2, 2, 40 if kind != "bottom-right" and kind != "window" else 21, 40
    if kind == "documents":
        lq = lk = 40
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(batch, heads, lq, D, generator=gen).to(device)
    k = torch.randn(batch, heads, lk, D, generator=gen).to(device)
    structured, additive = MASKS[kind](batch, lq, lk)
    shape = (batch, heads, lq, lk)
    if isinstance(structured, attnorm.StructuredMask):
        start, stop = structured.key_range(batch, lq, lk, device)
        mask = AttentionMask(start, stop, None, None if additive is None else additive.to(device))
    else:
        mask = AttentionMask(None, None, None if structured is None else structured.to(device),
                             None if additive is None else additive.to(device))
    out = torch.full(shape, math.nan, device=device)
    blocks = triton.cdiv(lq, BLOCK_M)
    bounds = torch.full((batch * heads, blocks, 2), -7, dtype=torch.int32, device=device)
    _tiles[(blocks, batch * heads)](q, k, out, bounds, lq, lk, heads, 0.5, **mask_arguments(mask, shape, device),
                                   BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, D=D)

    expected = (q.double() @ k.double().transpose(-1, -2)) * 0.5
    if additive is not None:
        expected = expected + additive.to(device).double()
    keep = attention_allowed(mask, shape, device)
    if keep is not None:
        expected = expected.masked_fill(~keep, -math.inf)
    torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-4)
    # Every allowed key of a block's rows lies inside the block's key range.
    allowed = torch.ones(shape, dtype=torch.bool, device=device) if keep is None else keep.expand(shape)
    for block in range(blocks):
        rows = allowed[:, :, block * BLOCK_M : (block + 1) * BLOCK_M]
        lo, hi = bounds[:, block, 0].reshape(batch, heads), bounds[:, block, 1].reshape(batch, heads)
        for b in range(batch):
            for h in range(heads):
                keys = rows[b, h].any(0).nonzero()
                if len(keys):
                    assert lo[b, h] <= keys.min() and keys.max() < hi[b, h]
                else:
                    assert hi[b, h] <= lo[b, h] or kind in ("dense", "additive", "none")


def test_the_additive_mask_joins_the_scaled_product_in_one_rounding(device):
    """Scores under an additive mask are ``fma(q k, scale, additive)``, rounded once, in every kernel: a compiler
    left to contract ``p * scale + a`` may do so in one kernel and not in another, and a backward whose recomputed
    scores are an ulp off the forward's picks another top-k threshold (seen on an H200: dk 2.5 off).  With
    ``a = -round(p * scale)`` two roundings give 0 and one gives the rounding error of ``p * scale``."""
    batch, heads, lq, lk, scale = 1, 1, 16, 32, 0.1
    gen = torch.Generator().manual_seed(4)
    q = torch.randint(-3, 4, (batch, heads, lq, D), generator=gen).float()
    k = torch.randint(-3, 4, (batch, heads, lk, D), generator=gen).float()
    product = (q @ k.transpose(-1, -2))[0, 0]  # small integers: exact
    scale32 = torch.tensor(scale, dtype=torch.float32).double()
    additive = -(product.double() * scale32).float()  # minus the product rounded to float32
    expected = (product.double() * scale32 + additive.double()).float()  # exact in float64, then one rounding
    assert (expected != 0).sum() > lq * lk // 2  # the case is sharp: two roundings would give 0 here
    mask = AttentionMask(None, None, None, additive.to(device))
    out = torch.full((batch, heads, lq, lk), math.nan, device=device)
    bounds = torch.empty((1, 1, 2), dtype=torch.int32, device=device)
    _tiles[(1, 1)](q.to(device), k.to(device), out, bounds, lq, lk, heads, scale,
                   **mask_arguments(mask, (batch, heads, lq, lk), device), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, D=D)
    torch.testing.assert_close(out[0, 0].cpu(), expected, rtol=0, atol=0)


@triton.jit
def _query_ranges(out, key_start, key_stop, range_stride, lq, lk, HAS_RANGE: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, SCAN: tl.constexpr):
    key_block, batch = tl.program_id(0), tl.program_id(1)
    first, last = query_block_range(key_start, key_stop, range_stride, batch, key_block * BLOCK_N, lq, lk, HAS_RANGE,
                                    BLOCK_M, BLOCK_N, SCAN)
    tl.store(out + (batch * tl.num_programs(0) + key_block) * 2, first)
    tl.store(out + (batch * tl.num_programs(0) + key_block) * 2 + 1, last)


@pytest.mark.parametrize("monotone", [True, False], ids=["causal", "scattered"])
def test_query_block_range_spans_exactly_the_blocks_of_the_rows_reaching_a_key_block(monotone, device):
    """The dk/dv kernels' loop bounds: from the first to the last query block holding a row whose interval meets
    the key block, read in several scans (SCAN 32 < lq); none for a key block no row reaches."""
    batch, lq, lk, block_m, block_n = 2, 100, 90, 16, 16
    gen = torch.Generator().manual_seed(3)
    if monotone:  # causal, bottom-right aligned, and key padding of 60 in the second sequence
        start = torch.zeros(batch, lq, dtype=torch.int32)
        stop = (torch.arange(lq) - lq + lk + 1).clamp(0, lk).to(torch.int32).expand(batch, lq).clone()
        stop[1] = stop[1].clamp(max=60)
    else:  # arbitrary intervals, some empty
        start = torch.randint(0, lk, (batch, lq), generator=gen, dtype=torch.int32)
        stop = (start + torch.randint(-5, 12, (batch, lq), generator=gen, dtype=torch.int32)).clamp(0, lk)
    key_blocks = triton.cdiv(lk, block_n)
    out = torch.full((batch, key_blocks, 2), -7, dtype=torch.int32, device=device)
    start_d, stop_d = start.contiguous().to(device), stop.contiguous().to(device)
    _query_ranges[(key_blocks, batch)](out, start_d, stop_d, lq, lq, lk, HAS_RANGE=True, BLOCK_M=block_m,
                                       BLOCK_N=block_n, SCAN=32)
    for b in range(batch):
        for kb in range(key_blocks):
            reach = (start[b] < stop[b]) & (start[b] < (kb + 1) * block_n) & (stop[b] > kb * block_n)
            rows = reach.nonzero().flatten()
            first, last = out[b, kb].tolist()
            if len(rows):
                assert (first, last) == (rows.min().item() // block_m, rows.max().item() // block_m + 1), (b, kb)
            else:
                assert last <= first, (b, kb)
    _query_ranges[(key_blocks, batch)](out, start_d, stop_d, lq, lq, lk, HAS_RANGE=False, BLOCK_M=block_m,
                                       BLOCK_N=block_n, SCAN=32)
    assert (out[..., 0] == 0).all() and (out[..., 1] == triton.cdiv(lq, block_m)).all()


@triton.jit
def _capped_tiles(q, k, out, slope_out, lq, lk, scale, softcap, additive, add_sb, add_sh, add_sm, add_sn,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr):
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    rows = offs_m < lq
    row_start = tl.zeros((BLOCK_M,), tl.int32)
    row_stop = tl.where(rows, lk, 0).to(tl.int32)
    q_tile = tl.load(q + offs_m[:, None] * D + offs_d[None, :], mask=rows[:, None], other=0.0)
    for start in range(0, lk, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        k_ptrs = k + offs_n[None, :] * D + offs_d[:, None]
        k_mask = (offs_n < lk)[None, :]
        tile, slope = score_tile_slope(q_tile, k_ptrs, k_mask, offs_m, offs_n, row_start, row_stop, scale,
                                       softcap, 0, 0, additive, 0, 0, 0, 0, additive, add_sb, add_sh, add_sm, add_sn,
                                       False, True, True, tl.float32)
        ptrs = offs_m[:, None] * lk + offs_n[None, :]
        inside = rows[:, None] & (offs_n < lk)[None, :]
        tl.store(out + ptrs, tile, mask=inside)
        tl.store(slope_out + ptrs, slope, mask=inside)


def test_softcap_tiles_cap_before_the_additive_mask_and_give_the_caps_slope(device):
    lq, lk, cap = 13, 21, 1.5
    gen = torch.Generator().manual_seed(2)
    q = (torch.randn(lq, D, generator=gen) * 3).to(device)
    k = torch.randn(lk, D, generator=gen).to(device)
    additive = torch.where(torch.rand(lq, lk, generator=gen) > 0.3, torch.randn(lq, lk, generator=gen), -math.inf)
    additive = additive.to(device)
    out = torch.full((lq, lk), math.nan, device=device)
    slope = torch.full((lq, lk), math.nan, device=device)
    masking = mask_arguments(AttentionMask(additive=additive), (1, 1, lq, lk), device)
    _capped_tiles[(1,)](q, k, out, slope, lq, lk, 0.5, cap, masking["additive"], masking["add_sb"],
                        masking["add_sh"], masking["add_sm"], masking["add_sn"], BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, D=D)
    t = torch.tanh(0.5 * (q.double() @ k.double().T) / cap)
    allowed = additive != -math.inf
    torch.testing.assert_close(out.double(), (cap * t + additive.double()).masked_fill(~allowed, -math.inf),
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(slope.double(), torch.where(allowed, 1 - t * t, 0.0), atol=1e-5, rtol=1e-5)


@triton.jit
def _tanh(x, out, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(out + offs, stable_tanh(tl.load(x + offs, mask=offs < n)), mask=offs < n)


def test_stable_tanh_saturates_without_overflow(device):
    x = torch.tensor([-math.inf, -1e30, -400.0, -20.0, -1.0, -1e-3, 0.0, 1e-3, 0.5, 3.0, 45.0, 1e30, math.inf,
                      math.nan], device=device)
    out = torch.full_like(x, 7.0)
    _tanh[(1,)](x, out, x.numel(), BLOCK=16)
    torch.testing.assert_close(out, torch.tanh(x), atol=2e-7, rtol=0, equal_nan=True)


def test_cuda_blocks_shrink_for_wide_rows():
    """64 up to 256-byte rows (bf16 at head dim 128, float32 at 64), halved per doubling past them (sm_90)."""
    from attnorm.kernels.triton.attention_launch import block_size

    cuda = torch.device("cuda")
    assert [block_size(cuda, row) for row in (128, 256, 512, 1024, 4096)] == [64, 64, 32, 16, 16]
    assert block_size(torch.device("cpu"), 4096) == 16  # the interpreter's block, whatever the row


@pytest.mark.parametrize("spec", ["sa_softmax", "sa_softmax:normalized=false", "topk:k=3", "topk:k=0.3"])
def test_every_kernel_of_a_family_tiles_scores_alike(spec, blocks_of_32, launched_kernels, device):
    """Self-Adjusted and top-k backward kernels test recomputed scores for equality with the forward's min/max
    or threshold: forward, dq and dk/dv kernels must share tile shape, warps and stages (so the same bits)."""
    q, k, v = (torch.randn(1, 2, 40, 16, device=device, requires_grad=True) for _ in range(3))
    attnorm.attention(q, k, v, attnorm.make(spec, backend="triton"), is_causal=True).sum().backward()
    keys = ("BLOCK_M", "BLOCK_N", "BLOCK_D", "num_warps", "num_stages")
    family = {name: tuple(kwargs.get(key) for key in keys) for name, kwargs in launched_kernels.items()
              if name != "_row_dot_kernel"}
    assert len(family) == 3 and len(set(family.values())) == 1, family
