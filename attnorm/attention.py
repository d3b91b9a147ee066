"""Attention with any attnorm normalizer: ``attention(q, k, v, normalizer)``.

``weights = normalizer(scale * q k^T + additive_mask, mask)`` and ``out = weights v``,
with the mask rules of :mod:`attnorm.normalizers.base` (masked keys get weight 0,
a query row with no allowed key gives a zero output row, never NaN).

:func:`attention` validates its arguments and picks a route (:mod:`attnorm.routes`):

1. the normalizer's own ``attend`` method, when it has one (output normalizers,
   linear-time forms);
2. **SDPA** (:mod:`attnorm.routes.sdpa`) for logit scalings (softmax with temperature,
   Scalable-Softmax): one ``scaled_dot_product_attention`` call, without softcap or sinks
   (SDPA has neither: those calls take the fused softmax when Triton runs, else route 4 or 5),
   and on the CPU not under a structured mask whose blocks skip most scores (:data:`BLOCKED_SHARE`);
3. **fused** Triton kernels (:mod:`attnorm.routes.fused`) for the normalizers that have
   them, on CUDA (or with ``backend="triton"``), softcap and sinks computed in the kernels;
4. **decoding** (:mod:`attnorm.routes.decoding`): at most :data:`DECODING_ROWS` query rows
   against a KV cache, the design chosen per family: SDPA for the logit scalings, the
   split-K kernel for Self-Adjusted Softmax (inference, Triton), and otherwise the scores
   as rows for the row kernels (the materialised route);
   **materialised**: the whole ``(Lq x Lk)`` weights, when ``return_weights=True``, for
   decoding, when they fit the blocked route's budget anyway, and under ``torch.compile``;
5. **blocked** (:mod:`attnorm.routes.blocked`) otherwise: blocks of query rows,
   recomputed in the backward, so memory stays bounded at any length.

While a forward-mode derivative may be taken (``torch.func.jvp``, ``jacfwd``,
``torch.autograd.forward_ad``) routes 3 and 4 are skipped: their kernels have no JVP.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from attnorm.kernels.ops import forward_mode
from attnorm.kernels.rules import accumulation_dtype, broadcasts_to
from attnorm.masks import StructuredMask, causal_mask
from attnorm.normalizers import Normalizer, Softmax
from attnorm.normalizers.registry import make
from attnorm.routes import decoding as decoding_route
from attnorm.routes import fused
from attnorm.routes.blocked import block_rows, blocked_attention, computed_share, materialised_attention
from attnorm.routes.sdpa import logit_multiplier, scaled_sdpa, sdpa_mask_kind
from attnorm.validation import check_bool, check_softcap, quiet_shape_checks_while_tracing

__all__ = ["BLOCKED_SHARE", "DECODING_ROWS", "WINDOW_ROWS", "attention"]

DECODING_ROWS = 16
"""Up to this many query rows (generation against a KV cache) a call is decoding: a flash
kernel's query block would be mostly empty, while the ``(Lq, Lk)`` scores of so few rows
are small.  :mod:`attnorm.routes.decoding` says which design each family takes and why
(bytes per key and row)."""


BLOCKED_SHARE = 1 / 4
"""On the CPU a call under a structured mask (a sliding window, documents, key lengths, another causal diagonal)
takes the blocked route when that computes at most this share of the ``(Lq, Lk)`` scores
(:func:`attnorm.routes.blocked.computed_share`: a window's or a document's keys only): a logit scaling (softmax
with temperature, Scalable-Softmax) instead of SDPA, which takes such a mask as a dense bool tensor (or a key
padding one) and computes every score, and the other normalizers instead of the materialised route.  Blocked over
SDPA, forward and backward, causal windows, 2 heads of 64, 2048 keys (this 2-core machine, 1 / 2 threads):
float32 0.33 / 0.48 at a share of 0.15 (a window of 256), 0.46 / 0.61 at 0.25, 0.65 / 0.81 at 0.40; at 4096
keys 0.22 / 0.28 at 0.13; bfloat16 (SDPA's CPU kernel is faster there) 0.76 at 0.15 and 1.00 at 0.30,
hence a quarter."""

WINDOW_ROWS = 64
"""Query rows per block at most in those calls: a block of ``r`` rows reaches ``window + r - 1`` keys."""


@quiet_shape_checks_while_tracing
def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    normalizer: Normalizer | str | None = None,
    *,
    attn_mask: Tensor | StructuredMask | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    return_weights: bool = False,
    softcap: float | None = None,
    sinks: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Scaled dot-product attention whose weights come from ``normalizer``.

    ``out = normalizer(scale * q k^T + additive, mask) @ v``, normalised over the keys.
    Same conventions as ``torch.nn.functional.scaled_dot_product_attention``.

    Args:
        q: queries ``(..., Hq, Lq, D)`` (any leading dims; ``(..., Lq, D)`` works too).
        k: keys ``(..., Hkv, Lk, D)``; ``Hkv`` may divide ``Hq`` (grouped-query
            attention: query head ``h`` uses key head ``h // (Hq / Hkv)``).
        v: values ``(..., Hkv, Lk, Dv)``.
        normalizer: a :class:`~attnorm.Normalizer` normalising over the last axis, a
            spec string for :func:`attnorm.make` (``"entmax:alpha=1.3"``), or None for softmax.
        attn_mask: bool tensor broadcastable to ``(..., Hq, Lq, Lk)`` with True = may attend;
            a float tensor added to the scores (``-inf`` = masked); or a StructuredMask
            (causal / key-padding; its batch dim is ``q``'s first dim).
        is_causal: top-left aligned causal mask (query ``i`` attends keys ``j <= i``), as in
            SDPA.  Combines with a StructuredMask; not with a tensor ``attn_mask``.
        scale: score scale; ``1 / sqrt(D)`` when None.
        dropout_p: dropout on the weights (pass 0 at evaluation, as with SDPA).
        return_weights: also return the weights ``(..., Hq, Lq, Lk)`` (materialises them).
        softcap: when given, scaled scores become ``softcap * tanh(scores / softcap)`` before the
            additive mask and the normalizer (Gemma 2's attention logit soft-capping).
        sinks: attention sinks ``(Hq,)``: a virtual key per query head with score ``sinks[h]``
            (after ``scale``) and a zero value, which takes part in the normalizer but not in
            the output (gpt-oss's ``s_aux``; a sink of 0 with softmax is softmax_1).  Not counted
            in Scalable-Softmax's ``n`` nor in the ``n`` a fractional top-k ``k`` takes a fraction of.

    Returns:
        ``out`` of shape ``(..., Hq, Lq, Dv)``, or ``(out, weights)``.

    Raises:
        ValueError: mismatched shapes or dtypes, a normalizer not normalising over keys, a
            tensor mask together with ``is_causal`` or not broadcastable to the scores,
            ``dropout_p`` outside [0, 1), a ``scale`` that is not finite, ``softcap`` <= 0,
            ``sinks`` not of shape ``(Hq,)``.
        TypeError: non-tensor inputs, a mask of the wrong type, ``is_causal`` or ``return_weights`` not a bool.
    """
    normalizer = _as_normalizer(normalizer)
    q, k, v, groups = _check_inputs(q, k, v, normalizer)
    if q.ndim == 2 or k.ndim == 2 or v.ndim == 2:
        # (L, D) inputs, as SDPA takes them: one head (the routes index heads at dim -3).
        result = attention(*(t.unsqueeze(0) if t.ndim == 2 else t for t in (q, k, v)), normalizer,
                           attn_mask=attn_mask, is_causal=is_causal, scale=scale, dropout_p=dropout_p,
                           return_weights=return_weights, softcap=softcap, sinks=sinks)
        if q.ndim > 2:
            return result
        return tuple(t.squeeze(0) for t in result) if return_weights else result.squeeze(0)
    if not 0 <= dropout_p < 1:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    _check_is_causal(is_causal)  # a string was taken as True (SDPA raises a TypeError)
    _check_return_weights(return_weights)
    # float(): under torch.jit.trace a size is a traced 0-d tensor, whose ** -0.5 was float32 (1e-8 off in float64).
    # Head dim 0: every score is an empty sum, 0 at any scale (1, where 0 ** -0.5 raised ZeroDivisionError).
    scale = (float(q.shape[-1]) ** -0.5 if q.shape[-1] else 1.0) if scale is None else _check_scale(scale)
    if isinstance(attn_mask, Tensor):
        attn_mask = _check_mask_shape(attn_mask, q, k.shape[-2])
    mask, additive = _split_mask(attn_mask, is_causal)
    if isinstance(mask, StructuredMask) and sdpa_mask_kind(mask, q.shape[-2], k.shape[-2]) == "none":
        mask = None  # e.g. a decoding step's causal mask: every row may attend every key
    softcap, sinks = _check_modifiers(softcap, sinks, q)
    modified = softcap is not None or sinks is not None
    own_route = _own_route(normalizer)
    if own_route is not None:
        # A normalizer with its own route (an output normalizer, a linear-time form) goes first.
        result = own_route(q, k, v, mask=mask, additive=additive, scale=scale, dropout_p=dropout_p,
                           groups=groups, return_weights=return_weights)
        if result is not NotImplemented:
            return result
    if not return_weights:
        rows = _narrow_rows(normalizer, mask, q, k, v)  # > 0: blocks that skip most scores, on the blocked route
        # A row normalizer whose class overrides forward is called as a module (blocked or materialised route):
        # the SDPA, fused and decoding kernels compute the class's own normalizer, and ignored the override.
        if type(normalizer).forward is Normalizer.forward or not getattr(normalizer, "kernel", ""):
            decoding = q.shape[-2] <= DECODING_ROWS
            if decoding and not modified:
                out = decoding_route.ssmax_masked(normalizer, q, k, v, mask, additive, scale, dropout_p, groups)
                if out is not None:
                    return out
            multiplier = logit_multiplier(normalizer, mask, additive, q, k.shape[-2])
            # The fused and split-K kernels have no forward-mode derivative: while one may be
            # taken, the row routes (differentiated on the reference) and SDPA's math kernel run.
            kernels_ok = not forward_mode()
            if multiplier is not None:
                if kernels_ok and not decoding and fused.supports_scaled_softmax(normalizer, mask, q, k, v, dropout_p,
                                                                                 additive, modified):
                    return fused.scaled_softmax(q, k, v, multiplier, mask, scale, additive, softcap, sinks)
                if not modified and not rows:  # SDPA has neither softcap nor sinks
                    return scaled_sdpa(q, k, v, multiplier, mask, additive, scale, dropout_p, groups)
            elif kernels_ok and not decoding and fused.supports(normalizer, q, k, v, dropout_p, additive):
                return fused.attention(normalizer, q, k, v, mask, additive, scale, softcap, sinks)
            elif kernels_ok and decoding and decoding_route.supports(normalizer, q, k, v, mask, additive, dropout_p,
                                                                     softcap, sinks):
                return decoding_route.attention(normalizer, q, k, v, mask, additive, scale)
        rows = rows or block_rows(q, k, v)
        if rows < q.shape[-2] and not torch.compiler.is_compiling():
            return blocked_attention(normalizer, q, k, v, mask, additive, scale, dropout_p, groups, rows, softcap,
                                     sinks)
    out, weights = materialised_attention(normalizer, q, k, v, mask, additive, scale, dropout_p, groups, softcap, sinks)
    return (out, weights) if return_weights else out


def _narrow_rows(normalizer, mask, q: Tensor, k: Tensor, v: Tensor) -> int:
    """Query rows per block when a call takes the blocked route because its blocks skip most of the scores,
    else 0 (:data:`BLOCKED_SHARE`): one of the six row normalizers, CPU tensors, a structured mask, and blocks
    of at most :data:`WINDOW_ROWS` rows that reach at most that share (a logit scaling then leaves SDPA, the
    others the materialised route where the whole score matrix would fit).  Not the F/sum F normalizers: their
    function may read a tensor the blocked route cannot find (it looks in closures, the globals a function names
    and the module a method is bound to), which plain autograd differentiates: they keep the materialised route
    where it fits."""
    lq, lk = q.shape[-2], k.shape[-2]
    if lq <= WINDOW_ROWS or not q.is_cpu or not isinstance(mask, StructuredMask) or torch.compiler.is_compiling() \
            or not getattr(normalizer, "kernel", ""):
        return 0
    rows = min(block_rows(q, k, v), WINDOW_ROWS)
    return rows if computed_share(mask, q, lk, rows) <= BLOCKED_SHARE else 0


def _check_modifiers(softcap, sinks, q: Tensor) -> tuple[float | None, Tensor | None]:
    if softcap is not None:  # checked against the precision the scores are computed in (as Normalizer.forward)
        softcap = check_softcap(softcap, accumulation_dtype(q.dtype))
    if sinks is not None:
        heads = q.shape[-3] if q.ndim >= 3 else 1
        if not isinstance(sinks, Tensor) or not sinks.dtype.is_floating_point or sinks.shape != (heads,):
            shape = tuple(sinks.shape) if isinstance(sinks, Tensor) else type(sinks).__name__
            raise ValueError(f"sinks must be a floating tensor of shape (Hq,) = ({heads},), got {shape}")
        sinks = sinks.to(q.device)
    return softcap, sinks


def _own_route(normalizer):
    """The normalizer's ``attend`` method (its own attention route), or None.

    Looked up on the class (or the instance's ``__dict__``) first: a module without one
    would go through ``nn.Module.__getattr__``, which raises and catches an AttributeError
    on every call (a few microseconds of a decoding step).
    """
    if (isinstance(normalizer, torch.nn.Module) and not hasattr(type(normalizer), "attend")
            and "attend" not in normalizer.__dict__):
        return None
    return getattr(normalizer, "attend", None)


def _as_normalizer(normalizer: Normalizer | str | None) -> Normalizer:
    if normalizer is None:
        return Softmax()
    if isinstance(normalizer, str):
        return make(normalizer)
    if isinstance(normalizer, Normalizer) or callable(getattr(normalizer, "attend", None)):
        return normalizer
    raise TypeError(f"normalizer must be a Normalizer, a spec string or None, got {type(normalizer).__name__}")


def _check_inputs(q: Tensor, k: Tensor, v: Tensor, normalizer: Normalizer) -> tuple[Tensor, Tensor, Tensor, int]:
    """Validate shapes and dtypes; return ``(q, k, v, query heads per key head)``.

    As in ``scaled_dot_product_attention``, leading (batch) dims broadcast and a single value head
    serves every key head: such inputs come back expanded to one shape (views), so every route
    sees the same dims.  Runs on every call (a decoding step's too): shapes are read once.
    """
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        if not isinstance(tensor, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.ndim < 2 or not tensor.dtype.is_floating_point:
            raise ValueError(f"{name} must be a floating tensor (..., L, D), got {tuple(tensor.shape)} {tensor.dtype}")
    dtype = q.dtype
    if k.dtype != dtype or v.dtype != dtype:
        raise ValueError(f"q, k and v must share a dtype (as in scaled_dot_product_attention), got {dtype}, "
                         f"{k.dtype}, {v.dtype}")
    qs, ks, vs = q.shape, k.shape, v.shape
    if qs[-1] != ks[-1] or ks[-2] != vs[-2]:
        raise ValueError(f"expected q (..., Lq, D), k (..., Lk, D), v (..., Lk, Dv); got {tuple(qs)}, {tuple(ks)}, "
                         f"{tuple(vs)}")
    if getattr(normalizer, "dim", -1) not in (-1, q.ndim - 1):
        raise ValueError(f"attention normalises over the keys (dim=-1); the normalizer has dim={normalizer.dim}")
    ndim = len(qs)
    if ndim < 3 or len(ks) < 3 or len(vs) < 3:
        return q, k, v, 1
    if not (ndim == len(ks) == len(vs) == 4 and qs[0] == ks[0] == vs[0]) and not qs[:-3] == ks[:-3] == vs[:-3]:
        try:
            batch = torch.broadcast_shapes(qs[:-3], ks[:-3], vs[:-3])
        except RuntimeError:
            raise ValueError(f"the leading (batch) dims of q, k and v must broadcast, got {tuple(qs)}, "
                             f"{tuple(ks)}, {tuple(vs)}") from None
        q, k, v = (t.expand(*batch, *t.shape[-3:]) for t in (q, k, v))
    heads, kv_heads = qs[-3], ks[-3]
    per_head = getattr(normalizer, "num_heads", None)
    if isinstance(per_head, int) and per_head != 1 and per_head != heads:  # not `in`: heads may be a SymInt
        raise ValueError(f"the normalizer has num_heads={per_head} (a parameter per head), but q has {heads} heads "
                         f"(dim -3 of {tuple(qs)})")
    if vs[-3] != kv_heads:
        if vs[-3] != 1:
            raise ValueError(f"v must have as many heads as k ({kv_heads}) or one, got v {tuple(vs)}")
        v = v.expand(*v.shape[:-3], kv_heads, *vs[-2:])
    if heads == kv_heads:
        return q, k, v, 1
    if heads % kv_heads:
        raise ValueError(f"query heads ({heads}) must be a multiple of key/value heads ({kv_heads}, {vs[-3]})")
    return q, k, v, heads // kv_heads


def _check_mask_shape(mask: Tensor, q: Tensor, lk: int) -> Tensor:
    """A tensor ``attn_mask`` broadcastable to the scores ``(..., Hq, Lq, Lk)``, viewed with the scores' dims.

    Raises:
        ValueError: a mask with more dims than the scores, or one that does not broadcast to them.
    """
    scores = (*q.shape[:-1], lk)
    if not broadcasts_to(mask.shape, scores):
        raise ValueError(f"attn_mask of shape {tuple(mask.shape)} does not broadcast to the scores {scores} "
                         f"(..., Hq, Lq, Lk)")
    extra = len(scores) - mask.ndim
    return mask if extra == 0 else mask.reshape((1,) * extra + tuple(mask.shape))


def _check_scale(scale: float) -> float:
    if torch.compiler.is_compiling():  # it may be symbolic there (head_dim ** -0.5 under dynamic shapes)
        return scale
    try:
        value = float(scale)
    except (TypeError, ValueError, RuntimeError):
        value = math.nan
    if not math.isfinite(value):
        raise ValueError(f"scale must be a finite number or None, got {scale!r}")
    return value


_check_is_causal, _check_return_weights = check_bool("is_causal"), check_bool("return_weights")


def _split_mask(attn_mask, is_causal: bool) -> tuple[Tensor | StructuredMask | None, Tensor | None]:
    """Split ``attn_mask`` into (bool or structured mask, additive float mask)."""
    if attn_mask is None or isinstance(attn_mask, StructuredMask):
        if is_causal:
            attn_mask = causal_mask() if attn_mask is None else attn_mask & causal_mask()
        return attn_mask, None
    if not isinstance(attn_mask, Tensor):
        raise TypeError(f"attn_mask must be a tensor, a StructuredMask or None, got {type(attn_mask).__name__}")
    if is_causal:
        raise ValueError("give is_causal=True or a tensor attn_mask, not both (as in scaled_dot_product_attention)")
    if attn_mask.dtype == torch.bool:
        return attn_mask, None
    if not attn_mask.dtype.is_floating_point:
        raise TypeError(f"attn_mask must be bool (True = may attend) or float (added to scores), got {attn_mask.dtype}")
    return None, attn_mask
