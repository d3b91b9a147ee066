"""A sink per row, in pure torch: the row operation on the extended row ``[x, sink]``.

An attention sink is a virtual key appended to every row (after its last position)
whose score is ``sink`` and whose value is zero: it takes part in the normalizer like
a key and its weight is then dropped (gpt-oss's ``s_aux``; softmax_1 is a sink of
score 0).  ``kernels/README.md`` ("A sink per row") states the rules; in short, the
sink is always allowed, is scaled like a key, takes part in every row statistic, may
take a top-k slot and loses every tie (it has the highest index), and is **not
counted in n** (Scalable-Softmax's ``log n``, top-k's fraction).

Here the extended row is built with one concatenation: this is the oracle the native
and Triton kernels are tested against, and what devices without them run.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from attnorm.kernels import rules
from attnorm.kernels.reference.rows import as_param, finish, masked_softmax, rows_of, shifted_scaled
from attnorm.kernels.reference.softmax import self_adjusted_softmax, softmax, topk_keep
from attnorm.kernels.reference.sparse import entmax

__all__ = ["append", "extend", "extended_weights", "sink_column", "weights_of"]


def sink_column(sink: float | Tensor, x: Tensor) -> Tensor:
    """The sink as a column ``x.shape[:-1] + (1,)`` in ``x``'s dtype.

    ``sink`` is a number, a per-row tensor of shape ``x.shape[:-1]``, or a tensor with
    ``x.ndim`` dims and last dim 1 broadcastable to ``x``.
    """
    rows = x.shape[:-1] + (1,)
    if not isinstance(sink, Tensor):
        return torch.full(rows, float(sink), dtype=x.dtype, device=x.device)
    if sink.ndim == x.ndim - 1:
        sink = sink.unsqueeze(-1)
    return sink.to(x.dtype).expand(rows)


def append(row: Tensor, last: float | Tensor | None = None) -> Tensor:
    """``[row, last]``: rows extended by one value each (as :func:`sink_column` takes it; 0 when None).

    Differentiable in ``row`` and ``last`` (a broadcast ``last`` gets its gradient summed back).
    """
    return torch.cat([row, sink_column(0.0 if last is None else last, row)], dim=-1)


def extend(x: Tensor, mask: rules.RowMask, sink: float | Tensor) -> tuple[Tensor, rules.RowMask, Tensor]:
    """``[x, sink]``, its mask (the sink always allowed) and the real allowed positions per row ``(..., 1)``."""
    real = rules.allowed(x, mask).expand(x.shape)
    keep = torch.cat([real, real.new_ones(real.shape[:-1] + (1,))], dim=-1)
    return append(x, sink), rules.RowMask(keep, None, None), rules.allowed_count(real)


def extended_weights(kernel: str, x: Tensor, mask: rules.RowMask, sink: float | Tensor, **params: Any) -> Tensor:
    """Weights of the extended row ``[x, sink]``, shape ``x.shape[:-1] + (L + 1,)``: the sink's is the last.

    Args:
        kernel: the row operation (``"softmax"``, ``"scalable_softmax"``, ``"topk_softmax"``,
            ``"entmax"``, ``"sparsemax"``, ``"self_adjusted_softmax"``).
        x: scores ``(..., L)``.
        mask: which real positions each row may use.
        sink: the sink's score per row (see :func:`sink_column`).
        params: the operation's parameters, as its reference function takes them
            (``temperature``; ``s``, ``bias``; ``k``, ``is_fraction``, ``temperature``;
            ``alpha``; ``normalized``).

    Returns:
        Weights over the real positions and the sink, differentiable in ``x``, ``sink``
        and tensor parameters.

    Raises:
        ValueError: an unknown ``kernel``.
    """
    return weights_of(kernel, *extend(x, mask, sink), **params)


def weights_of(kernel: str, extended: Tensor, keep: rules.RowMask, count: Tensor, **params: Any) -> Tensor:
    """:func:`extended_weights` from :func:`extend`'s outputs (``count``: the real allowed keys per row)."""
    if kernel == "softmax":
        return softmax(extended, keep, params["temperature"])
    if kernel == "entmax":
        return entmax(extended, keep, params["alpha"])
    if kernel == "sparsemax":
        return entmax(extended, keep, 2.0)
    if kernel == "self_adjusted_softmax":
        return self_adjusted_softmax(extended, keep, params["normalized"])
    rows = rows_of(extended, keep)
    if kernel == "scalable_softmax":
        # n counts the real keys only; the multiplier scales the sink like a key.
        log_count = torch.log(count.clamp_min(1).to(extended.dtype))
        multiplier = as_param(params["s"], extended) * log_count + as_param(params["bias"], extended)
        return finish(masked_softmax(shifted_scaled(rows, multiplier), rows), rows)
    if kernel == "topk_softmax":
        k, is_fraction = params["k"], params["is_fraction"]
        # A fraction is of the real keys (at least one slot, which the sink may take); an
        # integer k counts slots over the real keys and the sink.
        slots = (rules.topk_row_count(k, True, count).clamp_min(1) if is_fraction
                 else rules.topk_row_count(k, False, rules.allowed_count(rows.allowed)))
        kept = topk_keep(extended, rows, k, is_fraction, slots)
        multiplier = 1 / as_param(params["temperature"], extended)
        return finish(masked_softmax(shifted_scaled(rows, multiplier), rows, kept), rows)
    raise ValueError(f"no row operation {kernel!r} takes a sink")

