"""Logit-scaling route: ``softmax(c * (scale q k^T + additive)) v`` in one SDPA call.

Softmax with temperature and Scalable-Softmax are softmax of scores times a
multiplier ``c`` constant along each query row: ``1 / T``, or ``s log n + bias`` with
``n`` the allowed keys of the row (per-head learnable ``s`` included).  A number ``c``
goes into SDPA's ``scale``; a tensor ``c`` (per row or head) is folded into ``q``
(``c q k^T = (c q) k^T``), so gradients of ``s`` and ``bias`` flow through the scaled
``q``.  The mask is passed in the form that keeps SDPA's fast backends eligible:

================================================ ==========================================
mask                                             passed to SDPA as
================================================ ==========================================
none                                             nothing
causal, top-left, ``Lq = Lk``                    ``is_causal=True``
causal, bottom-right (``diagonal = Lk - Lq``)    ``torch.nn.attention.bias.causal_lower_right``
key padding only                                 a bool ``(B, 1, ..., 1, Lk)`` mask
bool / additive tensor                           as given (additive scaled by ``c``)
other structured masks (window, documents,       a bool ``(B | 1, 1, ..., Lq, Lk)`` mask
other diagonals, causal & padding)
================================================ ==========================================

Rows with no allowed key are set to zero (SDPA would give NaN or a uniform row).
"""

from __future__ import annotations

import contextlib
import math
import threading

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from attnorm.kernels.ops import forward_mode, records_grad, watched
from attnorm.kernels.rules import accumulation_dtype, ssmax_multiplier
from attnorm.masks import StructuredMask
from attnorm.normalizers import Normalizer
from attnorm.routes.common import allowed_counts, interval, row_attends

__all__ = ["internal_call", "logit_multiplier", "real_sdpa", "scaled_sdpa", "sdpa_mask_kind"]

_SDPA_HAS_GQA = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 5)

Multiplier = float | Tensor


_INTERNAL = threading.local()


def internal_call() -> bool:
    """Whether the SDPA call being made comes from attnorm's own routes (:func:`real_sdpa`), in this thread.

    :class:`attnorm.override_sdpa` passes such calls through: a route's SDPA call is how attnorm computes
    softmax and Scalable-Softmax, not a model's attention to re-route (an outer block would otherwise apply
    its normalizer to an inner block's softmax, or to an explicit :func:`attnorm.attention` call).
    """
    return getattr(_INTERNAL, "depth", 0) > 0


def real_sdpa(q: Tensor, k: Tensor, v: Tensor, groups: int = 1, **kwargs) -> Tensor:
    """``F.scaled_dot_product_attention(q, k, v, **kwargs)`` with ``groups`` query heads per key/value head
    (``enable_gqa``, or K and V repeated on a torch without it), marked as attnorm's own call while a
    function mode (such as :class:`attnorm.override_sdpa`) is active."""
    if groups > 1:
        if _SDPA_HAS_GQA:
            kwargs["enable_gqa"] = True
        else:
            k, v = k.repeat_interleave(groups, dim=-3), v.repeat_interleave(groups, dim=-3)
    if not torch._C._is_torch_function_mode_enabled():
        return F.scaled_dot_product_attention(q, k, v, **kwargs)
    _INTERNAL.depth = getattr(_INTERNAL, "depth", 0) + 1
    try:
        return F.scaled_dot_product_attention(q, k, v, **kwargs)
    finally:
        _INTERNAL.depth -= 1


def logit_multiplier(normalizer: Normalizer, mask, additive: Tensor | None, q: Tensor, lk: int) -> Multiplier | None:
    """The per-row logit multiplier ``c`` when ``normalizer`` is a pure logit scaling, else None."""
    kernel = getattr(normalizer, "kernel", None)
    if kernel not in ("softmax", "scalable_softmax"):
        return None
    params = normalizer.kernel_params()
    if kernel == "softmax":
        return 1 / params["temperature"]
    if additive is not None:  # n would count the keys the additive mask leaves finite: not a mask SDPA takes
        return None
    compute_dtype = accumulation_dtype(q.dtype)
    # Learnable s and bias are float32 parameters: widened first, since a 0-d count does not promote them.
    s, bias = (value.to(compute_dtype) if isinstance(value, Tensor) else value
               for value in (params["s"], params["bias"]))
    if sdpa_mask_kind(mask, q.shape[-2], lk) == "none":
        # Every key allowed (a decoding step's causal mask too): n = Lk, and log n a number.  A count tensor
        # made from a Python number would be a host-to-device copy, which waits for the GPU's queued work on
        # every call (a decoding step's learnable Scalable-Softmax was 1.21x SDPA at 64k keys on an H200 with
        # it, where a number multiplier is 1.00x).
        if isinstance(s, Tensor) and isinstance(bias, Tensor):  # learnable: bias + log(n) s in one launch
            return torch.add(bias, s, alpha=math.log(max(lk, 1)))
        return s * math.log(max(lk, 1)) + bias
    return ssmax_multiplier(allowed_counts(mask, q, lk).to(compute_dtype), s, bias)


