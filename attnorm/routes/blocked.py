"""Blocked route: any normalizer on any device in bounded memory, training included.

Query rows are processed in blocks: a block's scores ``(..., rows, Lk)`` are built,
normalised by the normalizer's own row kernels and multiplied by ``v``; only the
block's output is kept.  The backward recomputes each block's scores and weights
from ``q``, ``k`` and ``v`` (nothing of size ``Lq x Lk`` is saved) and
differentiates the block with autograd, so ``q``, ``k``, ``v``, an additive mask and
every learnable parameter of the normalizer get their gradients.  Dropout is
replayed exactly: the random state is saved before the forward's first block and
restored before the backward's.

A block holds ``rows`` query rows of every head and batch element, sized so its
float32 scores take at most ``max(MIN_BLOCK_BYTES, (q + k + v bytes) / BLOCKS_PER_INPUTS)``:
peak memory stays within a small multiple of the inputs whatever ``Lq x Lk`` is.
With grouped-query attention the query heads of a group are stacked on the row axis
(``(B, Hkv, groups * rows, D)``), so keys and values are never repeated.

The backward is not differentiable again (no double backward through this route).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from attnorm.masks import StructuredMask
from attnorm.routes.common import structured_rows

__all__ = ["BLOCKS_PER_INPUTS", "MIN_BLOCK_BYTES", "block_rows", "blocked_attention"]

MIN_BLOCK_BYTES = 1 << 22
BLOCKS_PER_INPUTS = 8


def block_rows(q: Tensor, k: Tensor, v: Tensor) -> int:
    """Query rows per block (all of them when the whole score matrix fits the budget)."""
    budget = max(MIN_BLOCK_BYTES, (q.nbytes + k.nbytes + v.nbytes) // BLOCKS_PER_INPUTS)
    row_bytes = 4 * q[..., 0, 0].numel() * max(k.shape[-2], 1)
    return max(1, min(q.shape[-2], budget // row_bytes))


def blocked_attention(normalizer, q: Tensor, k: Tensor, v: Tensor, mask, additive: Tensor | None, scale: float,
                      dropout_p: float, groups: int, rows: int) -> Tensor:
    """``normalizer(scale q k^T + additive, mask) v`` a block of ``rows`` query rows at a time."""
    params = tuple(parameter for parameter in normalizer.parameters() if parameter.requires_grad)
    return _BlockedAttention.apply(normalizer, mask, scale, dropout_p, groups, rows, q, k, v, additive, *params)


def _rows(x: Tensor | None, start: int, stop: int) -> Tensor | None:
    """Rows ``start:stop`` of a tensor that broadcasts over query rows."""
    return x if x is None or x.ndim < 2 or x.shape[-2] == 1 else x[..., start:stop, :]


def _block(normalizer, q: Tensor, q_rows: Tensor, k: Tensor, v: Tensor, mask, additive_rows: Tensor | None,
           scale: float, dropout_p: float, groups: int, start: int, stop: int) -> Tensor:
    """The output rows ``start:stop`` of the attention, from the query rows ``q_rows = q[..., start:stop, :]``."""
    if groups > 1:
        # (B, Hkv * g, rows, D) -> (B, Hkv, g * rows, D): one product with each key head, no repeated keys.
        lead, rows = q_rows.shape[:-3], stop - start
        stacked = q_rows.reshape(*lead, k.shape[-3], groups * rows, q.shape[-1])
        scores = torch.matmul(stacked, k.transpose(-2, -1)).reshape(*lead, q.shape[-3], rows, k.shape[-2])
    else:
        scores = torch.matmul(q_rows, k.transpose(-2, -1))  # (..., Hq, rows, Lk)
    scores = scores * scale
    if additive_rows is not None:
        scores = scores + additive_rows
    if isinstance(mask, StructuredMask):
        mask = structured_rows(mask, q, start, stop, k.shape[-2])
    else:
        mask = _rows(mask, start, stop)
    weights = normalizer(scores, mask)
    if dropout_p > 0:
        weights = F.dropout(weights, dropout_p)
    if groups > 1:
        lead, rows = weights.shape[:-3], stop - start
        stacked = weights.reshape(*lead, v.shape[-3], groups * rows, v.shape[-2])
        return torch.matmul(stacked, v).reshape(*lead, q.shape[-3], rows, v.shape[-1])
    return torch.matmul(weights, v)


def _rng_state(device: torch.device) -> Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_rng_state(state: Tensor, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class _BlockedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, normalizer, mask, scale, dropout_p, groups, rows, q, k, v, additive, *params):
        ctx.setup = (normalizer, mask, scale, dropout_p, groups, rows)
        ctx.rng = _rng_state(q.device) if dropout_p > 0 else None
        ctx.save_for_backward(q, k, v, additive)
        lq = q.shape[-2]
        out = q.new_empty(*q.shape[:-1], v.shape[-1])
        for start in range(0, lq, rows):
            stop = min(start + rows, lq)
            out[..., start:stop, :] = _block(normalizer, q, q[..., start:stop, :], k, v, mask,
                                             _rows(additive, start, stop), scale, dropout_p, groups, start, stop)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        normalizer, mask, scale, dropout_p, groups, rows = ctx.setup
        q, k, v, additive = ctx.saved_tensors
        params = tuple(parameter for parameter in normalizer.parameters() if parameter.requires_grad)
        k = k.detach().requires_grad_(ctx.needs_input_grad[7])
        v = v.detach().requires_grad_(ctx.needs_input_grad[8])
        wants_additive = additive is not None and ctx.needs_input_grad[9]
        if not (ctx.needs_input_grad[6] or k.requires_grad or v.requires_grad or wants_additive or params):
            return (None,) * (10 + len(params))
        dq = torch.zeros_like(q) if ctx.needs_input_grad[6] else None
        dk = dv = dadditive = None
        dparams = [None] * len(params)
        inputs = [t for t in (k, v) if t.requires_grad] + list(params)
        lq = q.shape[-2]
        with torch.random.fork_rng(devices=[q.device] if q.device.type == "cuda" else [], enabled=dropout_p > 0):
            if ctx.rng is not None:
                _set_rng_state(ctx.rng, q.device)
            for start in range(0, lq, rows):
                stop = min(start + rows, lq)
                with torch.enable_grad():
                    q_rows = q[..., start:stop, :].detach().requires_grad_(dq is not None)
                    additive_rows = _rows(additive, start, stop)
                    if wants_additive:
                        additive_rows = additive_rows.detach().requires_grad_()
                    out = _block(normalizer, q, q_rows, k, v, mask, additive_rows, scale, dropout_p, groups,
                                 start, stop)
                    wanted = inputs + ([q_rows] if dq is not None else []) + ([additive_rows] if wants_additive else [])
                    grads = list(torch.autograd.grad(out, wanted, grad_out[..., start:stop, :], allow_unused=True))
                if wants_additive:
                    grad = grads.pop()
                    if grad is not None and additive.shape[-2] > 1:
                        dadditive = additive.new_zeros(additive.shape) if dadditive is None else dadditive
                        dadditive[..., start:stop, :] += grad
                    else:
                        dadditive = _add(dadditive, grad)
                if dq is not None:
                    grad = grads.pop()
                    if grad is not None:
                        dq[..., start:stop, :] = grad
                if k.requires_grad:
                    dk = _add(dk, grads.pop(0))
                if v.requires_grad:
                    dv = _add(dv, grads.pop(0))
                dparams = [_add(total, grad) for total, grad in zip(dparams, grads, strict=True)]
        return (None, None, None, None, None, None, dq, dk, dv, dadditive, *dparams)


def _add(total: Tensor | None, grad: Tensor | None) -> Tensor | None:
    if grad is None:
        return total
    return grad if total is None else total + grad
