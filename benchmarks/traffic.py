"""Minimum bytes a row normalizer must move, to turn benchmark timings into GB/s.

Counted once per row of ``length`` elements: every row-length tensor the kernel
reads or writes, plus the per-row scalars it saves for (or reads in) the backward.
That is exactly what a row held in registers (the single-block path of
:mod:`attnorm.kernels.triton`) moves, and the floor for any implementation that
keeps its backward to the output and per-row scalars: the benchmarks divide it by
any provider's time (torch.softmax, the entmax package, ...) as an effective
bandwidth, as Triton's fused-softmax tutorial does.  Not counted: re-reads of
long rows on the multi-pass path, an explicit bool mask (a structured mask costs
one integer per row at most), and parameters (one value per row or per head).

====================== ========================= =============================
op                     forward moves             backward moves
====================== ========================= =============================
softmax                x, y; 1 per-row scalar    y, g, dx; 1 per-row scalar
scalable_softmax       x, y; 2 per-row scalars   y, g, dx; 1 per-row scalar
self_adjusted_softmax  x, y; 4 per-row scalars   x, g, dx; 4 per-row scalars
sparsemax, entmax      x, y; 1 per-row scalar    y, g, dx; 1 per-row scalar
topk_softmax           x, y; 1 per-row scalar    y, g, dx; 1 per-row scalar
====================== ========================= =============================

This module imports neither triton nor attnorm, so it works on any machine.  Scripts in ``benchmarks/`` import it as
``from traffic import bytes_moved``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["MODES", "OPS", "bytes_moved"]

MODES = ("forward", "backward", "forward+backward")


class _Traffic(NamedTuple):
    forward_tensors: int
    forward_row_scalars: int
    backward_tensors: int
    backward_row_scalars: int


_TRAFFIC = {
    "softmax": _Traffic(2, 1, 3, 1),
    "scalable_softmax": _Traffic(2, 2, 3, 1),
    "self_adjusted_softmax": _Traffic(2, 4, 3, 4),
    "sparsemax": _Traffic(2, 1, 3, 1),
    "entmax": _Traffic(2, 1, 3, 1),
    "topk_softmax": _Traffic(2, 1, 3, 1),
}
OPS = tuple(_TRAFFIC)


def bytes_moved(op: str, rows: int, length: int, dtype: torch.dtype, mode: str) -> int:
    """Minimum bytes an implementation of ``op`` moves over ``rows`` rows of ``length`` elements.

    ``bytes = rows * (length * itemsize * tensors + scalar_size * row_scalars)``, summed
    over the kernels ``mode`` runs; per-row scalars are float32 (float64 for float64 rows).

    Args:
        op: a row operation (``"softmax"``, ``"scalable_softmax"``, ``"self_adjusted_softmax"``,
            ``"sparsemax"``, ``"entmax"``, ``"topk_softmax"``).
        rows: number of rows (product of every dim but the normalised one).
        length: elements per row.
        dtype: dtype of the scores, weights and gradients (a kernel that upcasts
            float16/bfloat16 rows moves more than this floor).
        mode: ``"forward"``, ``"backward"`` or ``"forward+backward"``.

    Returns:
        The byte count.

    Raises:
        ValueError: unknown ``op`` or ``mode``, negative ``rows`` or ``length``,
            non-floating ``dtype``.
    """
    if op not in _TRAFFIC:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if rows < 0 or length < 0:
        raise ValueError(f"rows and length must be >= 0, got rows={rows}, length={length}")
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point dtype, got {dtype}")
    traffic = _TRAFFIC[op]
    itemsize = torch.empty((), dtype=dtype).element_size()
    scalar_size = 8 if dtype == torch.float64 else 4
    tensors = scalars = 0
    if mode in ("forward", "forward+backward"):
        tensors += traffic.forward_tensors
        scalars += traffic.forward_row_scalars
    if mode in ("backward", "forward+backward"):
        tensors += traffic.backward_tensors
        scalars += traffic.backward_row_scalars
    return rows * (length * itemsize * tensors + scalar_size * scalars)
