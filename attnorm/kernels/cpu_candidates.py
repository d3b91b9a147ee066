"""Each row's few candidate positions, gathered without sorting (for the sparse CPU kernels).

Sparsemax, entmax and top-k keep few positions per row, and a bound on the row's
threshold rules out most of the others.  Finding the survivors with a comparison
and ``nonzero`` over the whole tensor costs more on the CPU than a softmax (neither
op is vectorised there), so positions are first handled in groups: a row of length
``L`` is viewed as ``size`` contiguous stripes of ``groups = L / size``, and group
``j`` holds positions ``j, j + groups, ..., j + (size - 1) * groups``.  One
vectorised ``amax`` over the stripes gives every group's maximum; only the groups
whose maximum passes the bound are gathered (a ragged list of groups), and
:meth:`Candidates.narrow` then keeps their single positions above the bound,
padded to the longest row for the threshold iterations.  When most groups pass,
the candidates are the whole ``(R, L)`` matrix instead.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = ["Candidates", "group_maxima", "pack_groups", "top_groups"]


def _group_size(length: int) -> int:
    # At least 128 groups per row, so that a few candidates leave most groups out.
    return next((size for size in (16, 8, 4, 2) if length % size == 0 and length >= 128 * size), 1)


def group_maxima(scores: Tensor) -> Tensor:
    """Maximum of each group of the contiguous ``(R, L)`` ``scores``: shape ``(R, groups)``."""
    rows, length = scores.shape
    size = _group_size(length)
    return scores.view(rows, size, length // size).amax(1)


class Candidates(NamedTuple):
    """Candidate positions of a ``(R, L)`` matrix, in one of three layouts.

    * whole: ``values`` is the ``(R, L)`` matrix itself; ``index`` and ``row`` are None.
    * ragged: ``N`` entries of ``size`` positions: ``values`` and ``index`` (the flat
      index ``row * L + column``) are ``(N, size)``, ``row`` is ``(N,)`` and sorted.
      Nothing is padded; per-row sums go through ``index_add_``.
    * padded: ``values`` and ``index`` (the column) are ``(R, width)``, each row's
      candidates first, then padding (value -inf, column 0); ``row`` is None and
      ``counts`` holds the real entries per row.  Per-row arithmetic is plain
      broadcasting, which is what the threshold iterations need.

    Attributes:
        values: the scores at the candidate positions.
        index: flat indices (ragged) or columns (padded), or None (whole).
        row: the row of each ragged entry, or None.
        rows_count: ``R``.
        length: ``L``.
        counts: ``(R, 1)`` number of real entries per row (padded layout), or None.
    """

    values: Tensor
    index: Tensor | None
    row: Tensor | None
    rows_count: int
    length: int
    counts: Tensor | None = None

    def per_entry(self, per_row: float | Tensor) -> float | Tensor:
        """A per-row quantity (a float, or a tensor of shape ``(R, 1)``) aligned with ``values``."""
        if self.row is None or not isinstance(per_row, Tensor):
            return per_row
        return per_row[self.row]

    def row_sum(self, values: Tensor) -> Tensor:
        """Per-row sums, shape ``(R, 1)``, of a tensor aligned with ``values`` (0 on padding)."""
        if self.row is None:
            return values.sum(-1, keepdim=True)
        return values.new_zeros(self.rows_count).index_add_(0, self.row, values.sum(-1)).unsqueeze(-1)

    def take(self, tensor: Tensor) -> Tensor:
        """The entries of another tensor shaped like the scores at the candidate positions (whole or ragged)."""
        if self.index is None:
            return tensor.reshape(self.values.shape)
        if tensor.is_contiguous():
            return tensor.reshape(-1)[self.index]
        return tensor[torch.unravel_index(self.index, tensor.shape)]  # e.g. an expanded gradient

    def columns(self, slots: Tensor) -> Tensor:
        """Columns of the entries ``values.gather(1, slots)`` (whole or padded layout)."""
        return slots if self.index is None else self.index.gather(1, slots)

    def scatter(self, values: Tensor, out: Tensor) -> Tensor:
        """Write ``values`` (aligned with ``self.values``, 0 on padding) into the 2-D ``out``, zeros elsewhere."""
        if self.index is None:
            return out.copy_(values)
        out.zero_()
        if self.row is not None:
            out.view(-1)[self.index] = values
        else:  # padding adds 0 to column 0
            out.scatter_add_(1, self.index, values)
        return out

    def narrow(self, bound: Tensor, inclusive: bool) -> Candidates:
        """The single positions at values above (or, if ``inclusive``, at) the per-row ``bound``, padded.

        Takes the whole or ragged layout.
        """
        compare = torch.ge if inclusive else torch.gt
        entry, member = compare(self.values, self.per_entry(bound)).nonzero(as_tuple=True)
        if self.row is None:
            row, column = entry, member
        else:
            row = self.row[entry]
            column = self.index[entry, member] - row * self.length
        counts = torch.bincount(row, minlength=self.rows_count)
        width = max(int(counts.max()), 1) if row.numel() else 1
        slot = torch.arange(row.numel(), device=row.device) - (counts.cumsum(0) - counts)[row]
        values = self.values.new_full((self.rows_count, width), -math.inf)
        values[row, slot] = self.values[entry, member]
        columns = column.new_zeros((self.rows_count, width))
        columns[row, slot] = column
        return Candidates(values, columns, None, self.rows_count, self.length, counts.unsqueeze(-1))


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
        return Candidates(scores, None, None, rows_count, length)
    flat = (row * length + group).unsqueeze(1) + torch.arange(size, device=scores.device) * groups
    return Candidates(scores.view(-1)[flat], flat, row, rows_count, length)


def top_groups(scores: Tensor, block_max: Tensor, count: int) -> Candidates:
    """The ``count`` groups with the largest maxima in each row of ``scores`` (R, L), padded layout.

    A row's ``count`` largest scores lie in those groups: a score in any other group
    is below ``count`` group maxima, that is below ``count`` other scores (ties at the
    boundary aside, which ``torch.topk`` breaks either way).
    """
    rows_count, length = scores.shape
    groups = block_max.shape[-1]
    size = length // groups
    chosen = block_max.topk(count, dim=-1).indices  # (R, count)
    columns = (chosen.unsqueeze(-1) + torch.arange(size, device=scores.device) * groups).view(rows_count, -1)
    full = torch.full((rows_count, 1), columns.shape[-1], device=scores.device)
    return Candidates(scores.gather(1, columns), columns, None, rows_count, length, full)
