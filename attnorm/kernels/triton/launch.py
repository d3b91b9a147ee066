"""Launcher plumbing shared by the Triton kernels: row layout, masks, parameters, block sizes.

Every kernel runs one program per row of ``x`` viewed as ``(rows, L)``.  A row of
at most :data:`SINGLE_BLOCK_MAX` elements is held in registers (read once, written
once); a longer row is streamed in blocks of :data:`MULTI_PASS_BLOCK` elements
over several passes.  Both constants are module attributes so that tests can force
the multi-pass path with short rows.

Every output tensor is allocated through :func:`empty`, the one place tests
patch to poison outputs (an element a kernel forgets to write then fails).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from attnorm.kernels.sparse import sum_to_shape
from attnorm.masks import StructuredMask

__all__ = [
    "MULTI_PASS_BLOCK",
    "SINGLE_BLOCK_MAX",
    "BlockConfig",
    "Launch",
    "MaskArgs",
    "ParamSpec",
    "block_config",
    "compute_dtype",
    "empty",
    "mask_args",
    "param_grad",
    "prepare",
    "row_param",
    "rows_view",
]

SINGLE_BLOCK_MAX = 8192
"""Longest row (elements) kept in registers; longer rows take the multi-pass path.

Compiled for sm_90 every kernel holds an 8192-element row in at most 98 registers
per thread with no spills; at 16384 some spill to local memory."""

MULTI_PASS_BLOCK = 4096
"""Elements streamed per step on the multi-pass path."""

_NO_MASK, _BOOL_MASK, _STRUCTURED_MASK = 0, 1, 2


class BlockConfig(NamedTuple):
    """How a kernel walks a row: block size (power of 2), single-block or not, warps."""

    block: int
    single: bool
    num_warps: int


def block_config(length: int) -> BlockConfig:
    """Block size and warps for rows of ``length`` elements (as in Triton's fused-softmax tutorial)."""
    single = length <= SINGLE_BLOCK_MAX
    block = triton.next_power_of_2(max(length, 1)) if single else MULTI_PASS_BLOCK
    num_warps = 4 if block < 2048 else 8 if block < 4096 else 16
    return BlockConfig(block, single, num_warps)


class Launch(NamedTuple):
    """One kernel launch over the rows of a tensor: one program per row.

    Attributes:
        rows: the tensor the kernel streams (scores, or the saved tensor of a backward) as ``(rows, L)``.
        out: the row-length output (weights, or ``dx``), ``(rows, L)``, allocated by :func:`empty`.
        config: block size, path and warps for rows of length ``L``.
    """

    rows: Tensor
    out: Tensor
    config: BlockConfig

    @property
    def grid(self) -> tuple[int]:
        return (self.rows.shape[0],)

    @property
    def length(self) -> int:
        return self.rows.shape[1]

    def row_stats(self) -> Tensor:
        """A per-row scalar output, in the accumulation dtype (from :func:`empty`)."""
        dtype = torch.float64 if self.rows.dtype == torch.float64 else torch.float32
        return empty((self.rows.shape[0],), dtype, self.rows.device)


def prepare(source: Tensor) -> Launch:
    """Rows of ``source``, an output shaped like them (same dtype) and the block configuration."""
    rows = rows_view(source)
    return Launch(rows, empty(tuple(rows.shape), source.dtype, source.device), block_config(rows.shape[1]))


def empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """Allocate a kernel output (tests patch this to fill outputs with NaN)."""
    return torch.empty(shape, dtype=dtype, device=device)


def compute_dtype(x: Tensor) -> tl.dtype:
    """Accumulation dtype inside the kernels: float64 for float64 rows, else float32."""
    return tl.float64 if x.dtype == torch.float64 else tl.float32


def rows_view(x: Tensor) -> Tensor:
    """``x`` as ``(rows, L)`` with unit stride along L (a view when possible)."""
    length = x.shape[-1] if x.ndim else 1
    rows = x.reshape(-1, length)
    return rows if rows.stride(-1) == 1 or length == 1 else rows.contiguous()


def row_param(value: float | Tensor, x: Tensor) -> tuple[Tensor, int]:
    """A row parameter as ``(values, stride)``: row ``r`` reads ``values[r * stride]``.

    Python numbers become one element with stride 0; tensors of shape ``(..., 1)``
    broadcastable to ``x`` are expanded over the rows (a view when possible).
    """
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    if not isinstance(value, Tensor):
        return torch.full((1,), float(value), dtype=dtype, device=x.device), 0
    values = value.detach().to(device=x.device, dtype=dtype)
    values = values.expand(*x.shape[:-1], 1).reshape(-1)
    return values, values.stride(0)


class ParamSpec(NamedTuple):
    """Shape and dtype of a tensor parameter: what its gradient must have."""

    shape: torch.Size
    dtype: torch.dtype

    @staticmethod
    def of(value: float | Tensor) -> ParamSpec | None:
        return ParamSpec(value.shape, value.dtype) if isinstance(value, Tensor) else None


def param_grad(per_row: Tensor, x: Tensor, param: ParamSpec) -> Tensor:
    """Reduce per-row gradients of a parameter broadcast over ``x``'s rows back to its shape."""
    per_row = per_row.reshape(*x.shape[:-1], 1)
    return sum_to_shape(per_row, param.shape).to(param.dtype)


class MaskArgs(NamedTuple):
    """A mask as kernel arguments.

    ``args`` is the tuple every kernel takes as ``masking``:
    ``(mask, mask_row_stride, mask_col_stride, key_lengths, lengths_stride,
    rows_per_batch, num_queries, diagonal)``; ``constants`` are the constexpr
    ``MASK_KIND`` (0 none, 1 bool tensor, 2 structured), ``CAUSAL`` and ``LENGTHS``.
    """

    args: tuple[Any, ...]
    constants: dict[str, int]


def mask_args(mask: Tensor | StructuredMask | None, x: Tensor) -> MaskArgs:
    """Translate ``mask`` for scores ``x`` (normalised over the last axis) into kernel arguments.

    A bool mask is viewed as ``(rows, L)`` through broadcasting strides (copied only
    when no such view exists).  A :class:`StructuredMask` is never materialised: the
    kernel derives the query ``q = row % Lq`` and batch ``b = row // (rows / B)`` of
    each row and tests ``j <= q + diagonal`` and ``j < key_lengths[b]``.

    Raises:
        ValueError: a structured mask on scores with fewer than 2 dims, key_lengths on
            scores without a batch axis (fewer than 3 dims) or not of shape ``(B,)`` / ``(1,)``.
    """
    length = x.shape[-1] if x.ndim else 1
    placeholder = x
    if mask is None:
        return MaskArgs((placeholder, 0, 0, placeholder, 0, 1, 1, 0), _constants(_NO_MASK))
    if isinstance(mask, Tensor):
        flat = mask.expand(x.shape).reshape(-1, length).view(torch.uint8)
        return MaskArgs((flat, flat.stride(0), flat.stride(1), placeholder, 0, 1, 1, 0), _constants(_BOOL_MASK))
    if x.ndim < 2:
        raise ValueError(f"a structured mask needs scores of at least 2 dims (..., Lq, Lk), got shape {tuple(x.shape)}")
    rows_per_batch = math.prod(x.shape[1:-1])
    num_queries = x.shape[-2]
    causal = mask.causal_diagonal is not None
    diagonal = mask.causal_diagonal if causal else 0
    lengths, lengths_stride = placeholder, 0
    if mask.key_lengths is not None:
        lengths = mask.key_lengths
        if x.ndim < 3:
            raise ValueError(
                f"key_lengths needs scores shaped (B, ..., Lq, Lk) with a batch axis, got shape {tuple(x.shape)}"
            )
        if lengths.ndim != 1 or lengths.shape[0] not in (1, x.shape[0]):
            raise ValueError(
                f"key_lengths must have shape (B,) with B = scores.shape[0] = {x.shape[0]}, got {tuple(lengths.shape)}"
            )
        lengths = lengths.to(device=x.device, dtype=torch.int64)
        lengths_stride = 0 if lengths.shape[0] == 1 else lengths.stride(0)
    args = (placeholder, 0, 0, lengths, lengths_stride, rows_per_batch, num_queries, diagonal)
    return MaskArgs(args, _constants(_STRUCTURED_MASK, causal, mask.key_lengths is not None))


def _constants(kind: int, causal: bool = False, lengths: bool = False) -> dict[str, int]:
    return {"MASK_KIND": kind, "CAUSAL": causal, "LENGTHS": lengths}
