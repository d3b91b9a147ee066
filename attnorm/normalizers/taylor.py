"""Taylor-softmax: exp replaced by its Taylor polynomial of even order n (Mongaras & Larson, arXiv 2507.23632)."""

from __future__ import annotations

from dataclasses import fields

import torch
from torch import Tensor

from attnorm.kernels.reference.ratio import log_taylor_exp
from attnorm.kernels.reference.taylor import taylor_linear_causal
from attnorm.masks import StructuredMask
from attnorm.normalizers.base import Checked
from attnorm.normalizers.normalized import _LogRatio
from attnorm.normalizers.registry import register_normalizer

__all__ = ["TaylorSoftmax"]


def _check_order(n: int) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n (the Taylor order) must be an int >= 0, got {n!r}")
    if n % 2:
        raise ValueError(
            f"n (the Taylor order) must be even, got {n}: an odd-order polynomial of exp has a real root, so weights "
            "change sign and a row's denominator can vanish"
        )
    return n


def _check_chunk(chunk: int) -> int:
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be an int >= 1, got {chunk!r}")
    return chunk


def _plain_causal(mask) -> bool:
    """True for exactly ``causal_mask()`` (top-left aligned, nothing else set)."""
    if not isinstance(mask, StructuredMask) or mask.causal_diagonal != 0:
        return False
    return all(getattr(mask, field.name) is None for field in fields(mask) if field.name != "causal_diagonal")


class TaylorSoftmax(_LogRatio):
    """``a_i = T_n(x_i) / sum_j T_n(x_j)``, ``T_n(x) = sum_{m <= n} x^m / m!``, over the allowed positions.

    Mongaras & Larson (arXiv 2507.23632) expand softmax attention's ``exp(q.k)`` as a Taylor
    series; truncated at order ``n`` it is a sum of ``n + 1`` linear-attention RNNs.  ``n`` must
    be even: ``T_n > 0`` then (its minimum is ``1/2`` at ``x = -1`` for ``n = 2``), so weights are
    positive and rows with an allowed position sum to 1.  ``T_n`` is not shift-invariant and
    grows at ``-inf``: scores are used as given (no max subtraction), masked keys are excluded
    rather than sent to a large negative score, and a -inf score counts as masked.  An additive
    float mask given to :func:`attnorm.attention` is converted: entries that are -inf or below
    half the dtype's lowest value exclude the key, other entries are added to the scores.

    ``linear=True`` (``n`` <= 2) makes :func:`attnorm.attention` use the linear-time causal form
    (:func:`attnorm.kernels.reference.taylor.taylor_linear_causal`) when the mask is exactly the
    causal one (``is_causal=True``), no weights are returned and dropout is 0; any other call
    takes the quadratic route.  Lemma 2: ``(log T_2)'(x) = 2(1 + x) / ((1 + x)^2 + 1)`` lies in
    [-1, 1], so the Jacobian's spectral norm is at most 1/2, as softmax's at T = 1.

    Args:
        n: the even Taylor order (``taylor:n=2``); 0 is the uniform average.
        linear: use the linear-time causal form inside :func:`attnorm.attention` where it applies.
        chunk: queries per chunk of the linear-time scan.
        dim: axis to normalise over.

    Raises:
        ValueError: odd or negative ``n``; ``linear=True`` with ``n > 2``.
    """

    n = Checked(_check_order)
    chunk = Checked(_check_chunk)

    def __init__(self, n: int = 2, linear: bool = False, chunk: int = 64, dim: int = -1,
                 backend: str | None = None) -> None:
        super().__init__(dim, backend)
        self.n = n
        if not isinstance(linear, bool):
            raise TypeError(f"linear must be a bool, got {linear!r}")
        if linear and n > 2:
            raise ValueError(f"the linear-time form exists for n <= 2 (a D^n-sized state), got linear=True with n={n}")
        self.linear = linear
        self.chunk = chunk

    def log_f(self, x: Tensor) -> Tensor:
        return log_taylor_exp(self.n)(x)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, *, mask, additive: Tensor | None, scale: float,
               dropout_p: float, groups: int, return_weights: bool):
        """The route :func:`attnorm.attention` takes first: the linear causal form, or an additive mask converted.

        Returns ``NotImplemented`` (attention's own quadratic route) for any other call.
        """
        if additive is not None:
            return self._attend_excluding(q, k, v, mask, additive, scale, dropout_p, groups, return_weights)
        if not (self.linear and self.n <= 2 and _plain_causal(mask) and not return_weights and dropout_p == 0
                and q.shape[-2] == k.shape[-2]):
            return NotImplemented
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=-3), v.repeat_interleave(groups, dim=-3)
        return taylor_linear_causal(q, k, v, scale, self.n, self.chunk)

    def _attend_excluding(self, q, k, v, mask, additive, scale, dropout_p, groups, return_weights):
        """Quadratic attention with an additive mask: very negative entries exclude keys, the rest add to scores."""
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=-3), v.repeat_interleave(groups, dim=-3)
        lowest = torch.finfo(additive.dtype).min / 2 if additive.dtype.is_floating_point else None
        if lowest is None:
            raise TypeError(f"an additive attn_mask must be a float tensor, got {additive.dtype}")
        excluded = additive <= lowest  # -inf too
        scores = torch.matmul(q, k.transpose(-2, -1)).mul_(scale)
        scores = (scores + torch.where(excluded, 0.0, additive)).to(scores.dtype)  # a float32 mask on half scores
        keep = ~excluded
        if mask is not None:
            keep = keep & (mask.materialize(scores.shape, scores.device) if isinstance(mask, StructuredMask) else mask)
        weights = self(scores, keep)
        attended = torch.nn.functional.dropout(weights, dropout_p) if dropout_p > 0 else weights
        out = torch.matmul(attended, v)
        return (out, weights) if return_weights else out

    def _repr_fields(self) -> dict:
        return {"n": self.n, "linear": self.linear}


register_normalizer("taylor", TaylorSoftmax, aliases=("taylor_softmax",))
