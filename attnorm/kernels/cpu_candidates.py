"""Each row's few candidate positions, gathered without sorting (for the sparse CPU kernels).

Sparsemax, entmax and top-k keep few positions per row, and a bound on the row's
threshold rules out most of the others.  Finding the survivors with a comparison
and ``nonzero`` over the whole tensor costs more on the CPU than a softmax (neither
op is vectorised there), so positions are first handled in groups: a row of length
``L`` is viewed as ``size`` contiguous stripes of ``groups = L / size``, and group
``j`` holds positions ``j, j + groups, ..., j + (size - 1) * groups``.  One
vectorised ``amax`` over the stripes gives every group's maximum; only the groups
whose maximum passes the bound are gathered, and :meth:`Candidates.narrow` then
keeps their single positions above the bound.

Candidates are ragged: ``N`` entries of ``size`` positions, each with its row, so
no row is padded to the longest one; per-row sums go through ``index_add_``.
When most groups pass, the candidates are the whole ``(R, L)`` matrix instead.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = ["Candidates", "group_maxima", "pack_groups"]


def _group_size(length: int) -> int:
    # At least 128 groups per row, so that a few candidates leave most groups out.
    return next((size for size in (16, 8, 4, 2) if length % size == 0 and length >= 128 * size), 1)


def group_maxima(scores: Tensor) -> Tensor:
    """Maximum of each group of the contiguous ``(R, L)`` ``scores``: shape ``(R, groups)``."""
    rows, length = scores.shape
    size = _group_size(length)
    return scores.view(rows, size, length // size).amax(1)


class Candidates(NamedTuple):
    """Candidate positions of a ``(R, L)`` matrix.

    Attributes:
        values: ``(N, size)`` values at the candidate positions; or, when ``row`` is
            None, the whole ``(R, L)`` matrix (every position is a candidate).
        flat: ``(N, size)`` flat index ``row * L + column`` of each position, or None.
        row: ``(N,)`` row of each entry, sorted, or None.
        rows_count: ``R``.
    """

    values: Tensor
    flat: Tensor | None
    row: Tensor | None
    rows_count: int

    def per_entry(self, per_row: float | Tensor) -> float | Tensor:
        """A per-row quantity (a float, or a tensor of shape ``(R, 1)``) aligned with ``values``."""
        if self.row is None or not isinstance(per_row, Tensor):
            return per_row
        return per_row[self.row]

    def row_sum(self, values: Tensor) -> Tensor:
        """Per-row sums, shape ``(R, 1)``, of a tensor aligned with ``values``."""
        if self.row is None:
            return values.sum(-1, keepdim=True)
        return values.new_zeros(self.rows_count).index_add_(0, self.row, values.sum(-1)).unsqueeze(-1)

    def take(self, tensor: Tensor) -> Tensor:
        """The entries of another tensor shaped like the scores, at the candidate positions."""
        if self.row is None:
            return tensor.reshape(self.values.shape)
        if tensor.is_contiguous():
            return tensor.reshape(-1)[self.flat]
        return tensor[torch.unravel_index(self.flat, tensor.shape)]  # e.g. an expanded gradient

    def scatter(self, values: Tensor, out: Tensor) -> Tensor:
        """Write ``values`` (aligned with ``self.values``) into the 2-D ``out``, zeros elsewhere."""
        if self.row is None:
            return out.copy_(values)
        out.zero_()
        out.view(-1)[self.flat] = values
        return out

    def narrow(self, bound: Tensor, inclusive: bool) -> Candidates:
        """Single positions whose value is above (or, if ``inclusive``, at) the per-row ``bound``."""
        compare = torch.ge if inclusive else torch.gt
        entry, member = compare(self.values, self.per_entry(bound)).nonzero(as_tuple=True)
        if self.row is None:
            row, flat = entry, entry * self.values.shape[-1] + member
        else:
            row, flat = self.row[entry], self.flat[entry, member]
        return Candidates(self.values[entry, member].unsqueeze(1), flat.unsqueeze(1), row, self.rows_count)

    def padded(self, fill: float) -> tuple[Tensor, Tensor]:
        """Single-position candidates laid out as ``(R, width)`` rows: values (``fill`` after
        each row's last) and flat positions (-1 there)."""
        if self.row is None:
            rows, length = self.values.shape
            flat = torch.arange(rows * length, device=self.values.device).view(rows, length)
            return self.values, flat
        counts = torch.bincount(self.row, minlength=self.rows_count)
        width = max(int(counts.max()), 1) if self.row.numel() else 1
        slot = torch.arange(self.row.numel(), device=self.row.device) - (counts.cumsum(0) - counts)[self.row]
        values = self.values.new_full((self.rows_count, width), fill)
        values[self.row, slot] = self.values[:, 0]
        flat = self.flat.new_full((self.rows_count, width), -1)
        flat[self.row, slot] = self.flat[:, 0]
        return values, flat


def pack_groups(scores: Tensor, hit: Tensor) -> Candidates:
    """Gather the groups flagged in ``hit`` (R, groups) from the contiguous ``(R, L)`` scores.

    Returns the whole matrix as candidates when more than half of its positions
    would be gathered.
    """
    rows_count, length = scores.shape
    groups = hit.shape[-1]
    size = length // groups
    row, group = hit.nonzero(as_tuple=True)
    if 2 * row.numel() * size > scores.numel():
        return Candidates(scores, None, None, rows_count)
    flat = (row * length + group).unsqueeze(1) + torch.arange(size, device=scores.device) * groups
    return Candidates(scores.view(-1)[flat], flat, row, rows_count)


def finite_count(candidates: Candidates) -> Tensor:
    """Per-row number of candidates above -inf, shape ``(R, 1)``, at least 1."""
    return candidates.row_sum((candidates.values > -math.inf).to(candidates.values.dtype)).clamp_min(1)
