"""Launcher plumbing shared by the Triton kernels: row layout, masks, parameters, block sizes.

Every kernel runs one program per row of ``x`` viewed as ``(rows, L)``.  A row of
at most :data:`SINGLE_BLOCK_MAX` elements is held in registers (read once, written
once); a longer row is streamed in blocks of :data:`MULTI_PASS_BLOCK` elements
over several passes.  Both constants are module attributes so that tests can force
the multi-pass path with short rows.

Kernels are launched by :func:`run` with tensors and numbers only.  Every output
tensor is allocated through :func:`empty`, the one place tests patch to poison
outputs (an element a kernel forgets to write then fails).

A sink per row (``kernels/README.md``) is one more position after the row: the
kernel reads its score through :func:`sink_scores` (``(values, stride, period, count)``: a
per-head sink read in place) and a single-block row needs a block of ``L + 1`` lanes (:func:`prepare`).

Soft-capping (``kernels/README.md``) passes the cap through :func:`softcap_arg` and the
constexpr ``SOFTCAP``.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
import triton.language as tl
from torch import _C, Tensor

from attnorm import validation
from attnorm.kernels import fast_launch, rules
from attnorm.kernels.inductor import launchable

__all__ = [
    "MULTI_PASS_BLOCK",
    "SINGLE_BLOCK_MAX",
    "BlockConfig",
    "Launch",
    "MaskArgs",
    "block_config",
    "check_raw_scores",
    "cdiv",
    "compute_dtype",
    "constant",
    "empty",
    "launchable",
    "mask_args",
    "next_power_of_2",
    "per_row_param",
    "prepare",
    "row_param",
    "rows_view",
    "run",
    "sink_scores",
    "softcap_arg",
]

SINGLE_BLOCK_MAX = 8192
"""Longest row (elements) kept in registers; longer rows take the multi-pass path.

