"""Attention with any attnorm normalizer: ``attention(q, k, v, normalizer)``.

``weights = normalizer(scale * q k^T + additive_mask, mask)`` and ``out = weights v``,
with the mask rules of :mod:`attnorm.normalizers.base` (masked keys get weight 0,
a query row with no allowed key gives a zero output row, never NaN).

Two routes compute it:

* **Logit-scaling route** (exact, no ``(Lq x Lk)`` float matrix).  Softmax with
  temperature and Scalable-Softmax are ``softmax(c * scores)`` with a multiplier
  ``c`` that is constant along each query row (``1 / T``, or ``s log n + bias`` with
  ``n`` the allowed keys of that row).  ``c`` is folded into ``q`` (or into the
  scalar ``scale`` when it is one number) and ``torch.nn.functional.scaled_dot_product_attention``
  does the rest.  ``n`` comes from the mask alone: a sum over keys of a bool mask,
  or arithmetic on a causal / key-padding :class:`~attnorm.masks.StructuredMask`.
  When ``c`` varies across rows or heads, blocks of query rows are processed in turn
  so that the scaled copy of ``q`` (and any per-block mask) stays a small fraction of ``q``.
* **Materialised route** (every other normalizer, and ``return_weights=True``):
  scores are built, normalised (Triton kernels on CUDA) and multiplied by ``v``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from attnorm.kernels.rules import ssmax_multiplier
from attnorm.masks import StructuredMask, causal_mask
from attnorm.normalizers import Normalizer, Softmax
from attnorm.normalizers.registry import make

__all__ = ["attention"]

# A block of query rows is sized so its temporaries (scaled queries, its output and
# its mask) stay under max(_MIN_BLOCK_BYTES, q.nbytes / _BLOCKS_PER_Q).
_MIN_BLOCK_BYTES = 1 << 20
_BLOCKS_PER_Q = 8
_SDPA_HAS_GQA = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 5)

Multiplier = float | Tensor


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

    Returns:
        ``out`` of shape ``(..., Hq, Lq, Dv)``, or ``(out, weights)``.

    Raises:
        ValueError: mismatched shapes, a normalizer not normalising over keys, a tensor
            mask together with ``is_causal``, ``dropout_p`` outside [0, 1).
        TypeError: non-tensor inputs, a mask of the wrong type.
    """
    normalizer = _as_normalizer(normalizer)
    groups = _check_inputs(q, k, v, normalizer)
    if not 0 <= dropout_p < 1:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    mask, additive = _split_mask(attn_mask, is_causal)
    own_route = getattr(normalizer, "attend", None)
    if own_route is not None:
        # A normalizer with its own route (an output normalizer, a linear-time form) goes first.
        result = own_route(q, k, v, mask=mask, additive=additive, scale=scale, dropout_p=dropout_p,
                           groups=groups, return_weights=return_weights)
        if result is not NotImplemented:
            return result
    if not return_weights:
        multiplier = _logit_multiplier(normalizer, mask, additive, q, k)
        if multiplier is not None:
            return _scaled_sdpa(q, k, v, multiplier, mask, additive, scale, dropout_p, groups)
    if groups > 1:
        k, v = _repeat_heads(k, groups), _repeat_heads(v, groups)
    scores = torch.matmul(q, k.transpose(-2, -1)).mul_(scale)  # (..., Hq, Lq, Lk)
    if additive is not None:
        scores = scores + additive
    weights = normalizer(scores, mask)
    attended = F.dropout(weights, dropout_p) if dropout_p > 0 else weights
    out = torch.matmul(attended, v)  # (..., Hq, Lq, Dv)
    return (out, weights) if return_weights else out


def _as_normalizer(normalizer: Normalizer | str | None) -> Normalizer:
    if normalizer is None:
        return Softmax()
    if isinstance(normalizer, str):
        return make(normalizer)
    if isinstance(normalizer, Normalizer) or callable(getattr(normalizer, "attend", None)):
        return normalizer
    raise TypeError(f"normalizer must be a Normalizer, a spec string or None, got {type(normalizer).__name__}")


