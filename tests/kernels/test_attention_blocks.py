"""The fused attention kernels' shared pieces: mask arguments, key-block bounds and score tiles.

A small kernel writes every score tile (and each query block's key range) of a tiny
problem; the result must equal scores computed with torch and masked by the
materialised mask.
"""

from __future__ import annotations

import math

import pytest
import torch

import attnorm
from attnorm.kernels.rules import AttentionMask, attention_allowed

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from attnorm.kernels.triton.attention_blocks import key_block_bounds, mask_arguments, score_tile  # noqa: E402

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
        tile = score_tile(q_tile, k_ptrs, offs_m, offs_n, row_start, row_stop, lk, scale, batch, head,
                          dense, dense_sb, dense_sh, dense_sm, dense_sn,
                          additive, add_sb, add_sh, add_sm, add_sn, HAS_DENSE, HAS_ADDITIVE, tl.float32)
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
