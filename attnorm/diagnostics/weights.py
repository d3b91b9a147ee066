"""Statistics of attention weights: entropy, support, effective number of tokens, top-N mass.

Every function takes weights shaped ``(..., Lk)`` (typically ``(B, H, Lq, Lk)``),
normalised over the last axis, and returns one value per row, shape ``(...)``.
``mask`` follows the normalizers' convention: a bool tensor broadcastable to the
weights (True = may attend) or a :class:`attnorm.masks.StructuredMask`.  Masked
positions count as weight 0 and are not counted in ``n``, the number of allowed
positions of a row.  Without a mask every position of the row is allowed.

Entropies are computed in float64 on the row renormalised to sum to 1 (a no-op for
normalizers whose rows sum to 1; needed for Self-Adjusted Softmax, whose rows do
not), with ``0 log 0 = 0``; a row of zeros has entropy 0.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnorm.masks import StructuredMask

__all__ = [
    "allowed_positions",
    "effective_tokens",
    "entropy",
    "normalized_entropy",
    "support_size",
    "top_n_mass",
]

Mask = Tensor | StructuredMask | None


def allowed_positions(weights: Tensor, mask: Mask = None) -> Tensor:
    """The bool mask of allowed positions, expanded to the shape of ``weights``.

    Args:
        weights: attention weights ``(..., Lk)``.
        mask: bool mask broadcastable to ``weights`` (True = allowed), a StructuredMask, or None.

    Returns:
        Bool tensor shaped like ``weights``.

    Raises:
        TypeError: ``mask`` is neither None, a bool tensor nor a StructuredMask.
    """
    if not isinstance(weights, Tensor) or not weights.dtype.is_floating_point:
        kind = weights.dtype if isinstance(weights, Tensor) else type(weights).__name__
        raise TypeError(f"weights must be a floating tensor, got {kind}")
    if mask is None:
        return torch.ones_like(weights, dtype=torch.bool)
    if isinstance(mask, StructuredMask):
        mask = mask.materialize(weights.shape, weights.device)
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
        raise TypeError(f"mask must be a bool tensor, a StructuredMask or None, got {mask!r}")
    try:
        return mask.expand(weights.shape)
    except RuntimeError:
        raise ValueError(f"mask of shape {tuple(mask.shape)} does not broadcast to the weights' "
                         f"{tuple(weights.shape)}") from None


def _masked_distribution(weights: Tensor, mask: Mask) -> tuple[Tensor, Tensor]:
    """Weights in float64 with masked positions zeroed and rows renormalised, and the allowed mask."""
    allowed = allowed_positions(weights, mask)
    masses = weights.to(torch.float64).masked_fill(~allowed, 0.0)
    totals = masses.sum(-1, keepdim=True)
    return masses / torch.where(totals > 0, totals, 1.0), allowed


def entropy(weights: Tensor, mask: Mask = None) -> Tensor:
    """Shannon entropy ``H = -sum_i p_i log p_i`` of each row (nats).

    Args:
        weights: attention weights ``(..., Lk)``.
        mask: allowed positions (see the module docstring).

    Returns:
        Float64 tensor ``(...)``; between 0 and ``log n``.
    """
    probabilities, _ = _masked_distribution(weights, mask)
    terms = torch.where(probabilities > 0, probabilities * probabilities.log(), 0.0)
    return -terms.sum(-1)


def normalized_entropy(weights: Tensor, mask: Mask = None) -> Tensor:
    """Entropy divided by its maximum: ``H / log n`` with n allowed positions per row.

    1 means uniform attention over the allowed positions, 0 a single attended token.
    Rows with ``n <= 1`` give 0.

    Args:
        weights: attention weights ``(..., Lk)``.
        mask: allowed positions (see the module docstring).

    Returns:
        Float64 tensor ``(...)`` in [0, 1].
    """
    allowed = allowed_positions(weights, mask)
    count = allowed.sum(-1).to(torch.float64)
    log_count = torch.where(count > 1, count.log(), 1.0)
    return torch.where(count > 1, entropy(weights, allowed) / log_count, 0.0)


def support_size(weights: Tensor, mask: Mask = None, eps: float = 0.0) -> Tensor:
    """Number of allowed positions whose weight exceeds ``eps``.

    With ``eps = 0`` this is the exact support of sparse normalizers (sparsemax,
    entmax, top-k); softmax rows have full support unless weights underflow, so pass
    e.g. ``eps = 1e-3`` to count the tokens that carry visible weight.

    Args:
        weights: attention weights ``(..., Lk)``.
        mask: allowed positions (see the module docstring).
        eps: threshold, >= 0.

    Returns:
        Int64 tensor ``(...)``.

    Raises:
        ValueError: ``eps`` < 0.
    """
    if not eps >= 0:  # NaN too
        raise ValueError(f"eps must be >= 0, got {eps}")
    allowed = allowed_positions(weights, mask)
    return ((weights > eps) & allowed).sum(-1)


def effective_tokens(weights: Tensor, mask: Mask = None, order: int = 1) -> Tensor:
    """Effective number of attended tokens (Hill number of the row's distribution).

    ``order = 1``: ``exp(H)``, the perplexity of the row (``exp`` of the Shannon entropy).
    ``order = 2``: ``1 / sum_i p_i^2``, the inverse participation ratio.
    Both equal k for a row uniform over k tokens, and ``order = 2 <= order = 1``.

    Args:
        weights: attention weights ``(..., Lk)``.
        mask: allowed positions (see the module docstring).
        order: 1 or 2.

    Returns:
        Float64 tensor ``(...)`` in [1, n] (0 for rows of zeros).

    Raises:
        ValueError: ``order`` not 1 or 2.
    """
    probabilities, _ = _masked_distribution(weights, mask)
    nonzero = probabilities.sum(-1) > 0
    if order == 1:
        return torch.where(nonzero, entropy(weights, mask).exp(), 0.0)
    if order == 2:
        squares = probabilities.square().sum(-1)
        return torch.where(nonzero, 1.0 / torch.where(nonzero, squares, 1.0), 0.0)
    raise ValueError(f"order must be 1 (exp entropy) or 2 (inverse participation ratio), got {order!r}")


def top_n_mass(weights: Tensor, n: int, mask: Mask = None) -> Tensor:
    """Sum of the ``n`` largest allowed weights of each row (all of them if fewer are allowed).

    Args:
        weights: attention weights ``(..., Lk)``.
        n: number of tokens, >= 1.
        mask: allowed positions (see the module docstring).

    Returns:
        Float64 tensor ``(...)``.

    Raises:
        ValueError: ``n`` < 1.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    allowed = allowed_positions(weights, mask)
    scores = weights.to(torch.float64).masked_fill(~allowed, -torch.inf)
    largest = scores.topk(min(n, scores.shape[-1]), dim=-1).values
    return torch.where(torch.isfinite(largest), largest, 0.0).sum(-1)
