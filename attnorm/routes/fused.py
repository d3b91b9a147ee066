"""Fused route: flash-style Triton attention kernels, nothing of size ``Lq x Lk`` in memory.

============================ ============================ ================================== ===============
normalizer                   kernel                       parameters taken                   softcap, sinks
============================ ============================ ================================== ===============
Sparsemax, Entmax            ``attention_entmax``         alpha in [1, 2] as a number;       yes
                                                          learnable alpha (per head or
                                                          shared)
Softmax (temperature),       ``attention_entmax`` at      T; s and bias (numbers, per head,  yes
ScalableSoftmax              alpha = 1                    learnable)
SelfAdjustedSoftmax          ``attention_self_adjusted``  both variants                      yes
TopKSoftmax                  ``attention_topk``           k (count or fraction), a number T  yes
============================ ============================ ================================== ===============

Softmax with temperature and Scalable-Softmax (a logit multiplier ``c`` per row) take the
fused entmax kernel at alpha = 1 (exact softmax) in two cases: when their mask is
structured but has no SDPA form (sliding window, documents, causal with key padding,
other diagonals: SDPA would need a bool mask as big as the scores, the kernel reads
the per-row key intervals and skips the blocks they exclude), ``c`` folded into ``q`` or
``scale`` as on the SDPA route; and with softcap or sinks, which SDPA lacks, under any
mask but an additive one for Scalable-Softmax (its ``n`` would count the keys the
additive mask leaves finite).  The cap comes before ``c``, so with softcap or an additive
mask ``c`` is not folded into ``q`` but given to the kernel as a per-row logit multiplier
applied after the cap and the mask, whose gradient the kernel returns per row; each
sink's logit is ``c sinks[h]``, computed in torch, so ``c``'s path through the sink is
plain autograd.

Softcap and sinks (:mod:`attnorm.kernels.triton.attention_blocks`): the cap is applied to
each recomputed score tile; a sink is one more always-allowed key per row, of value
zero, in the kernel's normaliser (not counted in Scalable-Softmax's ``n``), whose
score gradient the backward returns per row and torch sums over batch and rows.

Taken when the normalizer resolves to the ``triton`` backend for ``q``'s device
(``"auto"`` on CUDA with triton installed, or ``backend="triton"``, which on CPU runs
the interpreter) and the inputs are ``(B, H, L, D)``.  Not taken, so the blocked
route runs instead: dropout (not fused), an additive mask that requires grad (the
kernels give no gradient for it), fixed per-head alpha tensors (their values would
have to be read to check they lie in [1, 2]) and alphas above 2.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from attnorm.kernels import attention_ops, backends, rules
from attnorm.masks import StructuredMask
from attnorm.routes.common import kernel_mask
from attnorm.routes.sdpa import Multiplier, sdpa_mask_kind

__all__ = ["attention", "scaled_softmax", "supports", "supports_scaled_softmax"]

_FAMILIES = ("sparsemax", "entmax", "self_adjusted_softmax", "topk_softmax")


def supports(normalizer, q: Tensor, k: Tensor, v: Tensor, dropout_p: float, additive: Tensor | None) -> bool:
    """True when a fused kernel computes ``normalizer``'s attention for these inputs (softcap and sinks included)."""
    kernel = getattr(normalizer, "kernel", None)
    if kernel not in _FAMILIES or dropout_p > 0 or q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        return False
    if additive is not None and additive.requires_grad or not _runs_triton(normalizer, q):
        return False
    if kernel == "entmax":
        alpha = normalizer.kernel_params()["alpha"]
        if isinstance(alpha, Tensor):
            return normalizer.learnable and alpha.numel() in (1, q.shape[1])
        # Just above 1 the fused kernel's float32 weights are far off (a few 1e-2 at 1 + 1e-7): the row
        # kernels compute such rows in float64 (rules.NEAR_SOFTMAX).
        near_softmax = 1 < alpha < rules.NEAR_SOFTMAX and q.dtype != torch.float64
        return 1 <= alpha <= 2 and not near_softmax
    if kernel == "topk_softmax":
        return not isinstance(normalizer.kernel_params()["temperature"], Tensor)
    if kernel == "self_adjusted_softmax":
        return not (normalizer.normalized and additive is not None and q.device.type == "cuda"
                    and not _triton_handles_normalized_additive_self_adjusted())
    return True


@functools.cache
def _triton_handles_normalized_additive_self_adjusted() -> bool:
    """False for Triton before 3.9, where the normalized Self-Adjusted backward with an additive mask is broken.

    Seen with Triton 3.6 on GPUs, 2026-11-26: in float64 it does not compile (``PassManager::run failed``
    in ``TritonGPURemoveLayoutConversions``, on an H100, at every block and head-dim tile tried, reproduced
    offline with ``scripts/compile_check.py``); in float32 it compiles and returns a wrong dk on an H200
    (the kernel test ``test_every_mask_kind_matches_reference[additive-normalized]``: errors up to 0.42,
    while the same kernels with interval or dense masks, and the plain variant, pass).  bfloat16 and float16
    were not tested there with an additive mask, so they are routed around too.  Triton 3.9 compiles every
    variant (its numbers on a GPU are not measured).  Those calls take the blocked route instead.

    The wrong float32 dk is likely not Triton's: the same symptom in candidate-buffer top-k (dk 2.5 off
    under an additive mask on an H200, 2026-11-28) came from ``scale q k + additive`` contracted into an
    fma in some kernels and not others, so the backward's recomputed scores were an ulp off the
    forward's min and max; :func:`attnorm.kernels.triton.attention_blocks.score_tile_slope` now writes
    that fma itself.  This route stays until a GPU run of the test above passes with it lifted."""
    import triton

    return tuple(int(part) for part in triton.__version__.split(".")[:2]) >= (3, 9)


