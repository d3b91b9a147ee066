"""The fast exact CPU path: the row operations the ``"torch"`` backend runs on CPU tensors.

Results match :mod:`attnorm.kernels.old_reference` to rounding; the speed comes from
skipping its :func:`~attnorm.kernels.old_reference.sanitize` passes in the common case.
The row kernels come in two implementations with one contract:

* native C kernels (:mod:`attnorm.kernels.cpu_native` over
  :mod:`attnorm.kernels.native`, compiled at first use), used whenever they load
  and no parameter other than entmax's alpha needs a gradient;
* torch ops only (:mod:`attnorm.kernels.cpu_softmax` for softmax, temperature,
  Scalable-Softmax and SA-Softmax; :mod:`attnorm.kernels.cpu_sparse` for sparsemax,
  alpha-entmax and top-k), for trainable parameters, under ``vmap``, and where no
  C compiler is available (``ATTNORM_NATIVE=0`` forces them).

The special rows of the shared rules (fully masked, holding +inf, holding NaN) are
found cheaply — the kernels flag them (the native ones from each row's scan, the
torch-only softmax from the NaN it returns there, its sparse ops from a non-finite
row maximum) — and only those rows are recomputed with the reference.
Tensors on other devices, and the rare parameter values the fast kernels do not
cover, go to the reference as a whole.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from attnorm.kernels import cpu_native, cpu_softmax, cpu_sparse, old_reference as reference
from attnorm.kernels.cpu import native
from attnorm.kernels.dispatch import register
from attnorm.masks import StructuredMask

__all__ = [
    "entmax_rows",
    "redo_rows",
    "scalable_softmax_rows",
    "self_adjusted_softmax_rows",
    "softmax_rows",
    "sparsemax_rows",
    "topk_softmax_rows",
]

Mask = Tensor | StructuredMask | None


class _Kernels(NamedTuple):
    """One implementation of the row kernels, each returning ``(weights, bad)``."""

    scaled_softmax: Callable[..., tuple[Tensor, Tensor]]
    self_adjusted_softmax: Callable[..., tuple[Tensor, Tensor]]
    entmax_support: Callable[..., tuple[Tensor, Tensor]]
    topk_support: Callable[..., tuple[Tensor, Tensor]]


_NATIVE = _Kernels(
    cpu_native.scaled_softmax, cpu_native.self_adjusted_softmax, cpu_native.entmax_support, cpu_native.topk_support
)
_TORCH_ONLY = _Kernels(
    cpu_softmax.scaled_softmax, cpu_softmax.self_adjusted_softmax, cpu_sparse.entmax_support, cpu_sparse.topk_support
)

# Below this alpha, (alpha - 1) x_i - tau is raised to powers > 20 and float32
# loses the small weights; the reference's bisection handles it.
_SMALLEST_FAST_ALPHA = 1.05


def _on_fast_path(x: Tensor) -> bool:
    return x.device.type == "cpu" and x.numel() > 0 and x.dtype in (torch.float32, torch.float64)


def _kernels(x: Tensor, *params: Any) -> _Kernels:
    """The native kernels when they run here and no parameter needs a gradient, else torch ops."""
    trainable = any(isinstance(param, Tensor) and param.requires_grad for param in params)
    return _NATIVE if not trainable and native.usable(x) else _TORCH_ONLY


def _keep(mask: Mask, x: Tensor) -> Tensor | None:
    if isinstance(mask, StructuredMask):
        return mask.materialize(x.shape, x.device)
    return mask


def _all_finite(x: Tensor) -> bool:
    # One reduction: any -inf, +inf or NaN makes the sum non-finite (an
    # overflowing sum of finite scores only costs the fast shortcut).
    return bool(torch.isfinite(x.sum()))


def _allowed_count(keep: Tensor | None, x: Tensor) -> Tensor:
    """Allowed positions per row, ``(..., 1)``, when every score is finite."""
    length = x.shape[-1]
    if keep is None:
        return torch.full((1,) * x.ndim, length, device=x.device)
    return keep.expand(*keep.shape[:-1], length).sum(-1, keepdim=True)


def _allowed_finite(keep: Tensor | None, x: Tensor) -> Tensor:
    allowed = x != -math.inf
    return allowed if keep is None else allowed & keep


def redo_rows(
    out: Tensor,
    bad: Tensor,
    reference_op: Callable[..., Tensor],
    x: Tensor,
    keep: Tensor | None,
    params: dict[str, Any],
) -> Tensor:
    """Recompute the rows flagged in ``bad`` (shape ``x.shape[:-1]``) with ``reference_op``.

    The fast kernels leave those rows at zero, with zero gradient; the reference
    rows are spliced in out of place, so gradients flow to ``x`` and the parameters
    through the reference there.
    """
    if not bool(bad.any()):
        return out
    if x.ndim == 1:
        lifted = {name: value.reshape(1, 1) if isinstance(value, Tensor) else value for name, value in params.items()}
        keep = None if keep is None else keep.expand(x.shape)[None]
        return redo_rows(out[None], bad.reshape(1), reference_op, x[None], keep, lifted)[0]
    rows_params = {
        name: value.expand(*x.shape[:-1], 1)[bad] if isinstance(value, Tensor) else value
        for name, value in params.items()
    }
    rows_keep = None if keep is None else keep.expand(x.shape)[bad]
    return out.index_put((bad,), reference_op(x[bad], rows_keep, **rows_params))


@register("torch", "softmax")
def softmax_rows(x: Tensor, mask: Mask, temperature: float | Tensor = 1.0) -> Tensor:
    if not _on_fast_path(x):
        return reference.softmax_rows(x, mask, temperature=temperature)
    keep = _keep(mask, x)
    out, bad = _kernels(x, temperature).scaled_softmax(x, 1 / temperature, keep)
    return redo_rows(out, bad, reference.softmax_rows, x, keep, {"temperature": temperature})


@register("torch", "scalable_softmax")
def scalable_softmax_rows(x: Tensor, mask: Mask, s: float | Tensor = 0.43, bias: float | Tensor = 0.0) -> Tensor:
    if not _on_fast_path(x):
        return reference.scalable_softmax_rows(x, mask, s=s, bias=bias)
    keep = _keep(mask, x)
    forced = None
    if _all_finite(x):
        count = _allowed_count(keep, x)
    else:
        # -inf scores do not count in n; +inf and NaN rows go to the reference
        # (a negative multiplier would turn +inf into a masked-looking -inf).
        keep = _allowed_finite(keep, x)
        count = keep.sum(-1, keepdim=True)
        forced = ((x == math.inf) | torch.isnan(x)).logical_and_(keep).any(-1)
    scale = reference.ssmax_scale(count.to(x.dtype), s, bias)
    out, bad = _kernels(x, scale).scaled_softmax(x, scale, keep)
    if forced is not None:
        bad = bad | forced
    return redo_rows(out, bad, reference.scalable_softmax_rows, x, keep, {"s": s, "bias": bias})


@register("torch", "self_adjusted_softmax")
def self_adjusted_softmax_rows(x: Tensor, mask: Mask, normalized: bool = True) -> Tensor:
    kernels = _kernels(x) if _on_fast_path(x) else None
    # The torch-only kernel does not flag special rows: it takes finite scores only.
    if kernels is None or (kernels is _TORCH_ONLY and not _all_finite(x)):
        return reference.self_adjusted_softmax_rows(x, mask, normalized=normalized)
    keep = _keep(mask, x)
    out, bad = kernels.self_adjusted_softmax(x, keep, normalized)
    return redo_rows(out, bad, reference.self_adjusted_softmax_rows, x, keep, {"normalized": normalized})


@register("torch", "sparsemax")
def sparsemax_rows(x: Tensor, mask: Mask) -> Tensor:
    if not _on_fast_path(x):
        return reference.sparsemax_row_op(x, mask)
    keep = _keep(mask, x)
    out, bad = _kernels(x).entmax_support(x, keep, 2.0)
    return redo_rows(out, bad, reference.sparsemax_row_op, x, keep, {})


@register("torch", "entmax")
def entmax_rows(x: Tensor, mask: Mask, alpha: float | Tensor = 1.5) -> Tensor:
    if isinstance(alpha, Tensor):
        fast = not bool((alpha < _SMALLEST_FAST_ALPHA).any())
    else:
        if alpha == 1:
            return softmax_rows(x, mask)
        fast = alpha >= _SMALLEST_FAST_ALPHA
        alpha = float(alpha)
    if not (fast and _on_fast_path(x)):
        return reference.entmax_row_op(x, mask, alpha=alpha)
    keep = _keep(mask, x)
    out, bad = _kernels(x).entmax_support(x, keep, alpha)  # both differentiate alpha
    return redo_rows(out, bad, reference.entmax_row_op, x, keep, {"alpha": alpha})


@register("torch", "topk_softmax")
def topk_softmax_rows(x: Tensor, mask: Mask, k: float = 1, temperature: float | Tensor = 1.0) -> Tensor:
    if not _on_fast_path(x):
        return reference.topk_softmax_rows(x, mask, k=k, temperature=temperature)
    keep = _keep(mask, x)
    count = None
    if isinstance(k, float):  # a fraction of each row's allowed finite scores
        count = _allowed_count(keep, x) if _all_finite(x) else _allowed_finite(keep, x).sum(-1, keepdim=True)
    out, bad = _kernels(x, temperature).topk_support(x, keep, k, 1 / temperature, count)
    return redo_rows(out, bad, reference.topk_softmax_rows, x, keep, {"k": k, "temperature": temperature})
