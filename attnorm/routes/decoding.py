"""Decoding route: a few query rows against a long KV cache, the route chosen per normalizer family.

:func:`attnorm.attention` treats ``q`` with at most ``attnorm.attention.DECODING_ROWS``
rows as decoding.  Three designs read K and V once:

* ``"sdpa"``: the logit scalings (softmax with temperature, Scalable-Softmax) are one
  ``scaled_dot_product_attention`` call (:mod:`.sdpa`), itself flash-decoding on CUDA;
* ``"split_k"``: a flash-decoding kernel (key splits in parallel, partial results
  merged): :mod:`attnorm.kernels.triton.attention_decoding`, written for the
  families whose forward is one pass with mergeable state (Self-Adjusted);
* ``"rows"``: scores as rows, the materialised route (``q k^T``, the row kernel,
  ``w v``), for the multi-pass families.

Scalable-Softmax under a bool mask (a left-padded batch's step) has its multiplier
``s log n + bias`` counted per row: :func:`ssmax_masked` does the count, the multiplier
and ``c q`` in one Triton launch before its SDPA call (:func:`attnorm.kernels.decoding_ops.ssmax_queries`).

:data:`DECODING_ROUTES` gives each family its route; :func:`use_route` (or the
``ATTNORM_DECODING_ROUTE`` environment variable, read at import) overrides it for
benchmarks.  :func:`supports` says whether the split-K kernel takes a call;
every other decoding call stays on the route :func:`attnorm.attention` already has.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
from torch import Tensor
from torch.nn.modules import module as _module

from attnorm.kernels import ops
from attnorm.kernels.decoding_ops import self_adjusted_decoding, ssmax_queries
from attnorm.kernels.ops import forward_mode, records_grad, watched
from attnorm.kernels.rules import NO_MASK, RowMask
from attnorm.normalizers.base import Normalizer, fits_bool_mask
from attnorm.routes.common import kernel_mask
from attnorm.routes.fused import _runs_triton
from attnorm.routes.sdpa import real_sdpa

__all__ = [
    "DECODING_ROUTES",
    "ROUTES",
    "SPLIT_K_KERNELS",
    "attention",
    "get_route",
    "route",
    "row_weights",
    "scores_kernel_applies",
    "supports",
    "use_route",
]

DECODING_ROUTES = {
    "softmax": "sdpa",
    "scalable_softmax": "sdpa",
    "self_adjusted_softmax": "split_k",
    "sparsemax": "rows",
    "entmax": "rows",
    "topk_softmax": "rows",
}
"""Decoding route per normalizer kernel name (others, without a fused kernel: ``"rows"``).

