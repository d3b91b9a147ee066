"""Selection geometry of Mudarisov et al. (arXiv 2508.17821): Theorems 1 and 2.

A query's attention weights ``alpha`` (one row of ``(..., Lq, Lk)`` weights) mix
the vectors ``x_j`` (``(..., Lk, D)``: values, or embeddings).  For a selected set
``I`` of ``N`` positions the *selected context vector* is

    s = sum_{i in I} alpha_i x_i,

and the geometry of token selection is read from the distances
``d_j = ||s - alpha_j x_j||`` of the weighted vectors ``alpha_j x_j`` to ``s``:

* Theorem 1 (distance): the mean of ``d_j`` over the non-selected allowed positions
  ``j``, for ``I`` the top-N weights, compared with its expectation when ``I`` is a
  uniformly random N-subset of the allowed positions.  When the two agree the
  weights no longer single out their top-N set.
* Theorem 2 (separability): with the ``x_j`` normalised to the unit sphere, a selected
  token ``i`` is *separable* when ``alpha_i x_i`` lies strictly inside the ball of
  radius ``r = min_{j not in I} d_j`` around ``s``, the ball every non-selected
  weighted vector lies outside of.  The separable fraction is ``N_s / N``.

Masks follow :mod:`attnorm.diagnostics.weights`.  The top-N set holds the ``min(N, n)``
largest allowed weights of a row (ties broken by ``torch.topk``).  Rows with no
non-selected allowed position give NaN.  All results are float64, shape ``(..., Lq)``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from attnorm.diagnostics.weights import Mask, allowed_positions

DISTANCE_BLOCK = 1 << 22
"""Most ``(Lq, Lk, D)`` difference elements :func:`weighted_distances` holds at once (32 MiB in float64)."""

__all__ = [
    "random_selection",
    "random_selection_distance",
    "selection_distance",
    "separable_fraction",
    "top_n_selection",
    "weighted_distances",
]


def _check_n(n: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")


def _check_shapes(weights: Tensor, vectors: Tensor) -> None:
    if weights.ndim < 2 or vectors.ndim < 2:
        raise ValueError(
            f"weights must be (..., Lq, Lk) and vectors (..., Lk, D), got shapes "
            f"{tuple(weights.shape)} and {tuple(vectors.shape)}"
        )
    if weights.shape[-1] != vectors.shape[-2]:
        raise ValueError(
            f"weights (..., Lq, Lk={weights.shape[-1]}) and vectors (..., Lk={vectors.shape[-2]}, D) "
            "must agree on Lk"
        )
    try:
        torch.broadcast_shapes(weights.shape[:-2], vectors.shape[:-2])
    except RuntimeError:
        raise ValueError(f"the leading dims of weights {tuple(weights.shape)} and vectors {tuple(vectors.shape)} "
                         "must broadcast") from None


def _largest_allowed(keys: Tensor, allowed: Tensor, n: int) -> Tensor:
    """Bool mask of the ``min(n, allowed count)`` allowed positions with the largest ``keys``."""
    count = allowed.sum(-1, keepdim=True)
    largest = min(n, keys.shape[-1])
    order = keys.masked_fill(~allowed, -torch.inf).topk(largest, dim=-1).indices
    chosen = torch.arange(largest, device=keys.device) < count
    return torch.zeros_like(allowed).scatter(-1, order, chosen) & allowed


def top_n_selection(weights: Tensor, n: int, mask: Mask = None) -> Tensor:
    """The top-N set ``I_N`` of each row: its ``min(n, allowed)`` largest allowed weights.

    Args:
        weights: attention weights ``(..., Lk)``.
        n: set size, >= 1.
        mask: allowed positions.

    Returns:
        Bool tensor shaped like ``weights``, True on the selected positions.
    """
    _check_n(n)
    allowed = allowed_positions(weights, mask)
    return _largest_allowed(weights.to(torch.float64), allowed, n)


def random_selection(allowed: Tensor, n: int, generator: torch.Generator | None = None) -> Tensor:
    """A uniformly random subset of ``min(n, allowed count)`` allowed positions per row.

    Args:
        allowed: bool tensor ``(..., Lk)``, True where a position may be chosen.
        n: set size, >= 1.
        generator: random generator (CPU), for reproducible draws.

    Returns:
        Bool tensor shaped like ``allowed``.
    """
    _check_n(n)
    if not isinstance(allowed, Tensor) or allowed.dtype != torch.bool:
        kind = allowed.dtype if isinstance(allowed, Tensor) else type(allowed).__name__
        raise TypeError(f"allowed must be a bool tensor, got {kind}")
    keys = torch.rand(allowed.shape, generator=generator, dtype=torch.float64).to(allowed.device)
    return _largest_allowed(keys, allowed, n)


def weighted_distances(weights: Tensor, vectors: Tensor, selected: Tensor, mask: Mask = None) -> Tensor:
    """Distances ``d_j = ||s - alpha_j x_j||`` of every weighted vector to the selected context vector.

    ``s = sum_{i in selected} alpha_i x_i``.  Computed as written, ``s - alpha_j x_j`` in float64, a
    block of query rows at a time (at most :data:`DISTANCE_BLOCK` elements of the ``(Lq, Lk, D)``
    differences at once).  The expansion ``||s||^2 - 2 alpha_j s.x_j + alpha_j^2 ||x_j||^2`` needs no
    such block but cancels where ``alpha_j x_j`` is close to ``s``: a relative error of 1e-4 in
    float64 there, enough to flip :func:`separable_fraction` on nearly tied tokens.

    Args:
        weights: attention weights ``(..., Lq, Lk)``.
        vectors: the mixed vectors ``(..., Lk, D)``, broadcastable over the leading dims.
        selected: bool ``(..., Lq, Lk)``, the set ``I`` of each row.
        mask: allowed positions; masked positions count as weight 0.

    Returns:
        Float64 tensor ``(..., Lq, Lk)``.
    """
    _check_shapes(weights, vectors)
    allowed = allowed_positions(weights, mask)
    alpha = weights.to(torch.float64).masked_fill(~allowed, 0.0)
    x = vectors.to(torch.float64)
    context = alpha.masked_fill(~selected, 0.0) @ x  # (..., Lq, D)
    lead = torch.broadcast_shapes(alpha.shape[:-2], x.shape[:-2])
    lq, lk, dim = alpha.shape[-2], alpha.shape[-1], x.shape[-1]
    rows = max(1, DISTANCE_BLOCK // max(1, math.prod(lead) * lk * dim))
    blocks = []
    for start in range(0, lq, rows):
        s = context[..., start : start + rows, None, :]  # (..., rows, 1, D)
        weighted = alpha[..., start : start + rows, :, None] * x.unsqueeze(-3)  # (..., rows, Lk, D)
        blocks.append(torch.linalg.vector_norm(s - weighted, dim=-1))
    if not blocks:
        return alpha.new_zeros(*lead, lq, lk)
    return torch.cat(blocks, dim=-2)


def _mean_over(values: Tensor, positions: Tensor) -> Tensor:
    count = positions.sum(-1)
    total = values.masked_fill(~positions, 0.0).sum(-1)
    return torch.where(count > 0, total / count.clamp_min(1), torch.nan)


def selection_distance(weights: Tensor, vectors: Tensor, n: int, mask: Mask = None) -> Tensor:
    """Theorem 1's distance for the top-N set: mean over non-selected ``j`` of ``||s - alpha_j x_j||``.

    Args:
        weights: attention weights ``(..., Lq, Lk)``.
        vectors: the mixed vectors ``(..., Lk, D)``.
        n: size of the selected set, >= 1.
        mask: allowed positions.

    Returns:
        Float64 tensor ``(..., Lq)``; NaN for rows with no non-selected allowed position.
    """
    allowed = allowed_positions(weights, mask)
    selected = top_n_selection(weights, n, allowed)
    distances = weighted_distances(weights, vectors, selected, allowed)
    return _mean_over(distances, allowed & ~selected)


def random_selection_distance(
    weights: Tensor,
    vectors: Tensor,
    n: int,
    mask: Mask = None,
    samples: int = 16,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Monte-Carlo expectation of :func:`selection_distance` when the N-set is uniformly random.

    Each of ``samples`` draws picks a uniform random subset of ``min(n, allowed)``
    allowed positions per row and averages ``||s - alpha_j x_j||`` over the others.

    Args:
        weights: attention weights ``(..., Lq, Lk)``.
        vectors: the mixed vectors ``(..., Lk, D)``.
        n: size of the selected set, >= 1.
        mask: allowed positions.
        samples: number of random sets drawn per row, >= 1.
        generator: random generator (CPU), for reproducible draws.

    Returns:
        Float64 tensor ``(..., Lq)``; NaN for rows with no non-selected allowed position.

    Raises:
        ValueError: ``samples`` < 1.
    """
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise ValueError(f"samples must be an int >= 1, got {samples!r}")
    allowed = allowed_positions(weights, mask)
    total = torch.zeros(weights.shape[:-1], dtype=torch.float64, device=weights.device)
    for _ in range(samples):
        selected = random_selection(allowed, n, generator)
        distances = weighted_distances(weights, vectors, selected, allowed)
        total = total + _mean_over(distances, allowed & ~selected)
    return total / samples


