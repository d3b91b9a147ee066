"""What every fused attention launcher shares on the host: block size, problem shape, operands, row-dot pre-pass.

A fused attention call checks ``q`` ``(B, Hq, Lq, D)``, ``k`` ``(B, Hkv, Lk, D)`` and
``v`` ``(B, Hkv, Lk, Dv)`` once (:func:`problem`), which gives the sizes, the block size
(:data:`BLOCK_CUDA` or :data:`BLOCK_INTERPRETED`, module attributes that tests patch),
the head dims padded to a power of 2 (:func:`head_width`) and the launch grids.  The
kernels read their inputs through :func:`dot_operands`; a backward whose ``delta`` is
``rowsum(dO * out)`` gets it from :func:`row_dot`.  The device side (masks, key-block
bounds, tiles) is :mod:`.attention_blocks`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from attnorm.kernels import rules
from attnorm.kernels.triton import launch
from attnorm.kernels.triton.attention_blocks import load_tile

__all__ = [
    "BLOCK_CUDA",
    "BLOCK_INTERPRETED",
    "CUDA_OPTIONS",
    "CUDA_OPTIONS_WIDE",
    "SKIP_EMPTY_TILES",
    "Problem",
    "block_size",
    "dot_operands",
    "head_width",
    "launch_options",
    "narrow_cuda",
    "problem",
    "row_dot",
]

BLOCK_CUDA = 64
"""Query and key block size on CUDA."""

BLOCK_INTERPRETED = 16
"""Query and key block size under Triton's interpreter (``tl.dot``'s smallest; the interpreter runs tiles in numpy)."""


def block_size(device: torch.device, row_bytes: int = 0) -> int:
    """Query and key block size: :data:`BLOCK_CUDA` on CUDA, :data:`BLOCK_INTERPRETED` elsewhere (interpreter).

    On CUDA the block halves for each doubling of ``row_bytes`` (a padded q/k/v row in the
    input dtype) past 256 bytes: ``scripts/compile_check.py`` found the float32 Self-Adjusted
    dq kernel at head dim 128 (512 bytes a row) needing 352 KiB of shared memory with blocks
    of 64, over an sm_90 block's 227 KiB; blocks of 32 quarter its tiles.
    """
    if device.type != "cuda":
        return BLOCK_INTERPRETED
    block = BLOCK_CUDA
    while row_bytes > 256 and block > BLOCK_INTERPRETED:
        block //= 2
        row_bytes //= 2
    return block


CUDA_OPTIONS = {"num_warps": 4, "num_stages": 3}
"""Warps and pipelining stages of the fused attention kernels on CUDA: bfloat16/float16, padded head dims up to 64.

Timed (``scripts/tune_attention.py``, NVIDIA H200, Triton 3.6, 2026-11-26; bfloat16,
causal, 16 heads, head dim 64, L = 16384, forward + backward beside SDPA in one run): 4 warps
and 3 stages against the earlier 8 warps and 2 stages took sparsemax from 116 to 64 ms,
1.5-entmax 129 to 71, top-k 516 to 310, Self-Adjusted 62 to 32 (normalized) and 45 to 20
(plain); blocks of 128 (``BLOCK_CUDA``) with 8 warps and 2 stages were slower than these for every
family.  Against 2 and 4 stages, 3 won by 0.5-5 % (``benchmarks/results/tune_attention_h200_*.md``).

Every kernel of a family uses the same options and the same score-tile shape: the
Self-Adjusted and top-k backward kernels test recomputed scores for equality with the
forward's min/max or top-k threshold, which needs the same bits, so the same instructions.
"""

SKIP_EMPTY_TILES = False
"""Whether the entmax kernels and top-k's backward skip the products of a tile where no row has a positive weight.