The bytes argument, at ``D = 64`` in bfloat16: any route reads each key and value once
per key/value head, 256 bytes.  Split-K adds nothing per key (its partials are per row
and split).  Scores as rows add, per key and query row, the float32 score's write, the
row kernel's passes over it and the weight's read by ``w v``: 16 bytes for a one-pass
normalizer (1.06x the bytes of split-K at one query row per key/value head, 2x at 16),
about 40 for entmax's threshold search or top-k's radix select (``1 + I + 1`` reads).
Half-precision scores are float32 (scores rounded to bfloat16 would tie where the fused
kernels' float32 scores do not, and change a top-k selection): where Triton runs, the
scores kernel (:func:`scores_kernel_applies`) reads K once in its own dtype; elsewhere q
and k are multiplied as float32 copies, whose copy of K costs 384 more bytes per key at
``D = 64`` (its float32 write and read).
A split-K kernel for those multi-pass families would re-read K (128 bytes per key)
once per pass instead, so for sparsemax, entmax and top-k scores as rows is the
cheaper design (:mod:`attnorm.kernels.triton.attention_decoding` explains it).
Self-Adjusted is one pass: split-K saves the rows route's 16 bytes per row and its
three launches.  These are byte counts, not timings: ``benchmarks/bench_decoding.py``
times ``rows`` against ``split_k`` for every family that has both, to confirm or flip
the table."""

ROUTES = ("auto", "rows", "split_k")
"""Overrides :func:`use_route` takes: ``"auto"`` follows :data:`DECODING_ROUTES`."""

SPLIT_K_KERNELS = frozenset(kernel for kernel, chosen in DECODING_ROUTES.items() if chosen == "split_k")
"""Normalizer kernels with a split-K kernel (the only ones ``use_route("split_k")`` can move)."""


def _checked(name: str, what: str = "decoding route") -> str:
    if name not in ROUTES:
        raise ValueError(f"{what} must be one of {ROUTES}, got {name!r}")
    return name


_route = _checked(os.environ.get("ATTNORM_DECODING_ROUTE", "auto"), "ATTNORM_DECODING_ROUTE")


def get_route() -> str:
    """The decoding route override in force: ``"auto"``, ``"rows"`` or ``"split_k"``."""
    return _route


@contextlib.contextmanager
def use_route(name: str) -> Iterator[None]:
    """Decode with route ``name`` inside the block: ``"auto"``, ``"rows"`` or ``"split_k"``.

    ``"rows"``: scores as rows for every family; ``"split_k"``: the split-K kernel wherever
    one exists (other families keep their route); ``"auto"``: :data:`DECODING_ROUTES`.

    Raises:
        ValueError: ``name`` not in :data:`ROUTES`.
    """
    global _route
    previous, _route = _route, _checked(name)
    try:
        yield
    finally:
        _route = previous


def route(normalizer) -> str:
    """The decoding route ``normalizer``'s family takes under the current override (before shape checks)."""
    kernel = getattr(normalizer, "kernel", None)
    chosen = DECODING_ROUTES.get(kernel, "rows")
    if chosen == "sdpa" or _route == "auto":
        return chosen
    return "split_k" if _route == "split_k" and kernel in SPLIT_K_KERNELS else "rows"


def supports(normalizer, q: Tensor, k: Tensor, v: Tensor, mask, additive: Tensor | None, dropout_p: float,
             softcap: float | None = None, sinks: Tensor | None = None) -> bool:
    """True when the split-K kernel computes this decoding call (:func:`attention`).

    It does when the family's route is ``"split_k"``, Triton runs the normalizer's backend
    on ``q``'s device, the inputs are ``(B, H, L, D)``, and there is no dropout,
    soft-capping, sink or gradient to compute (the kernel is forward only).
    """
    if route(normalizer) != "split_k" or dropout_p > 0 or softcap is not None or sinks is not None:
        return False
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        return False
    if records_grad(q, k, v, additive):
        return False
    return _runs_triton(normalizer, q)


def attention(normalizer, q: Tensor, k: Tensor, v: Tensor, mask, additive: Tensor | None, scale: float) -> Tensor:
    """The split-K kernel's attention ``(B, Hq, Lq, Dv)``; call only when :func:`supports` says so."""
    masks = kernel_mask(mask, additive, q, k.shape[-2])
    return self_adjusted_decoding(q, k, v, masks, scale, normalizer.normalized)


def scores_kernel_applies(normalizer, q: Tensor, k: Tensor) -> bool:
    """True when the rows route computes ``scale q k^T`` with :func:`~attnorm.kernels.decoding_ops.decoding_scores`.

    It does for half-precision ``q`` and ``k`` ``(B, Hq, Lq, D)`` / ``(B, Hkv, Lk, D)`` (float32
    scores wanted without a float32 copy of K), when no gradient is to be taken (the op is
    forward only; reverse or forward mode) and the normalizer has row kernels whose backend
    runs Triton on ``q``'s device.  Any number of query rows: the blocked route's inference
    blocks take it too.
    """
    if q.dtype not in (torch.float16, torch.bfloat16) or k.dtype != q.dtype or q.ndim != 4 or k.ndim != 4:
        return False
    if q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1] or k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        return False
    if records_grad(q, k) or forward_mode():
        return False
    return bool(getattr(normalizer, "kernel", "")) and _runs_triton(normalizer, q)


def _hooked(module: torch.nn.Module) -> bool:
    """Whether calling ``module`` would run a hook (its own or a global one) besides ``forward``."""
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks or _module._global_forward_hooks or _module._global_forward_pre_hooks
                or _module._global_backward_hooks or _module._global_backward_pre_hooks)