def scaled_sdpa(q: Tensor, k: Tensor, v: Tensor, multiplier: Multiplier, mask, additive: Tensor | None,
                scale: float, dropout_p: float, groups: int) -> Tensor:
    """``softmax(multiplier * (scale q k^T + additive)) v`` with one ``scaled_dot_product_attention`` call."""
    lq, lk = q.shape[-2], k.shape[-2]
    attends = row_attends(mask, additive, q, lk)
    recompute = None
    if isinstance(multiplier, Tensor):
        if not records_grad(q, multiplier) and not watched() and not forward_mode():
            # No gradient: one kernel computes c q and rounds it into q's dtype (out=), where the product and
            # the cast were two launches (a decoding step's learnable Scalable-Softmax: 5 ops, now 3)
            q = torch.mul(q, multiplier, out=torch.empty_like(q))
        else:
            unscaled, q = q, (q * multiplier).to(q.dtype)  # (..., Hq, Lq, D): c folded into the queries
            # Not under torch.func's grad/vjp/jacrev, which reject saved-tensor hooks (nor while compiling).
            if (torch.is_grad_enabled() and q.requires_grad and not torch.compiler.is_compiling()
                    and not torch._C._are_functorch_transforms_active()):
                recompute = _RecomputedQueries(q, unscaled, multiplier)
    else:
        scale *= multiplier
    if scale == 0:
        # SDPA's kernels give NaN rows at scale 0 under a mask (0 x -inf): the zero goes into q instead.
        q, scale = q * 0.0, 1.0
    elif scale < 0:
        # With is_causal, SDPA's CPU kernel gives NaN rows at a negative scale (its -inf mask times the scale):
        # the sign goes into q instead, exactly.
        q, scale = -q, -scale
    sdpa_mask, is_causal = _sdpa_mask(mask, q, lq, lk)
    if additive is not None:
        # c (scale q k^T + additive): the additive mask is scaled too, its -inf entries kept.
        scaled = additive * multiplier if isinstance(multiplier, Tensor) or multiplier != 1 else additive
        sdpa_mask = torch.where(torch.isneginf(additive), -math.inf, scaled).to(q.dtype)
    # SDPA's fused kernels have no forward-mode derivative; its math backend does.
    with contextlib.nullcontext() if recompute is None else recompute.hooks(), \
            sdpa_kernel(SDPBackend.MATH) if forward_mode() else contextlib.nullcontext():
        out = real_sdpa(q, k, v, groups, attn_mask=sdpa_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale)
    if recompute is not None:
        recompute.scaled = None  # the graph holds the hooks' state: it must not keep c q alive
    return out if attends is None else torch.where(attends, out, 0.0)


class _RecomputedQueries:
    """Saved-tensor hooks that keep SDPA from storing the scaled queries ``c q`` for its backward.

    SDPA saves the ``q`` it is given: with ``c`` folded in, a new query-sized tensor, held
    until the backward beside the ``q`` that the product keeps for ``c``'s gradient
    (learnable ``s``), so a layer would hold two query-sized tensors where softmax holds one.
    The hooks store ``q`` and ``c`` instead and recompute ``c q`` bit for bit (one
    elementwise product) when the backward unpacks it.  Measured on CPU, four causal layers
    of (1, 4, 4096, 64) float32, forward + backward: peak 66.6 MiB without the hooks,
    54.6 MiB with them, 50.3 MiB for plain softmax (the rest is one layer's transient
    ``c q``, in the forward and again in the backward).  Eager only: under
    ``torch.compile`` the compiler decides what to save, and ``torch.func`` transforms
    (``grad``, ``vjp``, ``jacrev``) refuse saved-tensor hooks, so SDPA saves ``c q`` there.
    """

    def __init__(self, scaled: Tensor, queries: Tensor, multiplier: Tensor) -> None:
        self.scaled = scaled
        self.queries, self.multiplier = queries.detach(), multiplier.detach()
        self.versions = (queries._version, multiplier._version)

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: Tensor):
        scaled = self.scaled
        if scaled is not None and (tensor.data_ptr() == scaled.data_ptr() and tensor.shape == scaled.shape
                and tensor.stride() == scaled.stride() and tensor.dtype == scaled.dtype):
            return self
        return tensor

    def _unpack(self, packed):
        if packed is not self:
            return packed
        if (self.queries._version, self.multiplier._version) != self.versions:
            raise RuntimeError("attnorm.attention: q or the Scalable-Softmax multiplier was modified in place "
                               "after the forward; the backward needs their values")
        with torch.no_grad():
            return (self.queries * self.multiplier).to(self.queries.dtype)


def sdpa_mask_kind(mask, lq: int, lk: int) -> str:
    """How SDPA takes the mask: ``"none"``, ``"is_causal"``, ``"lower_right"``, ``"padding"`` or ``"dense"``.

    ``"dense"`` means a bool mask as big as the scores (a user's tensor, or one built
    from a structured mask SDPA has no form for).
    """
    if not isinstance(mask, StructuredMask):
        return "none" if mask is None else "dense"
    diagonal = mask.causal_diagonal
    if mask.row_fields_only and mask.key_lengths is None:
        if diagonal is None or diagonal >= lk - 1:
            return "none"
        if diagonal == 0 and lq == lk:
            return "is_causal"
        if diagonal == lk - lq and lq < lk:
            return "lower_right"
    if mask.row_fields_only and diagonal is None:
        return "padding"
    return "dense"


def _sdpa_mask(mask, q: Tensor, lq: int, lk: int):
    """(SDPA ``attn_mask``, ``is_causal``) for a bool or structured mask (table in the module docstring)."""
    kind = sdpa_mask_kind(mask, lq, lk)
    if kind == "none":
        return None, False
    if kind == "is_causal":
        return None, True
    if kind == "lower_right":
        return causal_lower_right(lq, lk), False
    if not isinstance(mask, StructuredMask):
        return mask, False
    if kind == "padding":
        lengths = mask.key_lengths.to(q.device)
        allowed = torch.arange(lk, device=q.device) < lengths[:, None]  # (B, Lk)
        return allowed.reshape(allowed.shape[0], *([1] * (q.ndim - 2)), lk), False
    start, stop = interval(mask, q, lk)  # (B | 1, 1, ..., Lq, 1)
    keys = torch.arange(lk, device=q.device)
    allowed = keys >= start
    allowed &= keys < stop
    return allowed, False