def attention(normalizer, q: Tensor, k: Tensor, v: Tensor, mask, additive: Tensor | None, scale: float,
              softcap: float | None = None, sinks: Tensor | None = None) -> Tensor:
    """The fused kernel's attention; call only when :func:`supports` says so."""
    kernel_masks = kernel_mask(mask, additive, q, k.shape[-2])
    sinks = None if sinks is None else sinks.reshape(-1, 1)  # (Hq, 1): one sink logit per head, every row
    if normalizer.kernel == "self_adjusted_softmax":
        return attention_ops.self_adjusted_attention(q, k, v, kernel_masks, scale, normalizer.normalized, softcap,
                                                     sinks)
    if normalizer.kernel == "topk_softmax":
        params = normalizer.kernel_params()
        return attention_ops.topk_attention(q, k, v, kernel_masks, scale, params["k"], params["temperature"], softcap,
                                            sinks)
    if normalizer.kernel == "sparsemax":
        return attention_ops.entmax_attention(q, k, v, kernel_masks, scale, 2.0, None, softcap, sinks)
    alpha = normalizer.kernel_params()["alpha"]
    if isinstance(alpha, Tensor):  # learnable: in (1, 2) by construction
        alpha_heads = alpha.reshape(-1).expand(q.shape[1])
        return attention_ops.entmax_attention(q, k, v, kernel_masks, scale, 1.5, alpha_heads, softcap, sinks)
    return attention_ops.entmax_attention(q, k, v, kernel_masks, scale, float(alpha), None, softcap, sinks)


def supports_scaled_softmax(normalizer, mask, q: Tensor, k: Tensor, v: Tensor, dropout_p: float,
                            additive: Tensor | None = None, modified: bool = False) -> bool:
    """True when a logit scaling should run on the fused kernel rather than SDPA.

    Unmodified, only under a structured mask SDPA would need as a dense bool mask;
    with softcap or sinks (``modified``), which SDPA cannot apply, whenever Triton runs.
    """
    if dropout_p > 0 or q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        return False
    if modified:
        return (additive is None or not additive.requires_grad) and _runs_triton(normalizer, q)
    return (isinstance(mask, StructuredMask) and sdpa_mask_kind(mask, q.shape[-2], k.shape[-2]) == "dense"
            and _runs_triton(normalizer, q))


def scaled_softmax(q: Tensor, k: Tensor, v: Tensor, multiplier: Multiplier, mask, scale: float,
                   additive: Tensor | None = None, softcap: float | None = None, sinks: Tensor | None = None) -> Tensor:
    """``softmax(c (cap(scale q k^T) + additive) | c sinks) v`` on the fused kernel at alpha = 1.

    ``c`` is ``multiplier``: a number, or a tensor broadcastable to ``(B, Hq, Lq, 1)``.  Without
    softcap and additive mask ``c`` is folded into ``scale`` or ``q`` (``c q k^T = (c q) k^T``,
    gradients of ``s`` and ``bias`` flowing through the scaled queries); otherwise it must
    come after the cap and the additive mask, so the kernel multiplies each row's logits
    by it (``logit_scale``) and returns its gradient.  A sink's logit is ``c sinks[h]``.
    """
    rows = None
    if isinstance(multiplier, Tensor):  # (..., 1) -> (B | 1, Hq | 1, Lq | 1) or fewer dims; 0-dim: one for all
        rows = multiplier.squeeze(-1) if multiplier.ndim else multiplier
    sink_logits = None
    if sinks is not None:
        # In the precision the kernel computes in: c sinks[h] in bfloat16 put a logit of 86.25 at 86.0.
        wide = sinks.reshape(-1, 1).to(torch.promote_types(rules.accumulation_dtype(q.dtype), sinks.dtype))
        sink_logits = wide * (multiplier if rows is None else rows)
    kernel_masks = kernel_mask(mask, additive, q, k.shape[-2])
    if softcap is None and additive is None:
        if rows is not None:
            q = (q * multiplier).to(q.dtype)
        else:
            scale *= multiplier
        return attention_ops.entmax_attention(q, k, v, kernel_masks, scale, 1.0, None, None, sink_logits)
    if rows is None:
        rows = torch.full((1,), float(multiplier), dtype=torch.float64, device=q.device)
    return attention_ops.entmax_attention(q, k, v, kernel_masks, scale, 1.0, None, softcap, sink_logits, rows)


def _runs_triton(normalizer, q: Tensor) -> bool:
    """True when ``normalizer``'s backend resolves to Triton for ``q``'s device."""
    requested = normalizer.backend if normalizer.backend is not None else backends.get_backend()
    if requested == "triton":
        backends.resolve("triton", q.device)  # asked for by name: a clear error when it cannot run
        return True
    return requested == "auto" and q.device.type == "cuda" and backends.triton_installed()