def _check_inputs(q: Tensor, k: Tensor, v: Tensor, normalizer: Normalizer) -> int:
    """Validate shapes; return the number of query heads per key head."""
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        if not isinstance(tensor, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.ndim < 2 or not tensor.dtype.is_floating_point:
            raise ValueError(f"{name} must be a floating tensor (..., L, D), got {tuple(tensor.shape)} {tensor.dtype}")
    if q.shape[-1] != k.shape[-1] or k.shape[-2] != v.shape[-2]:
        raise ValueError(
            "expected q (..., Lq, D), k (..., Lk, D), v (..., Lk, Dv); "
            f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if getattr(normalizer, "dim", -1) not in (-1, q.ndim - 1):
        raise ValueError(f"attention normalises over the keys (dim=-1); the normalizer has dim={normalizer.dim}")
    if q.ndim < 3 or k.ndim < 3 or q.shape[-3] == k.shape[-3]:
        return 1
    if k.shape[-3] != v.shape[-3] or q.shape[-3] % k.shape[-3]:
        raise ValueError(
            f"query heads ({q.shape[-3]}) must be a multiple of key/value heads ({k.shape[-3]}, {v.shape[-3]})"
        )
    return q.shape[-3] // k.shape[-3]


def _repeat_heads(x: Tensor, groups: int) -> Tensor:
    return x.repeat_interleave(groups, dim=-3)


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


def _allowed_counts(mask: Tensor | StructuredMask | None, q: Tensor, lk: int) -> Tensor | None:
    """Allowed keys per query row, ``(..., Lq, 1)``; None when every row sees all ``lk`` keys."""
    if mask is None:
        return None
    if isinstance(mask, Tensor):
        return _count_true(mask)
    count = None
    if mask.causal_diagonal is not None:
        rows = torch.arange(q.shape[-2], device=q.device)
        count = (rows + mask.causal_diagonal + 1).clamp(0, lk)[:, None]  # (Lq, 1)
    if mask.key_lengths is not None:
        lengths = _batch_lengths(mask.key_lengths, q)
        count = lengths.clamp(max=lk) if count is None else torch.minimum(count, lengths)
    return count


def _count_true(mask: Tensor) -> Tensor:
    """``mask.sum(-1, keepdim=True)`` a few rows at a time: a whole-tensor sum first copies the mask to int64."""
    if mask.ndim < 2:
        return mask.sum(-1, keepdim=True)
    rows = max(1, _MIN_BLOCK_BYTES // (8 * mask[..., 0, :].numel()))
    blocks = [mask[..., start : start + rows, :].sum(-1, keepdim=True) for start in range(0, mask.shape[-2], rows)]
    return torch.cat(blocks, dim=-2)


def _batch_lengths(lengths: Tensor, q: Tensor) -> Tensor:
    """Key lengths ``(B,)`` shaped ``(B, 1, ..., 1)`` to broadcast against ``q``-shaped scores."""
    if q.ndim < 3 or lengths.shape[0] not in (1, q.shape[0]):
        raise ValueError(
            f"key_lengths of shape {tuple(lengths.shape)} need scores (B, ..., Lq, Lk) with B = {lengths.shape[0]}, "
            f"got q of shape {tuple(q.shape)}"
        )
    return lengths.to(q.device).reshape(-1, *([1] * (q.ndim - 1)))


def _logit_multiplier(normalizer: Normalizer, mask, additive: Tensor | None, q: Tensor, k: Tensor) -> Multiplier | None:
    """The per-row logit multiplier when ``normalizer`` is a pure logit scaling, else None."""
    params = normalizer.kernel_params()
    if normalizer.kernel == "softmax":
        return 1 / params["temperature"]
    if normalizer.kernel != "scalable_softmax" or additive is not None:
        return None
    s, bias, lk = params["s"], params["bias"], k.shape[-2]
    count = _allowed_counts(mask, q, lk)
    if count is None and not isinstance(s, Tensor) and not isinstance(bias, Tensor):
        return s * math.log(max(lk, 1)) + bias
    compute_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    count = torch.tensor(float(lk), device=q.device) if count is None else count
    return ssmax_multiplier(count.to(compute_dtype), s, bias)


def _row_attends(mask, additive: Tensor | None, q: Tensor, lk: int) -> Tensor | None:
    """Bool ``(..., Lq, 1)``: rows with at least one allowed key; None when all rows have one."""
    if additive is not None:
        return ~torch.isneginf(additive).all(-1, keepdim=True)
    if isinstance(mask, Tensor):
        return mask.any(-1, keepdim=True)
    if mask is None or (mask.key_lengths is None and (mask.causal_diagonal or 0) >= 0):
        return None
    return _allowed_counts(mask, q, lk) > 0


def _take_rows(x: Tensor | None, start: int, stop: int, order: Tensor | None = None) -> Tensor | None:
    """Query rows ``start:stop`` (or the rows listed in ``order``) of a tensor that broadcasts over rows."""
    if x is None or x.ndim < 2 or x.shape[-2] == 1:
        return x
    return x[..., start:stop, :] if order is None else x.index_select(-2, order)


def _scaled_sdpa(q, k, v, multiplier: Multiplier, mask, additive, scale: float, dropout_p: float, groups: int):
    """``softmax(multiplier * (scale q k^T + additive)) v`` through SDPA, in blocks of query rows.

    A scalar multiplier goes into SDPA's ``scale``; a tensor one scales a block of
    query rows at a time.  Under a causal mask a block ``[start, stop)`` reaches keys
    ``[0, stop + diagonal)`` only, and its mask is a view of one 1-D buffer
    (see :func:`_causal_band`).  Rows with no allowed key are set to zero.
    """
    if groups > 1 and not _SDPA_HAS_GQA:
        k, v, groups = _repeat_heads(k, groups), _repeat_heads(v, groups), 1
    lq, lk = q.shape[-2], k.shape[-2]
    attends = _row_attends(mask, additive, q, lk)
    factor = multiplier if isinstance(multiplier, Tensor) else None
    if factor is None:
        scale *= multiplier
    scale_additive = additive is not None and (factor is not None or multiplier != 1)
    block = _block_rows(q, v, mask, additive if scale_additive else None, factor is not None)
    band = _causal_band(mask, lq, q) if isinstance(mask, StructuredMask) else None
    extra = {"enable_gqa": True} if groups > 1 else {}
    out = None
    for start in range(0, lq, block):
        stop = min(start + block, lq)
        keys, sdpa_mask, is_causal, order = _block_mask(mask, band, start, stop, lk, q)
        q_rows = _take_rows(q, start, stop, order)
        if factor is not None:
            q_rows = (q_rows * _take_rows(factor, start, stop, order)).to(q.dtype)
        if additive is not None:
            added = _take_rows(additive, start, stop)
            if scale_additive:
                added = added * (multiplier if factor is None else _take_rows(factor, start, stop))
            sdpa_mask = added.to(q.dtype)
        rows_out = F.scaled_dot_product_attention(
            q_rows, k[..., :keys, :], v[..., :keys, :], attn_mask=sdpa_mask, dropout_p=dropout_p,
            is_causal=is_causal, scale=scale, **extra,
        )
        rows_attend = _take_rows(attends, start, stop, order)
        if rows_attend is not None:
            rows_out = torch.where(rows_attend, rows_out, 0.0)
        if order is None and stop - start == lq:
            return rows_out
        if out is None:
            out = rows_out.new_empty(*rows_out.shape[:-2], lq, rows_out.shape[-1])
        if order is None:
            out[..., start:stop, :] = rows_out
        else:
            out.index_copy_(-2, order, rows_out)
    return out


def _block_rows(q: Tensor, v: Tensor, mask, scaled_additive: Tensor | None, scales_q: bool) -> int:
    """Query rows per block: all of them when nothing is copied per block, else a small fraction of ``q``."""
    lq, lk = q.shape[-2], v.shape[-2]
    copied_mask_bytes = 0
    if isinstance(mask, StructuredMask) and mask.causal_diagonal is not None and mask.key_lengths is not None:
        copied_mask_bytes = mask.key_lengths.shape[0] * lk * 5  # the block's bool mask and SDPA's float copy
    elif isinstance(mask, Tensor) and scales_q and mask.ndim >= 2 and mask.shape[-2] > 1:
        copied_mask_bytes = mask[..., 0, 0].numel() * lk * 4  # SDPA's float copy of the block's rows
    elif scaled_additive is not None:
        copied_mask_bytes = scaled_additive[..., 0, 0].numel() * lk * scaled_additive.element_size()
    # A causal diagonal other than 0 needs the banded mask (reversed rows) on every block.
    banded = isinstance(mask, StructuredMask) and mask.causal_diagonal not in (None, 0)
    if not (scales_q or banded or copied_mask_bytes):
        return lq
    heads = q[..., 0, 0].numel()
    row_bytes = copied_mask_bytes + 2 * heads * (q.shape[-1] + v.shape[-1]) * q.element_size()
    budget = max(_MIN_BLOCK_BYTES, q.numel() * q.element_size() // _BLOCKS_PER_Q)
    return max(1, min(lq, budget // row_bytes))


def _causal_band(mask: StructuredMask, lq: int, q: Tensor) -> Tensor | None:
    """1-D buffer of ``Z = lq + max(diagonal, 0)`` zeros then Z ``-inf`` whose strided views are causal masks.

    With the block's query rows reversed, the causal condition ``key <= row + diagonal``
    depends only on ``reversed_row + key``, so the block's additive mask is the
    Hankel view ``band[offset + reversed_row + key]`` (strides ``(1, 1)``): no
    per-block allocation.
    """
    if mask.causal_diagonal is None or mask.key_lengths is not None:
        return None
    zeros = lq + max(mask.causal_diagonal, 0)
    band = torch.zeros(2 * zeros, dtype=q.dtype, device=q.device)
    band[zeros:] = -math.inf
    return band


def _block_mask(mask, band: Tensor | None, start: int, stop: int, lk: int, q: Tensor):
    """(keys reached, SDPA mask, is_causal, row order) for query rows ``start:stop``.

    The row order is None (rows in order) or the row indices ``stop - 1, ..., start``
    when the mask is a band view, which needs the rows reversed.
    """
    if not isinstance(mask, StructuredMask):
        return lk, _take_rows(mask, start, stop), False, None
    diagonal, lengths = mask.causal_diagonal, mask.key_lengths
    # Rows whose keys all lie beyond ``keys`` have no allowed key and are zeroed by the caller.
    keys = lk if diagonal is None else max(1, min(lk, stop + diagonal))
    if lengths is not None:
        return keys, _structured_rows(mask, start, stop, keys, q), False, None
    if diagonal is None or start + diagonal >= keys - 1 or stop + diagonal <= 0:
        return keys, None, False, None
    if start == 0 and diagonal == 0:
        return keys, None, True, None
    offset = band.shape[0] // 2 - stop - diagonal
    view = band.as_strided((stop - start, keys), (1, 1), band.storage_offset() + offset)
    return keys, view, False, torch.arange(stop - 1, start - 1, -1, device=q.device)


def _structured_rows(mask: StructuredMask, start: int, stop: int, keys: int, q: Tensor) -> Tensor:
    """Bool mask (True = may attend) of query rows ``start:stop`` and the first ``keys`` keys."""
    key_index = torch.arange(keys, device=q.device)
    allowed = key_index < _batch_lengths(mask.key_lengths, q)  # (B, 1, ..., keys)
    if mask.causal_diagonal is not None:
        rows = torch.arange(start, stop, device=q.device)[:, None]
        allowed = allowed & (key_index <= rows + mask.causal_diagonal)  # (B, 1, rows, keys)
    return allowed