Skipping saves a tile's V (and K, dO) products where the support is empty, but a load
inside a branch is one Triton's pipeliner cannot prefetch: compiled for sm_90 (Triton 3.6),
the skipping loops load V, K and dO synchronously (``LDG``) with 5-12 barriers a tile,
the others prefetch every tile (``cp.async``) with 2-8.  Random scores at long L leave
few tiles empty (sparsemax at L = 16k keeps ~4 keys a row: ~87 % of 64 x 64 tiles hold
one).  Off by default (untimed); ``scripts/tune_attention.py`` times both (a setting's
``+skip``).  Read at each launch, passed to the kernels as the constexpr ``SKIP``.  Top-k's
forward output pass skips whatever this says (``attention_topk._softmax_tile``).
"""

CUDA_OPTIONS_WIDE = {"num_warps": 8, "num_stages": 2}
"""Warps and stages for float32 and float64, and padded head dims above 64: chosen from register spills, not timed.

float32 products run at full precision on the FMA units (:func:`.attention_blocks.mma`),
which takes registers: compiled for sm_90 with 4 warps and 3 stages, the float32 top-k dq
and dk/dv kernels at head dim 64 fell back to 32 registers and 8-14 KiB of stack a thread,
against at most 424 B with 8 warps and 2 stages.

Compiled for sm_90 at head dim 128, 4 warps and 3 stages left the Self-Adjusted and top-k
kernels at 255 registers, spilling up to 1.1 KiB a thread (the bfloat16 Self-Adjusted
forward 1000 B, top-k forward 624 B); with 8 warps and 2 stages the forward and dq kernels
spill at most 144 B and the entmax forward 32 B.  Still spilling at head dim 128: the
Self-Adjusted and top-k dk/dv kernels (up to 608 B).
"""


def narrow_cuda(shape: Problem, q: Tensor) -> bool:
    """Whether a fused launch of ``shape`` on ``q`` takes :data:`CUDA_OPTIONS`: on CUDA, 2-byte inputs (float16,
    bfloat16), padded head dims at most 64."""
    return (q.device.type == "cuda" and q.element_size() == 2
            and max(head_width(shape.head_dim), head_width(shape.value_dim)) <= 64)


def launch_options(shape: Problem, q: Tensor) -> dict[str, int]:
    """``num_warps`` and ``num_stages`` of a fused attention launch of ``shape`` on ``q``'s device and dtype.

    CUDA: :data:`CUDA_OPTIONS` where :func:`narrow_cuda`, else :data:`CUDA_OPTIONS_WIDE`; the
    interpreter ignores both.
    """
    if q.device.type != "cuda":
        return {"num_warps": 4, "num_stages": 1}
    return dict(CUDA_OPTIONS) if narrow_cuda(shape, q) else dict(CUDA_OPTIONS_WIDE)


def head_width(dim: int) -> int:
    """A head dim padded to the tile width: a power of 2, at least 16 (``tl.dot``'s smallest)."""
    return max(16, launch.next_power_of_2(dim))


class Problem(NamedTuple):
    """Shapes, block size and accumulation dtype of one attention call."""

    batch: int
    heads: int
    kv_heads: int
    lq: int
    lk: int
    head_dim: int
    value_dim: int
    block: int
    acc: Any

    @property
    def group(self) -> int:
        """Query heads per key/value head."""
        return self.heads // self.kv_heads

    @property
    def score_shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.heads, self.lq, self.lk)

    @property
    def sizes(self) -> tuple[int, int, int, int, int, int]:
        """The size arguments every kernel takes: ``heads, group, lq, lk, head_dim, value_dim``."""
        return (self.heads, self.group, self.lq, self.lk, self.head_dim, self.value_dim)

    @property
    def constants(self) -> dict[str, Any]:
        """The constexpr arguments every kernel takes: block sizes, padded head dims, accumulation dtype."""
        return dict(BLOCK_M=self.block, BLOCK_N=self.block, BLOCK_D=head_width(self.head_dim),
                    BLOCK_DV=head_width(self.value_dim), ACC=self.acc)

    @property
    def query_grid(self) -> tuple[int, int]:
        """One program per query block and (batch, query head)."""
        return launch.cdiv(self.lq, self.block), self.batch * self.heads

    @property
    def key_grid(self) -> tuple[int, int]:
        """One program per key block and (batch, key/value head)."""
        return launch.cdiv(self.lk, self.block), self.batch * self.kv_heads

    def row_tensor(self, *extra: int, like: Tensor) -> Tensor:
        """A per-query-row output ``(B, Hq, Lq, *extra)`` in the accumulation dtype (from :func:`launch.empty`)."""
        dtype = rules.accumulation_dtype(like.dtype)
        return launch.empty((self.batch, self.heads, self.lq, *extra), dtype, like.device)

    def float_output(self, like: Tensor, wanted: bool) -> Tensor | None:
        """The output ``(B, Hq, Lq, Dv)`` in the accumulation dtype when :func:`rules.keeps_float_output`, else None."""
        return self.row_tensor(self.value_dim, like=like) if rules.keeps_float_output(like.dtype, wanted) else None