def row_weights(normalizer, q: Tensor, k: Tensor, scale: float, mask: Tensor | None = None,
                softcap: float | None = None, sinks: Tensor | None = None) -> Tensor | None:
    """The weights ``(B, Hq, Lq, Lk)`` of the rows route in one replayed call, in ``q``'s dtype, or None.

    Call where :func:`scores_kernel_applies` holds and the call has no additive mask;
    ``mask``: None or a bool tensor broadcastable to the scores (a left-padded batch's
    ``(B, 1, 1, Lk)``, read in place by the row kernel); ``softcap``: a checked cap or None
    (Gemma 2's, applied by the row kernel); ``sinks``: None or a checked ``(Hq,)`` sink per
    head (gpt-oss's, read in place by the row kernel, in its own dtype).  The weights are those of
    ``normalizer(decoding_scores(q, k, scale), mask, sink=sinks.reshape(-1, 1, 1), softcap=softcap).to(q.dtype)``,
    bit for bit
    (:func:`~attnorm.kernels.triton.attention_decoding.decoding_weights_forward` launches
    the same two kernels), without the host time of the layers between them: on
    an eager decoding step the module, its rules, the row op's entry point and a second
    replay key cost more than the launches (``scripts/launch_overhead.py``).  None, and the
    caller goes the long way, unless the normalizer is one of attnorm's row normalizers
    called as is (``Normalizer.forward``, no hook on the module nor a global one, parameters
    that are numbers, not learnable tensors) and nothing watches the call
    (:func:`attnorm.kernels.ops.plain`: no compile, trace, ``torch.func`` transform,
    dispatch or function mode, autocast, profiler).
    """
    kernel = getattr(normalizer, "kernel", None)
    if kernel not in ops.ROW_KERNELS or type(normalizer).forward is not Normalizer.forward or _hooked(normalizer):
        return None
    if not ops.plain(q, k, sinks) or q.numel() == 0 or k.numel() == 0:
        return None
    if sinks is not None and (sinks.device != q.device or ops.records_grad(sinks)):
        return None
    row_mask = NO_MASK if mask is None else _row_mask(mask, q, k)
    if row_mask is None:
        return None
    params = normalizer.kernel_params()
    for value in params.values():
        if isinstance(value, Tensor):
            return None
    global _WEIGHTS_FORWARD
    if _WEIGHTS_FORWARD is None:  # imported on first use: Triton may be absent
        from attnorm.kernels.triton.attention_decoding import decoding_weights_forward

        _WEIGHTS_FORWARD = decoding_weights_forward
    return _WEIGHTS_FORWARD(q, k, float(scale), kernel, tuple(params.items()), row_mask, softcap, sinks)


def _row_mask(mask: Tensor, q: Tensor, k: Tensor) -> RowMask | None:
    """A bool ``mask`` for the scores ``(B, Hq, Lq, Lk)`` of ``q`` and ``k`` as the row kernels take it, or None
    (a mask of another kind, device or shape: the module's route, which says what is wrong)."""
    shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    if type(mask) is not Tensor or not fits_bool_mask(mask, shape, q.device):  # (a subclass: the module's route)
        return None
    return RowMask(mask.reshape((1,) * (4 - mask.ndim) + tuple(mask.shape)), None, None)


_WEIGHTS_FORWARD = None


def ssmax_masked(normalizer, q: Tensor, k: Tensor, v: Tensor, mask, additive: Tensor | None, scale: float,
                 dropout_p: float, groups: int) -> Tensor | None:
    """Scalable-Softmax attention under a bool mask with no gradient: ``c q`` and the rows that attend by one
    kernel, then one SDPA call; None where it does not apply (the SDPA route of :mod:`.sdpa` runs).

    It applies to a Scalable-Softmax normalizer whose backend runs Triton on ``q``'s device, a
    bool tensor mask (no additive one) or, for learnable (tensor) ``s``/``bias``, none at all
    (``bias + s log Lk`` and ``c q`` in the one launch, where they were two), ``(B, H, L, D)``
    inputs with keys, a scale other than 0, and no gradient, compile, ``torch.func`` transform or
    forward-mode derivative to take.  The
    weights are those of the SDPA route (the same count, multiplier and rounding of ``c q``
    into q's dtype, up to the last bit of ``log``); rows without an allowed key give zeros.
    """
    if getattr(normalizer, "kernel", None) != "scalable_softmax" or additive is not None or scale == 0:
        return None
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4 or k.shape[-2] == 0:
        return None
    params = normalizer.kernel_params()
    s, bias = params["s"], params["bias"]
    tensors = [t for t in (s, bias) if isinstance(t, Tensor)]
    if mask is None:
        if not tensors:  # numbers: c is a number, SDPA's scale (the SDPA route has nothing to launch before it)
            return None
    elif not isinstance(mask, Tensor) or mask.dtype != torch.bool:
        return None
    if records_grad(q, k, v, *tensors) or watched() or forward_mode() or not _runs_triton(normalizer, q):
        return None
    if mask is not None and mask.shape[-1] != k.shape[-2]:  # broadcast over the keys: a row's keys all, or none
        mask = mask.expand(*mask.shape[:-1], k.shape[-2])
    scaled, attends = ssmax_queries(q, mask, s, bias, k.shape[-2])
    out = real_sdpa(scaled, k, v, groups, attn_mask=mask, dropout_p=dropout_p, scale=scale)
    return out if mask is None else torch.where(attends, out, 0.0)  # without a mask every row has its keys
