"""Linear-time causal attention with the order-2 Taylor expansion of exp (Mongaras & Larson, arXiv 2507.23632).

``1 + s + s^2 / 2`` with ``s = scale q.k`` is the dot product of the feature maps
``phi(x) = [1, x, vec(x (x) x) / sqrt(2)]`` of ``x = sqrt(scale) q`` and ``sqrt(scale) k``
(``D^{-1/4}`` each for the usual ``scale = D^{-1/2}``), so causal Taylor attention is a
recurrence over a state ``S_i = sum_{j <= i} phi(k_j) v_j^T`` of ``(1 + D + D^2) x Dv``
numbers and a normaliser ``z_i = sum_{j <= i} phi(k_j)``:
``out_i = phi(q_i)^T S_i / phi(q_i)^T z_i``.

The scan runs in chunks of C queries: inside a chunk the weights are computed directly
(a C x C causal block), across chunks through the state.  Time ``O(L (D^2 Dv + C (D + Dv)))``,
memory ``O((D^2 + C) (Dv + C))`` per head, one pass over q, k and v.  The denominator is at
least ``(i + 1) / 2`` (``1 + s + s^2 / 2 >= 1/2``), so it never vanishes.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["taylor_features", "taylor_linear_causal"]


def taylor_features(x: Tensor, order: int) -> Tensor:
    """``phi(x)`` with ``phi(q).phi(k) = sum_{m <= order} (q.k)^m / m!`` for ``order`` in {0, 1, 2}: ``(..., F)``."""
    parts = [torch.ones_like(x[..., :1])]
    if order >= 1:
        parts.append(x)
    if order >= 2:
        parts.append((x.unsqueeze(-1) * x.unsqueeze(-2)).flatten(-2) / math.sqrt(2))
    return torch.cat(parts, dim=-1)


def taylor_linear_causal(q: Tensor, k: Tensor, v: Tensor, scale: float, order: int = 2, chunk: int = 64) -> Tensor:
    """Causal (top-left aligned) Taylor attention of ``order`` <= 2 in linear time.

    Args:
        q: queries ``(..., L, D)``.
        k: keys ``(..., L, D)`` (same heads as ``q``).
        v: values ``(..., L, Dv)``.
        scale: score scale, ``s = scale q.k``.
        order: the Taylor order (0 = uniform causal mean, 2 = ``1 + s + s^2/2``).
        chunk: queries per chunk of the scan.

    Returns:
        ``(..., L, Dv)`` in ``q``'s dtype (computed in float32 for half precision).
    """
    dtype = q.dtype
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    root = math.sqrt(scale)
    q, k, v = (q.to(compute) * root), (k.to(compute) * root), v.to(compute)
    length = q.shape[-2]
    features = taylor_features(q[..., :1, :], order).shape[-1]
    state = q.new_zeros(*q.shape[:-2], features, v.shape[-1])  # sum phi(k) v^T over the chunks so far
    normaliser = q.new_zeros(*q.shape[:-2], features, 1)  # sum phi(k)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    outputs = []
    for start in range(0, length, chunk):
        stop = min(start + chunk, length)
        q_rows, k_rows, v_rows = q[..., start:stop, :], k[..., start:stop, :], v[..., start:stop, :]
        phi_q, phi_k = taylor_features(q_rows, order), taylor_features(k_rows, order)
        scores = q_rows @ k_rows.transpose(-2, -1)  # (..., C, C), already scaled
        powers = [torch.ones_like(scores), scores, scores * scores / 2][: order + 1]
        weights = torch.where(causal[: stop - start, : stop - start], sum(powers), 0.0)
        numerator = phi_q @ state + weights @ v_rows
        denominator = phi_q @ normaliser + weights.sum(-1, keepdim=True)
        outputs.append(numerator / denominator)
        state = state + phi_k.transpose(-2, -1) @ v_rows
        normaliser = normaliser + phi_k.sum(-2).unsqueeze(-1)
    return torch.cat(outputs, dim=-2).to(dtype)