def problem(q: Tensor, k: Tensor, v: Tensor) -> Problem:
    """Check the shapes of ``q`` ``(B, Hq, Lq, D)``, ``k`` ``(B, Hkv, Lk, D)``, ``v`` ``(B, Hkv, Lk, Dv)``.

    Raises:
        ValueError: wrong number of dims, mismatched batch, heads, lengths or head dims,
            ``Hq`` not a multiple of ``Hkv``, or mixed dtypes.
    """
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k, v must have 4 dims, got shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    batch, heads, lq, head_dim = q.shape
    if k.shape[0] != batch or v.shape[0] != batch or k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} do not match q {tuple(q.shape)}")
    if k.shape[3] != head_dim:
        raise ValueError(f"k's head dim must equal q's ({head_dim}), got {k.shape[3]}")
    if k.shape[1] == 0 or heads % k.shape[1]:
        raise ValueError(f"query heads ({heads}) must be a multiple of key/value heads ({k.shape[1]})")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    row_bytes = max(head_width(head_dim), head_width(v.shape[3])) * q.element_size()
    return Problem(batch, heads, k.shape[1], lq, k.shape[2], head_dim, v.shape[3], block_size(q.device, row_bytes),
                   launch.compute_dtype(q))


def dot_operands(*tensors: Tensor) -> tuple[Tensor, ...]:
    """The tensors kernels read: unit stride along the last axis, bfloat16 as float32 off CUDA.

    Triton's interpreter multiplies bfloat16 ``tl.dot`` operands as their uint16 bit
    patterns (numpy has no bfloat16), so off CUDA bfloat16 inputs are read as float32
    copies: exact for the score products (a product of two bfloat16 is exact in
    float32); the outputs keep the caller's dtype.  A last axis with another stride is
    copied once rather than read strided by every program.
    """
    operands = []
    for t in tensors:
        if t.dtype == torch.bfloat16 and t.device.type != "cuda":
            t = t.float()
        operands.append(t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous())
    return tuple(operands)


@triton.jit
def _row_dot_kernel(A, B, OUT, sa_b, sa_h, sa_m, sa_d, sb_b, sb_h, sb_m, sb_d, heads, lq, width,
                    BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr, ACC: tl.constexpr):
    block, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    batch, head = bh // heads, bh % heads
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_DV)
    a = load_tile(A + batch * sa_b + head * sa_h, offs_m, offs_d, lq, width, sa_m, sa_d).to(ACC)
    b = load_tile(B + batch * sb_b + head * sb_h, offs_m, offs_d, lq, width, sb_m, sb_d).to(ACC)
    tl.store(OUT + bh * lq + offs_m, tl.sum(a * b, 1), mask=offs_m < lq)


def row_dot(shape: Problem, out: Tensor, grad_out: Tensor) -> Tensor:
    """``rowsum(dO * out)`` per query row ``(B, Hq, Lq)``, accumulation dtype: the backward pre-pass (no K/V)."""
    result = shape.row_tensor(like=out)
    if result.numel():
        launch.launchable(_row_dot_kernel)[shape.query_grid](
            out, grad_out, result, *out.stride(), *grad_out.stride(), shape.heads, shape.lq, shape.value_dim,
            BLOCK_M=shape.block, BLOCK_DV=head_width(shape.value_dim), ACC=shape.acc,
        )
    return result