Compiled for sm_90 (``scripts/compile_check.py``) every kernel holds an 8192-element row
in at most 127 registers per thread (entmax's forward) without spilling, and with a sink
(a block of 8192 for 8191 keys) only bfloat16 top-k spills, 8 bytes; at 16384 some spill
to local memory."""

MULTI_PASS_BLOCK = 4096
"""Elements streamed per step on the multi-pass path."""


class BlockConfig(NamedTuple):
    """How a kernel walks a row: block size (power of 2), single-block or not, warps."""

    block: int
    single: bool
    num_warps: int


def next_power_of_2(n: int) -> int:
    """The least power of 2 >= ``n`` (1 for ``n`` <= 1).

    Plain integer arithmetic in the launchers: ``triton.next_power_of_2`` and ``triton.cdiv``
    are ``ConstexprFunction`` objects in recent Triton (3.9: ~4.5 us a call on a slow CPU,
    against 0.15 us here), and a launch computes several.
    """
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers, ``b > 0`` (see :func:`next_power_of_2`)."""
    return -(-a // b)


def block_config(length: int) -> BlockConfig:
    """Block size and warps for rows of ``length`` elements (as in Triton's fused-softmax tutorial)."""
    single = length <= SINGLE_BLOCK_MAX
    block = next_power_of_2(length) if single else MULTI_PASS_BLOCK
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

    def row_stats(self, *extra: int) -> Tensor:
        """A per-row output ``(rows, *extra)`` in the accumulation dtype (from :func:`empty`)."""
        return empty((self.rows.shape[0], *extra), rules.accumulation_dtype(self.rows.dtype), self.rows.device)


def prepare(source: Tensor, sink: bool = False, dtype: torch.dtype | None = None) -> Launch:
    """Rows of ``source``, an output shaped like them (``dtype``, by default ``source``'s) and the block configuration.

    The kernels round what they store to the output's dtype (``store_row``: round to nearest
    even, as ``Tensor.to``), so a float32 row may be written straight into a half-precision output.

    With ``sink`` the kernel also walks the sink after each row: blocks are chosen for
    ``L + 1`` positions (a row of a power-of-two length takes a block twice as wide, and a
    row of :data:`SINGLE_BLOCK_MAX` the multi-pass path).
    """
    rows = rows_view(source)
    return Launch(rows, empty(tuple(rows.shape), dtype or source.dtype, source.device),
                  block_config(rows.shape[1] + sink))


def run(kernel: Any, launch: Launch, *args: Any, **constants: Any) -> None:
    """Launch ``kernel`` with one program per row.

    A plain Triton launch in eager mode; wrapped by :func:`torch.library.wrap_triton` when
    an op decomposes under ``torch.compile`` (:mod:`attnorm.kernels.inductor`).  Rows of
    length 0 or no rows at all launch nothing (the outputs are empty, or per-row outputs
    of rows with no allowed position, written by the caller).
    """
    if launch.rows.numel() == 0:
        return
    launchable(kernel)[launch.grid](*args, num_warps=launch.config.num_warps, **constants)


def empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """Allocate a kernel output (tests patch this to fill outputs with NaN).

    Sizes go unpacked: ``torch.empty`` parses separate ints faster than a tuple (1.5 against
    2.3 us a call on a slow CPU).  A call being recorded (:mod:`.replay`) notes each output.
    """
    out = torch.empty(*shape, dtype=dtype, device=device) if shape else torch.empty((), dtype=dtype, device=device)
    fast_launch.note_output(out)
    return out


def compute_dtype(x: Tensor) -> tl.dtype:
    """Accumulation dtype inside the kernels: float64 for float64 rows, else float32."""
    return tl.float64 if x.dtype == torch.float64 else tl.float32


def rows_view(x: Tensor) -> Tensor:
    """``x`` as ``(rows, L)`` with unit stride along L (a view when possible)."""
    length = x.shape[-1] if x.ndim else 1
    rows = x.reshape(-1, length)
    return rows if rows.stride(-1) == 1 or length == 1 else rows.contiguous()


_CONSTANTS: dict[tuple[str, torch.dtype, torch.device, int], Tensor] = {}
CONSTANTS_KEPT = 1024
"""Most one-element constants :func:`constant` keeps; once full, it makes fresh ones."""


def _current_stream_key(device: torch.device) -> int:
    """The current CUDA stream of ``device`` as a number: its raw handle, read as Triton's own launcher reads it.

    ``torch.cuda.current_stream`` builds a ``Stream`` object on every call: ~11 of a sparsemax
    call's ~140 µs under cProfile on an H200 (``scripts/profile_overhead.py``, 2026-11-26).
    ``torch._C._cuda_getCurrentRawStream`` exists in CUDA builds only; without it, the public call.
    """
    raw = getattr(_C, "_cuda_getCurrentRawStream", None)
    if raw is None:
        return torch.cuda.current_stream(device).stream_id
    return raw(device.index if device.index is not None else torch.cuda.current_device())


def constant(value: float, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A one-element tensor holding ``value`` that kernels read (never write), made once in eager calls.

    A number parameter (a temperature, Scalable-Softmax's ``s`` and bias, alpha) and the cap
    reach the kernels as one element in the accumulation dtype (a python float would be
    float32 in a float64 kernel).  ``torch.full`` per call costs ~2 us on the CPU and, on
    CUDA, one fill kernel launch per parameter: Softmax's forward launched two besides its
    own.  Kept per ``(value bits, dtype, device, CUDA stream)``, at most
    :data:`CONSTANTS_KEPT` of them, and never dropped: the kernels that read a kept tensor
    run on the stream that filled it (ordered after the fill), and none is freed while a
    kernel may still read it.  A fresh tensor is made where a tracer must see it
    or a kept one could not be used: under ``torch.compile``, a dispatch mode (export, fake
    tensors), ``torch.jit.trace``, and while a CUDA graph is being captured (its fill would
    run only at replay).
    """
    cuda = device.type == "cuda"
    if (torch.compiler.is_compiling() or _C._len_torch_dispatch_stack() or _C._get_tracing_state()
            or cuda and torch.cuda.is_current_stream_capturing()):
        return torch.full((1,), value, dtype=dtype, device=device)
    stream = _current_stream_key(device) if cuda else 0
    key = (value.hex(), dtype, device, stream)  # bits: -0.0 is not 0.0, and every NaN is one key
    kept = _CONSTANTS.get(key)
    if kept is None:
        kept = torch.full((1,), value, dtype=dtype, device=device)
        if len(_CONSTANTS) < CONSTANTS_KEPT:
            _CONSTANTS[key] = kept
    return kept


def kept_constants() -> set[int]:
    """The ids of the constants :func:`constant` keeps (never dropped, so a recorded launch may hold them)."""
    return {id(kept) for kept in _CONSTANTS.values()}


def row_param(value: float | Tensor, x: Tensor, dtype: torch.dtype | None = None) -> tuple[Tensor, int]:
    """A row parameter as ``(values, stride)``: row ``r`` of ``x`` reads ``values[r * stride]``.

    Python numbers become one element with stride 0; tensors of shape ``(..., 1)``
    broadcastable to ``x`` are expanded over the rows (a view when possible), in ``dtype``
    (the accumulation dtype when None; a kernel computing wider passes its own).
    """
    dtype = rules.accumulation_dtype(x.dtype) if dtype is None else dtype
    if not isinstance(value, Tensor):
        return constant(float(value), dtype, x.device), 0
    values = value.detach().to(device=x.device, dtype=dtype)
    values = values.expand(*x.shape[:-1], 1).reshape(-1)
    return values, values.stride(0) if values.numel() > 1 else 0


def per_row_param(value: float | Tensor, x: Tensor) -> tuple[Tensor, int]:
    """A per-row value of the contract's shape ``x.shape[:-1]`` (or a number) as :func:`row_param` arguments."""
    return row_param(value.unsqueeze(-1) if isinstance(value, Tensor) else value, x)


def sink_scores(sink: Tensor | None, x: Tensor) -> tuple[Tensor, int, int, int]:
    """The sink's score per row as ``(values, stride, period, count)``: row ``r`` of ``x`` reads
    ``values[(r // period) % count * stride]`` (:func:`~attnorm.kernels.triton.blocks.load_sink_score`).

    ``sink`` has shape ``x.shape[:-1]``, or ``x.ndim`` dims with last dim 1 broadcastable to
    ``x``.  It is read where it lies when its broadcast over the rows varies along one run
    of adjacent dims whose strides merge into one (a per-head sink ``(H, 1, 1)`` of
    ``(B, H, Lq, L)`` scores: period ``Lq``, count ``H``, whatever ``B``), and in its own
    dtype when the kernel's accumulation dtype holds every value of it exactly (float16,
    bfloat16 or float32 into float32; any float into float64): the kernel converts it as it
    reads, as torch's cast would.  Otherwise one value per row is copied (period 1), in
    the accumulation dtype.  A copy would cost a launch per call on CUDA and keep the call
    from being replayed (:mod:`.replay`): a decoding step's per-head sink (gpt-oss) is not
    copied.  None (no sink) gives ``x`` with stride 0, a pointer the kernel never reads.

    Raises:
        ValueError: ``sink`` of another shape.
    """
    if sink is None:
        return x, 0, 1, 1
    column = sink.unsqueeze(-1) if sink.ndim == x.ndim - 1 else sink
    rows = (*x.shape[:-1], 1)
    if column.ndim != x.ndim or any(size not in (1, wanted) for size, wanted in zip(column.shape, rows, strict=True)):
        raise ValueError(f"sink must have shape {tuple(x.shape[:-1])} or {rows} (broadcastable), got "
                         f"{tuple(sink.shape)}")
    dtype = rules.accumulation_dtype(x.dtype)
    column = column.detach()
    if column.device != x.device or not _holds_exactly(dtype, column.dtype):
        column = column.to(device=x.device, dtype=dtype)
    view = column.expand(rows)[..., 0]
    sizes, strides = tuple(view.shape), view.stride()
    varying = [dim for dim, size in enumerate(sizes) if size != 1 and strides[dim] != 0]
    if not varying:
        return view, 0, 1, 1
    first, last = varying[0], varying[-1] + 1
    stride = _merged_stride(sizes[first:last], strides[first:last])
    if stride is None:  # varies along dims that do not merge: one value per row
        flat = view.reshape(-1)
        return flat, flat.stride(0), 1, flat.numel()
    return view, stride, math.prod(sizes[last:]), math.prod(sizes[first:last])


def _holds_exactly(accumulation: torch.dtype, dtype: torch.dtype) -> bool:
    """Whether every value of ``dtype`` converts exactly to the float ``accumulation`` dtype."""
    return dtype == accumulation or dtype in (torch.float16, torch.bfloat16) or (
        accumulation == torch.float64 and dtype == torch.float32)


def softcap_arg(softcap: float | None, x: Tensor) -> Tensor:
    """The cap as the kernels read it: one element in the accumulation dtype of ``x``.

    A tensor rather than a number: a python float reaches a kernel as float32, and
    float64 rows compute the cap in float64.  None (no cap) gives ``x``, a pointer the
    kernel never reads (its ``SOFTCAP`` is False).

    Raises:
        ValueError: a cap that is not a finite number > 0.
    """
    if softcap is None:
        return x
    cap = validation.check_softcap(softcap)
    return constant(cap, rules.accumulation_dtype(x.dtype), x.device)


def check_raw_scores(x: Tensor | None, softcap: float | None) -> None:
    """Check that a capped backward has the raw scores it carries ``dx`` through.

    Raises:
        ValueError: ``softcap`` given without ``x``.
    """
    if softcap is not None and x is None:
        raise ValueError("softcap needs the raw scores x (the forward's input), got x=None")


class MaskArgs(NamedTuple):
    """A :class:`~attnorm.kernels.rules.RowMask` as kernel arguments.

    ``args`` are the ten arguments every masked kernel takes after its parameters:
    ``mask, mask_batch_stride, mask_head_stride, mask_query_stride, mask_col_stride,
    key_lengths, lengths_stride, rows_per_batch, num_queries, diagonal``; ``constants`` are
    the constexpr flags ``BOOL_MASK`` (a bool tensor is given), ``CAUSAL`` and ``LENGTHS``.
    """

    args: tuple[Any, ...]
    constants: dict[str, bool]


_UNMASKED = {"BOOL_MASK": False, "CAUSAL": False, "LENGTHS": False}


def _merged_stride(sizes: tuple[int, ...], strides: tuple[int, ...]) -> int | None:
    """One stride walking dims ``sizes`` (strides ``strides``) as one flat index, or None when they do not merge."""
    dims = [(size, stride) for size, stride in zip(sizes, strides, strict=True) if size != 1]
    for (_, outer), (size, inner) in zip(dims[:-1], dims[1:], strict=True):
        if outer != inner * size:
            return None
    return dims[-1][1] if dims else 0


def _mask_view(tensor: Tensor, x: Tensor, rows_per_batch: int, num_queries: int) -> tuple[Tensor, tuple[int, ...]]:
    """The bool mask broadcast to ``x`` as a uint8 view, and its ``(batch, head, query, column)`` strides.

    Row ``r`` of ``x`` (as ``(rows, L)``) is batch ``r // rows_per_batch``, head (the flattened
    dims between batch and query) ``r % rows_per_batch // num_queries`` and query
    ``r % num_queries``; the kernels read its mask row at ``batch sb + head sh + query sq``.
    A mask broadcast over heads or queries (Hugging Face's ``(B, 1, Lq, Lk)`` and
    ``(B, 1, 1, Lk)``) is read through stride 0 there, never copied; only a mask whose head
    dims do not merge into one stride is copied to ``(rows, L)``.
    """
    view = tensor.to(x.device).expand(x.shape)
    if x.ndim >= 3:
        head = _merged_stride(tuple(x.shape[1:-2]), tuple(view.stride()[1:-2]))
        if head is not None:
            return view.view(torch.uint8), (view.stride(0), head, view.stride(-2), view.stride(-1))
        flat = view.reshape(-1, x.shape[-1])  # a copy: the head dims' strides do not merge
        row = flat.stride(0)
        return flat.view(torch.uint8), (rows_per_batch * row, num_queries * row, row, flat.stride(1))
    if x.ndim == 2:  # rows_per_batch 1: each row is its own "batch"
        return view.view(torch.uint8), (view.stride(0), 0, 0, view.stride(1))
    return view.view(torch.uint8), (0, 0, 0, view.stride(-1) if x.ndim else 0)


def mask_args(mask: rules.RowMask, x: Tensor) -> MaskArgs:
    """Translate ``mask`` for scores ``x`` (normalised over the last axis) into kernel arguments.

    A bool tensor is read where it lies, through its broadcast strides per batch, head and
    query (:func:`_mask_view`).  The causal diagonal and key lengths are never
    materialised: the kernel derives the query ``q = row % Lq`` and batch
    ``b = row // (rows / B)`` of each row and tests ``j <= q + diagonal`` and
    ``j < key_lengths[b]``.  All three may be given together.

    Raises:
        ValueError: a causal diagonal or key lengths on scores with fewer than 2 dims,
            key lengths on scores without a batch axis (fewer than 3 dims) or not of
            shape ``(B,)`` / ``(1,)``.
    """
    if mask.unmasked:
        # Unmasked (the common case): placeholders only, row geometry 1 (the kernels read it
        # only under a mask), so every unmasked launch shares one specialisation.
        return MaskArgs((x, 0, 0, 0, 0, x, 0, 1, 1, 0), _UNMASKED)
    if mask.structured and x.ndim < 2:
        raise ValueError(f"a structured mask needs scores of at least 2 dims (..., Lq, Lk), got shape {tuple(x.shape)}")
    rows_per_batch = max(math.prod(x.shape[1:-1]), 1) if x.ndim >= 2 else 1
    num_queries = max(x.shape[-2], 1) if x.ndim >= 2 else 1
    placeholder = x
    flat, strides = placeholder, (0, 0, 0, 0)
    if mask.tensor is not None:
        flat, strides = _mask_view(mask.tensor, x, rows_per_batch, num_queries)
    lengths, lengths_stride = placeholder, 0
    if mask.key_lengths is not None:
        rules.check_key_lengths(mask.key_lengths, tuple(x.shape))
        lengths = mask.key_lengths.to(device=x.device, dtype=torch.int64)
        lengths_stride = 0 if lengths.shape[0] == 1 else lengths.stride(0)
    diagonal = 0 if mask.diagonal is None else int(mask.diagonal)
    args = (flat, *strides, lengths, lengths_stride, rows_per_batch, num_queries, diagonal)
    constants = {"BOOL_MASK": mask.tensor is not None, "CAUSAL": mask.diagonal is not None,
                 "LENGTHS": mask.key_lengths is not None}
    return MaskArgs(args, constants)
