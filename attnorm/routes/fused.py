"""Fused route: flash-style Triton attention kernels, nothing of size ``Lq x Lk`` in memory.

============================ ================================= =======================================
normalizer                   kernel                            parameters taken
============================ ================================= =======================================
Sparsemax, Entmax            ``attention_entmax``              alpha in [1, 2] as a number; learnable
                                                               alpha (per head or shared)
SelfAdjustedSoftmax          ``attention_self_adjusted``       both variants
TopKSoftmax                  ``attention_topk``                k (count or fraction), a number T
============================ ================================= =======================================

Softmax with temperature and Scalable-Softmax take the fused entmax kernel at alpha = 1
(exact softmax, the multiplier folded into ``q`` as on the SDPA route) when their mask
is structured but has no SDPA form (sliding window, documents, causal with key
padding, other diagonals): SDPA would need a bool mask as big as the scores, the
kernel reads the per-row key intervals and skips the blocks they exclude.

Taken when the normalizer resolves to the ``triton`` backend for ``q``'s device
(``"auto"`` on CUDA with triton installed, or ``backend="triton"``, which on CPU runs
the interpreter) and the inputs are ``(B, H, L, D)``.  Not taken, so the blocked
route runs instead: dropout (not fused), an additive mask that requires grad (the
kernels give no gradient for it), fixed per-head alpha tensors (their values would
have to be read to check they lie in [1, 2]) and alphas above 2.
"""

from __future__ import annotations

from torch import Tensor

from attnorm.kernels import attention_ops, backends
from attnorm.masks import StructuredMask
from attnorm.routes.common import kernel_mask
from attnorm.routes.sdpa import Multiplier, sdpa_mask_kind

__all__ = ["attention", "scaled_softmax", "supports", "supports_scaled_softmax"]

_FAMILIES = ("sparsemax", "entmax", "self_adjusted_softmax", "topk_softmax")


def supports(normalizer, q: Tensor, k: Tensor, v: Tensor, dropout_p: float, additive: Tensor | None) -> bool:
    """True when a fused kernel computes ``normalizer``'s attention for these inputs."""
    kernel = getattr(normalizer, "kernel", None)
    if kernel not in _FAMILIES or dropout_p > 0 or q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        return False
    if additive is not None and additive.requires_grad or not _runs_triton(normalizer, q):
        return False
    if kernel == "entmax":
        alpha = normalizer.kernel_params()["alpha"]
        if isinstance(alpha, Tensor):
            return normalizer.learnable and alpha.numel() in (1, q.shape[1])
        return 1 <= alpha <= 2
    if kernel == "topk_softmax":
        return not isinstance(normalizer.kernel_params()["temperature"], Tensor)
    return True


def attention(normalizer, q: Tensor, k: Tensor, v: Tensor, mask, additive: Tensor | None, scale: float) -> Tensor:
    """The fused kernel's attention; call only when :func:`supports` says so."""
    kernel_masks = kernel_mask(mask, additive, q, k.shape[-2])
    if normalizer.kernel == "self_adjusted_softmax":
        return attention_ops.self_adjusted_attention(q, k, v, kernel_masks, scale, normalizer.normalized)
    if normalizer.kernel == "topk_softmax":
        params = normalizer.kernel_params()
        return attention_ops.topk_attention(q, k, v, kernel_masks, scale, params["k"], params["temperature"])
    if normalizer.kernel == "sparsemax":
        return attention_ops.entmax_attention(q, k, v, kernel_masks, scale, 2.0)
    alpha = normalizer.kernel_params()["alpha"]
    if isinstance(alpha, Tensor):  # learnable: in (1, 2) by construction
        return attention_ops.entmax_attention(q, k, v, kernel_masks, scale, 1.5, alpha.reshape(-1).expand(q.shape[1]))
    return attention_ops.entmax_attention(q, k, v, kernel_masks, scale, float(alpha))


def supports_scaled_softmax(normalizer, mask, q: Tensor, k: Tensor, v: Tensor, dropout_p: float) -> bool:
    """True when a logit scaling should run on the fused kernel rather than SDPA with a built mask."""
    return (
        isinstance(mask, StructuredMask) and dropout_p == 0 and q.ndim == k.ndim == v.ndim == 4
        and sdpa_mask_kind(mask, q.shape[-2], k.shape[-2]) == "dense" and _runs_triton(normalizer, q)
    )


def scaled_softmax(q: Tensor, k: Tensor, v: Tensor, multiplier: Multiplier, mask, scale: float) -> Tensor:
    """``softmax(multiplier * scale q k^T) v`` under a structured mask, on the fused kernel at alpha = 1."""
    if isinstance(multiplier, Tensor):
        q = (q * multiplier).to(q.dtype)  # gradients of s and bias flow through the scaled queries
    else:
        scale *= multiplier
    return attention_ops.entmax_attention(q, k, v, kernel_mask(mask, None, q, k.shape[-2]), scale, 1.0)


def _runs_triton(normalizer, q: Tensor) -> bool:
    """True when ``normalizer``'s backend resolves to Triton for ``q``'s device."""
    requested = normalizer.backend if normalizer.backend is not None else backends.get_backend()
    if requested == "triton":
        backends.resolve("triton", q.device)  # asked for by name: a clear error when it cannot run
        return True
    return requested == "auto" and q.device.type == "cuda" and backends.triton_installed()