def separable_fraction(weights: Tensor, vectors: Tensor, n: int, mask: Mask = None, normalize: bool = True) -> Tensor:
    """Theorem 2's separable fraction ``N_s / N`` of the top-N set.

    With ``r = min_{j not in I} ||s - alpha_j x_j||``, selected ``i`` is separable when
    ``||s - alpha_i x_i|| < r``.

    Args:
        weights: attention weights ``(..., Lq, Lk)``.
        vectors: the mixed vectors ``(..., Lk, D)``.
        n: size of the selected set, >= 1.
        mask: allowed positions.
        normalize: project the vectors onto the unit sphere first (the theorem's setting);
            zero vectors stay zero.

    Returns:
        Float64 tensor ``(..., Lq)`` in [0, 1]; NaN for rows with no non-selected allowed position.
    """
    x = vectors.to(torch.float64)
    if normalize:
        norms = x.norm(dim=-1, keepdim=True)
        x = x / torch.where(norms > 0, norms, 1.0)
    allowed = allowed_positions(weights, mask)
    selected = top_n_selection(weights, n, allowed)
    distances = weighted_distances(weights, x, selected, allowed)
    others = allowed & ~selected
    radius = distances.masked_fill(~others, torch.inf).amin(-1, keepdim=True)
    separable = (selected & (distances < radius)).sum(-1)
    size = selected.sum(-1)
    valid = others.any(-1) & (size > 0)
    return torch.where(valid, separable / size.clamp_min(1), torch.nan)
