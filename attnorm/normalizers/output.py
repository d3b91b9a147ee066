"""Output normalizers: attention whose normalisation acts on the output, not on the scores.

A :class:`~attnorm.Normalizer` maps scores to weights.  An :class:`OutputNormalizer` cannot:
its weights depend on the values.  It owns the whole attention call through ``attend``,
the route :func:`attnorm.attention` takes first for any module that has one, and it is
built by :func:`attnorm.make` like any normalizer (registered as a kind with
:func:`~attnorm.normalizers.registry.register_kind`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from attnorm.masks import StructuredMask
from attnorm.normalizers.base import incoming_state
from attnorm.normalizers.registry import register_kind, register_normalizer
from attnorm.validation import check_finite

__all__ = ["L2NormAttention", "OutputNormalizer"]


class OutputNormalizer(nn.Module):
    """Base class: attention computed and normalised as a whole, ``attend(q, k, v, ...)``.

    ``forward(q, k, v, **options)`` is :func:`attnorm.attention` with this module, so an
    output normalizer is used like ``scaled_dot_product_attention``.  Subclasses implement
    :meth:`attend` with the arguments :func:`attnorm.attention` passes (masks already split,
    ``scale`` resolved, ``groups`` query heads per key head).
    """

    dim = -1  # attention normalises over the keys

    def attend(self, q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | StructuredMask | None,
               additive: Tensor | None, scale: float, dropout_p: float, groups: int, return_weights: bool):
        """``out (..., Hq, Lq, Dv)``, or ``(out, weights (..., Hq, Lq, Lk))`` with ``return_weights``."""
        raise NotImplementedError

    def forward(self, q: Tensor, k: Tensor, v: Tensor, **options) -> Tensor | tuple[Tensor, Tensor]:
        from attnorm.attention import attention  # attention imports the normalizers

        return attention(q, k, v, self, **options)

    def check_state(self, state: dict[str, Tensor]) -> None:
        """Raise ``ValueError`` if a value about to be loaded (by name) is invalid."""

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        # As the row normalizers (Normalizer._load_from_state_dict): checked before anything is copied.
        self.check_state(incoming_state(self, state_dict, prefix))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


class L2NormAttention(OutputNormalizer):
    """L2-normalised attention (Mongaras & Larson, arXiv 2507.23632): ``out_i = N_i / ||N_i||_2``.

    ``N_i = sum_j exp(s_ij) v_j`` over the allowed keys.  Softmax's denominator ``Z_i`` cancels
    in the norm, so ``out_i = o_i / ||o_i||_2`` with ``o`` the softmax (SDPA) output: the same
    speed and memory as SDPA.  A zero ``N_i`` (a fully masked row, zero values) gives a zero
    output; that is the only case guarded, so the identity is exact elsewhere.  Returned
    weights are ``exp(s_ij) / ||N_i||_2 = softmax_ij / ||o_i||_2`` (``out = weights @ v``); they
    depend on ``v`` and do not sum to 1.

    Args:
        heads: number of query heads for a learnable per-head gain ``g_h`` (``out * g_h``);
            None for no gain.
        gain: initial value of the gain.

    Raises:
        ValueError: ``heads`` < 1 or ``gain`` not finite.
    """

    def __init__(self, heads: int | None = None, gain: float = 1.0) -> None:
        super().__init__()
        if heads is not None and (isinstance(heads, bool) or not isinstance(heads, int) or heads < 1):
            raise ValueError(f"heads must be an int >= 1 or None, got {heads!r}")
        if not isinstance(gain, (int, float)) or isinstance(gain, bool) or not abs(gain) < float("inf"):
            raise ValueError(f"gain must be a finite number, got {gain!r}")
        self.heads = heads
        self.gain = None if heads is None else nn.Parameter(torch.full((heads,), float(gain)))

    def check_state(self, state: dict[str, Tensor]) -> None:
        if state.get("gain") is not None:
            check_finite("gain", state["gain"])

    def attend(self, q, k, v, *, mask, additive, scale, dropout_p, groups, return_weights):
        from attnorm.attention import attention

        attn_mask = mask if additive is None else additive
        if mask is not None and additive is not None:
            raise ValueError("give a bool or structured mask, or an additive mask, not both")
        result = attention(q, k, v, "softmax", attn_mask=attn_mask, scale=scale, dropout_p=dropout_p,
                           return_weights=return_weights)
        out, weights = result if return_weights else (result, None)
        squared = out.to(torch.float64 if out.dtype == torch.float64 else torch.float32).square().sum(-1, keepdim=True)
        nonzero = squared > 0
        inverse = torch.where(nonzero, torch.rsqrt(torch.where(nonzero, squared, 1.0)), 0.0)  # 0 where N_i = 0
        if self.gain is not None:
            if out.ndim < 3 or out.shape[-3] != self.heads:
                raise ValueError(f"the gain has {self.heads} heads but the output has shape {tuple(out.shape)}")
            inverse = inverse * self.gain[:, None, None].to(inverse.dtype)
        out = (out * inverse).to(out.dtype)
        if weights is None:
            return out
        return out, (weights * inverse).to(weights.dtype)

    def extra_repr(self) -> str:
        return f"heads={self.heads}" if self.heads is not None else ""


register_kind(OutputNormalizer)
register_normalizer("l2norm", L2NormAttention, aliases=("l2_norm",))
