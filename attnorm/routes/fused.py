"""Fused route: flash-style Triton attention kernels, nothing of size ``Lq x Lk`` in memory.

============================ ================================= =======================================
normalizer                   kernel                            parameters taken
============================ ================================= =======================================
Sparsemax, Entmax            ``attention_entmax``              alpha in [1, 2] as a number; learnable
                                                               alpha (per head or shared)
SelfAdjustedSoftmax          ``attention_self_adjusted``       both variants
============================ ================================= =======================================

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
from attnorm.routes.common import kernel_mask

__all__ = ["attention", "supports"]

_FAMILIES = ("sparsemax", "entmax", "self_adjusted_softmax")


def supports(normalizer, q: Tensor, k: Tensor, v: Tensor, dropout_p: float, additive: Tensor | None) -> bool:
    """True when a fused kernel computes ``normalizer``'s attention for these inputs."""
    kernel = getattr(normalizer, "kernel", None)
    if kernel not in _FAMILIES or dropout_p > 0 or q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        return False
    if additive is not None and additive.requires_grad:
        return False
    requested = normalizer.backend if normalizer.backend is not None else backends.get_backend()
    if requested == "triton":
        backends.resolve("triton", q.device)  # asked for by name: a clear error when it cannot run
    elif not (requested == "auto" and q.device.type == "cuda" and backends.triton_installed()):
        return False
    if kernel == "entmax":
        alpha = normalizer.kernel_params()["alpha"]
        if isinstance(alpha, Tensor):
            return normalizer.learnable and alpha.numel() in (1, q.shape[1])
        return 1 <= alpha <= 2
    return True


def attention(normalizer, q: Tensor, k: Tensor, v: Tensor, mask, additive: Tensor | None, scale: float) -> Tensor:
    """The fused kernel's attention; call only when :func:`supports` says so."""
    kernel_masks = kernel_mask(mask, additive, q, k.shape[-2])
    if normalizer.kernel == "self_adjusted_softmax":
        return attention_ops.self_adjusted_attention(q, k, v, kernel_masks, scale, normalizer.normalized)
    if normalizer.kernel == "sparsemax":
        return attention_ops.entmax_attention(q, k, v, kernel_masks, scale, 2.0)
    alpha = normalizer.kernel_params()["alpha"]
    if isinstance(alpha, Tensor):  # learnable: in (1, 2) by construction
        return attention_ops.entmax_attention(q, k, v, kernel_masks, scale, 1.5, alpha.reshape(-1).expand(q.shape[1]))
    return attention_ops.entmax_attention(q, k, v, kernel_masks, scale, float(alpha))
