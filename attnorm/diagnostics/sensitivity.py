"""Gradient sensitivity of a normalizer: exact Jacobians and the paper's finite-difference estimate.

Lemma 2 of Mudarisov et al. (arXiv 2508.17821) bounds the Jacobian of
``a = softmax(l / T)`` by a constant times ``1 / T``: sharp attention has steep
gradients.  These functions measure that for any attnorm normalizer (or any
callable mapping scores to weights along the last axis):

* :func:`jacobian`: the exact ``d a_i / d l_k`` of every row, by reverse-mode autograd;
* :func:`jacobian_norms`: its spectral norm and its largest entry;
* :func:`finite_difference_sensitivity`: Algorithm 5's
  ``g(T, eps) = ||a((l + eps v) / T) - a(l / T)|| / eps`` with a random unit direction ``v``.

Temperature enters as a division of the scores, ``a = F(l / T)``, for every
normalizer alike (for :class:`~attnorm.Softmax` that is its own ``temperature``).
Everything runs in float64.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from attnorm.diagnostics.weights import Mask, allowed_positions
from attnorm.normalizers import Normalizer
from attnorm.normalizers.registry import make

__all__ = ["finite_difference_sensitivity", "jacobian", "jacobian_norms", "row_function"]

RowFunction = Callable[[Tensor], Tensor]


def row_function(normalizer: Normalizer | str | RowFunction, mask: Mask = None) -> RowFunction:
    """Turn a normalizer, a spec string (``"entmax:alpha=1.5"``) or a callable into ``scores -> weights``.

    Normalizers (and specs) must normalise over the last axis (their default ``dim=-1``)
    and receive ``mask``; a plain callable is used as it is and cannot take a mask.

    Raises:
        ValueError: a mask given with a plain callable, or a normalizer with ``dim`` other than -1.
        TypeError: ``normalizer`` is none of the accepted kinds.
    """
    if isinstance(normalizer, str):
        normalizer = make(normalizer)
    if isinstance(normalizer, Normalizer):
        if normalizer.dim != -1:
            raise ValueError(f"the normalizer must normalise over the last axis (dim=-1), got dim={normalizer.dim}")
        return lambda scores: normalizer(scores, mask)
    if not callable(normalizer):
        raise TypeError(f"normalizer must be a Normalizer, a spec string or a callable, got {normalizer!r}")
    if mask is not None:
        raise ValueError("a mask can only be passed with a Normalizer or a spec string; bind it into your callable")
    return normalizer


def jacobian(
    normalizer: Normalizer | str | RowFunction, scores: Tensor, mask: Mask = None, max_elements: int = 2**24
) -> Tensor:
    """Exact Jacobian ``J[..., i, k] = d a_i / d l_k`` of each row of ``a = normalizer(l)``.

    Rows are independent, so the scores are stacked once per output position ``i`` and a
    single backward pass with the unit vectors ``e_i`` as output gradients yields every
    Jacobian row at once (in chunks of at most ``max_elements`` stacked scores).
    Masked positions have zero rows and columns.

    Args:
        normalizer: a Normalizer, a spec string or a callable ``scores -> weights`` (last axis).
        scores: logits ``(..., L)``.
        mask: allowed positions, passed to the normalizer.
        max_elements: memory cap on the stacked copies of ``scores`` per backward pass.

    Returns:
        Float64 tensor ``(..., L, L)``.
    """
    logits = scores.detach().to(torch.float64)
    length = logits.shape[-1]
    # A materialised mask broadcasts over the stacking axis; a StructuredMask would not.
    apply = row_function(normalizer, None if mask is None else allowed_positions(logits, mask))
    unit = torch.eye(length, dtype=torch.float64, device=logits.device)
    chunk = max(1, min(length, max_elements // max(logits.numel(), 1)))
    rows = []
    with torch.enable_grad():
        for start in range(0, length, chunk):
            positions = range(start, min(start + chunk, length))
            stacked = logits.expand(len(positions), *logits.shape).clone().requires_grad_(True)
            weights = apply(stacked)
            seeds = unit[start : start + len(positions)].reshape(len(positions), *([1] * (logits.ndim - 1)), length)
            (gradient,) = torch.autograd.grad(weights, stacked, seeds.expand_as(weights), allow_unused=True)
            rows.append(torch.zeros_like(stacked) if gradient is None else gradient)
    return torch.cat(rows).movedim(0, -2)


def jacobian_norms(
    normalizer: Normalizer | str | RowFunction, scores: Tensor, mask: Mask = None
) -> tuple[Tensor, Tensor]:
    """Spectral norm ``||J||_2`` and max-entry norm ``max |J_ik|`` of each row's Jacobian.

    For softmax ``J = (diag(a) - a a^T) / T``: both grow like ``1 / T`` when two or more
    logits tie at the top, and vanish when the row saturates to one token.

    Args:
        normalizer: a Normalizer, a spec string or a callable ``scores -> weights`` (last axis).
        scores: logits ``(..., L)``.
        mask: allowed positions, passed to the normalizer.

    Returns:
        ``(spectral, max_entry)``, float64 tensors of shape ``(...)``.
    """
    matrix = jacobian(normalizer, scores, mask)
    return torch.linalg.matrix_norm(matrix, ord=2), matrix.abs().amax(dim=(-2, -1))


def finite_difference_sensitivity(
    normalizer: Normalizer | str | RowFunction,
    logits: Tensor,
    eps: float,
    temperature: float = 1.0,
    mask: Mask = None,
    generator: torch.Generator | None = None,
    direction: Tensor | None = None,
) -> Tensor:
    """Algorithm 5's finite-difference sensitivity ``g(T, eps) = ||a((l + eps v)/T) - a(l/T)||_2 / eps``.

    ``v`` is a random direction uniform on the unit sphere of the allowed positions of
    each row (a Gaussian vector, masked and normalised), unless ``direction`` is given.
    As ``eps -> 0``, ``g`` tends to ``||J v|| / T`` with ``J`` the Jacobian at ``l / T``.

    Args:
        normalizer: a Normalizer, a spec string or a callable ``scores -> weights`` (last axis).
        logits: ``(..., L)``.
        eps: step size > 0.
        temperature: T > 0, dividing the logits.
        mask: allowed positions, passed to the normalizer.
        generator: random generator (CPU) for ``v``.
        direction: ``(..., L)`` perturbation direction to use instead of a random one (normalised here).

    Returns:
        Float64 tensor ``(...)``.

    Raises:
        ValueError: ``eps`` or ``temperature`` not finite and > 0, ``direction`` not broadcastable to ``logits``.
    """
    if not 0 < eps < math.inf:
        raise ValueError(f"eps must be finite and > 0, got {eps}")
    if not 0 < temperature < math.inf:
        raise ValueError(f"temperature must be finite and > 0, got {temperature}")
    apply = row_function(normalizer, mask)
    base = logits.detach().to(torch.float64)
    allowed = allowed_positions(base, mask) & (base != -math.inf)  # a -inf logit counts as masked
    if direction is not None and direction.shape != base.shape:
        try:
            direction = direction.expand(base.shape)
        except RuntimeError:
            raise ValueError(f"direction of shape {tuple(direction.shape)} does not broadcast to the logits' "
                             f"{tuple(base.shape)}") from None
    if direction is None:
        direction = torch.randn(base.shape, generator=generator, dtype=torch.float64).to(base.device)
    direction = direction.to(torch.float64).masked_fill(~allowed, 0.0)
    norms = direction.norm(dim=-1, keepdim=True)
    direction = direction / torch.where(norms > 0, norms, 1.0)
    with torch.no_grad():
        moved = apply((base + eps * direction) / temperature)
        reference = apply(base / temperature)
    return (moved - reference).norm(dim=-1) / eps
