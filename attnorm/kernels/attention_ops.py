"""The fused attention operators: ``torch.ops.attnorm.*_attention_{fwd,bwd}`` and their autograd.

Each fused family (``kernels/triton/attention_*.py``) is one forward and one backward
op in the ``attnorm`` namespace, so ``torch.compile`` and ``torch.export`` see them
(fake kernels give the shapes).  Their CPU and CUDA kernels are the Triton kernels:
on CPU tensors they run under ``TRITON_INTERPRET=1`` (how the tests check them) and
otherwise raise a clear error; :mod:`attnorm.routes.fused` only takes this route on
CUDA or with ``backend="triton"``.

=================================== ========================================== ==============
op                                  outputs                                    per-row stats
=================================== ========================================== ==============
``entmax_attention_fwd``            out, stats, W (``weighted=True``; else     ``(m, tau, N)``
                                    empty): ``sum g v / sum g`` per row
``entmax_attention_bwd``            dq, dk, dv, d alpha per head ``(Hq,)``,
                                    d sinks and d logit_scale per row
                                    ``(B, Hq, Lq)``
``self_adjusted_attention_fwd``     out, stats, out in float32 (half-precision 7 numbers
                                    plain, ``float_out=True``; else empty)
``self_adjusted_attention_bwd``     dq, dk, dv, d sinks per row ``(B, Hq, Lq)``
``topk_attention_fwd``              out, stats, out in float32 (half-precision 5 numbers
                                    inputs, ``float_out=True``; else empty)
``topk_attention_bwd``              dq, dk, dv, d sinks per row
=================================== ========================================== ==============

Eager calls go through :func:`attnorm.kernels.ops.call` (straight to the kernel when nothing
but the kernel would be dispatched to).
Masks travel as the four fields of :class:`~attnorm.kernels.rules.AttentionMask`; every
op takes ``float? softcap`` and ``Tensor? sinks`` (each row's sink score, broadcastable to
``(B, Hq, Lq)``), the entmax op also ``Tensor? logit_scale`` (a per-row multiplier of the
logits after the cap).  A per-row gradient comes back as ``(B, Hq, Lq)`` (empty when not
computed) and the autograd Functions sum it to the shape the input had.
The autograd Functions save ``q``, ``k``, ``v``, ``out`` and the per-row stats (entmax, when a
gradient will be taken and alpha's is not wanted, also ``W``, whose ``delta = dO . W`` spares its
backward a pass over K and V): nothing of size ``Lq x Lk``.  Their backward is not differentiable again.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from attnorm.kernels import backends, inductor, ops
from attnorm.kernels.rules import AttentionMask, accumulation_dtype, keeps_float_output, sum_to_shape

__all__ = ["entmax_attention", "self_adjusted_attention", "topk_attention"]

_LIBRARY = torch.library.Library("attnorm", "FRAGMENT")
_MASK = "Tensor? key_start, Tensor? key_stop, Tensor? dense, Tensor? additive"
_QKV = "Tensor q, Tensor k, Tensor v"
_BWD = "Tensor q, Tensor k, Tensor v, Tensor out, Tensor grad_out, Tensor stats"
_MODIFIERS = "float? softcap=None, Tensor? sinks=None"


@functools.cache
def _module(name: str) -> ModuleType:
    import importlib

    return importlib.import_module(f"attnorm.kernels.triton.{name}")


def _define(name: str, schema: str, kernel: Callable, fake: Callable) -> None:
    def device_kernel(*args):
        backends.resolve("triton", args[0].device)  # a clear error when Triton cannot run these tensors
        return kernel(*args)

    _LIBRARY.define(name + schema)
    _LIBRARY.impl(name, device_kernel, "CPU")
    _LIBRARY.impl(name, device_kernel, "CUDA")
    torch.library.register_fake(f"attnorm::{name}", fake, lib=_LIBRARY)
    inductor.register(f"attnorm::{name}", kernel, _LIBRARY)
    ops.register_eager(getattr(torch.ops.attnorm, name).default, device_kernel)


def _fake_forward(stats: int) -> Callable:
    def fake(q, k, v, *rest):
        out = q.new_empty(*q.shape[:-1], v.shape[-1])
        return out, q.new_empty(*q.shape[:-1], stats, dtype=accumulation_dtype(q.dtype))

    return fake


def _grads_like(q, k, v):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _row_grad(q: Tensor, values: Tensor | None) -> Tensor:
    """The shape of a per-row gradient ``(B, Hq, Lq)`` in the accumulation dtype (empty without ``values``)."""
    shape = q.shape[:3] if values is not None else (0,)
    return q.new_empty(shape, dtype=accumulation_dtype(q.dtype))


def _input_grad(ctx, index: int, grad: Tensor, values: Tensor | None) -> Tensor | None:
    """A per-row gradient ``(B, Hq, Lq)`` summed back to the shape of input ``index`` (which broadcast to it)."""
    if values is None or not ctx.needs_input_grad[index]:
        return None
    return sum_to_shape(grad, values.shape).to(values.dtype)


def _distinct(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``q, k, v`` as distinct tensor objects: Dynamo will not trace an autograd.Function given one tensor twice.

    Self-attention written ``attention(x, x, x)`` passes one tensor three times; an alias
    (a view, no copy) of each repeat keeps ``torch.compile(fullgraph=True)`` from breaking.
    """
    if k is q:
        k = k.view_as(k)
    if v is q or v is k:
        v = v.view_as(v)
    return q, k, v


# ---- entmax / sparsemax ---------------------------------------------------------------------------

def _entmax_fwd(q, k, v, start, stop, dense, additive, scale, alpha, alpha_heads, softcap=None, sinks=None,
                logit_scale=None, weighted=False):
    out, stats, w = _module("attention_entmax").entmax_attention_forward(
        q, k, v, AttentionMask(start, stop, dense, additive), scale, alpha, alpha_heads, softcap, sinks, logit_scale,
        weighted,
    )
    return out, stats, stats.new_empty(0) if w is None else w  # an op returns tensors: empty for "not asked"


def _fake_entmax_fwd(q, k, v, start, stop, dense, additive, scale, alpha, alpha_heads, softcap=None, sinks=None,
                     logit_scale=None, weighted=False):
    out, stats = _fake_forward(3)(q, k, v)
    return out, stats, stats.new_empty(out.shape if weighted else (0,))


_define(
    "entmax_attention_fwd",
    f"({_QKV}, {_MASK}, float scale, float alpha, Tensor? alpha_heads, {_MODIFIERS}, Tensor? logit_scale=None, "
    "bool weighted=False) -> (Tensor, Tensor, Tensor)",
    _entmax_fwd,
    _fake_entmax_fwd,
)


def _entmax_bwd(q, k, v, out, grad_out, stats, start, stop, dense, additive, scale, alpha, alpha_heads, alpha_grad,
                softcap=None, sinks=None, logit_scale=None, weighted=None):
    dq, dk, dv, d_alpha, d_sinks, d_logit_scale = _module("attention_entmax").entmax_attention_backward(
        q, k, v, out, grad_out, stats, AttentionMask(start, stop, dense, additive), scale, alpha, alpha_heads,
        alpha_grad, softcap, sinks, logit_scale, weighted if weighted is not None and weighted.numel() else None,
    )
    d_alpha = q.new_empty(0, dtype=accumulation_dtype(q.dtype)) if d_alpha is None else d_alpha
    # An op returns tensors: an empty one stands for a gradient not asked for.
    return (dq, dk, dv, d_alpha, _row_grad(q, None) if d_sinks is None else d_sinks,
            _row_grad(q, None) if d_logit_scale is None else d_logit_scale)


def _fake_entmax_bwd(q, k, v, out, grad_out, stats, start, stop, dense, additive, scale, alpha, alpha_heads,
                     alpha_grad, softcap=None, sinks=None, logit_scale=None, weighted=None):
    d_alpha = q.new_empty(q.shape[1] if alpha_grad else 0, dtype=accumulation_dtype(q.dtype))
    return *_grads_like(q, k, v), d_alpha, _row_grad(q, sinks), _row_grad(q, logit_scale)


_define(
    "entmax_attention_bwd",
    f"({_BWD}, {_MASK}, float scale, float alpha, Tensor? alpha_heads, bool alpha_grad, {_MODIFIERS}, "
    "Tensor? logit_scale=None, Tensor? weighted=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
    _entmax_bwd,
    _fake_entmax_bwd,
)


class _EntmaxAttention(torch.autograd.Function):
    @staticmethod
    def forward(q, k, v, start, stop, dense, additive, scale, alpha, alpha_heads, softcap, sinks, logit_scale,
                weighted):
        return ops.call(torch.ops.attnorm.entmax_attention_fwd.default, q, k, v, start, stop, dense, additive, scale,
                        alpha, alpha_heads, softcap, sinks, logit_scale, weighted)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, start, stop, dense, additive, ctx.scale, ctx.alpha, alpha_heads, ctx.softcap, sinks, logit_scale, _ = (
            inputs
        )
        ctx.save_for_backward(q, k, v, start, stop, dense, additive, alpha_heads, sinks, logit_scale, *output)
        ctx.mark_non_differentiable(output[1], output[2])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out, _grad_stats, _grad_weighted):
        q, k, v, start, stop, dense, additive, alpha_heads, sinks, logit_scale, out, stats, w = ctx.saved_tensors
        alpha_grad = alpha_heads is not None and ctx.needs_input_grad[9]
        dq, dk, dv, d_alpha, d_sinks, d_logit_scale = ops.call(
            torch.ops.attnorm.entmax_attention_bwd.default, q, k, v, out, grad_out.contiguous(), stats, start, stop,
            dense, additive, ctx.scale, ctx.alpha, alpha_heads, alpha_grad, ctx.softcap, sinks, logit_scale,
            w if w.numel() else None,
        )
        return (dq, dk, dv, None, None, None, None, None, None, d_alpha.to(alpha_heads.dtype) if alpha_grad else None,
                None, _input_grad(ctx, 11, d_sinks, sinks), _input_grad(ctx, 12, d_logit_scale, logit_scale), None)


def entmax_attention(q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask, scale: float, alpha: float,
                     alpha_heads: Tensor | None = None, softcap: float | None = None, sinks: Tensor | None = None,
                     logit_scale: Tensor | None = None) -> Tensor:
    """Fused alpha-entmax attention (``alpha`` in [1, 2], or per query head ``alpha_heads (Hq,)``).

    ``softcap`` caps the scaled scores, ``sinks`` (broadcastable to ``(B, Hq, Lq)``) are each
    row's sink logit, ``logit_scale`` (likewise) multiplies each row's logits after the cap;
    ``sinks`` and ``logit_scale`` get gradients.
    """
    q, k, v = _distinct(q, k, v)
    return _EntmaxAttention.apply(q, k, v, *mask, scale, alpha, alpha_heads, softcap, sinks, logit_scale,
                                  _keeps_weighted(q, k, v, alpha_heads, sinks, logit_scale))[0]


def _keeps_weighted(q: Tensor, k: Tensor, v: Tensor, alpha_heads: Tensor | None, sinks: Tensor | None,
                    logit_scale: Tensor | None) -> bool:
    """Whether the forward should keep ``W`` for the backward's ``delta`` (``entmax_attention_forward(weighted=)``).

    When a gradient will be taken and alpha's is not among them (alpha's needs the row pass over K and V
    anyway): one ``(B, Hq, Lq, Dv)`` tensor more between forward and backward, one pass over K and V less.
    """
    if alpha_heads is not None and alpha_heads.requires_grad:
        return False
    return ops.records_grad(q, k, v, sinks, logit_scale)


# ---- Self-Adjusted Softmax and top-k: forward (out, stats), backward (dq, dk, dv, d sinks) -------


def _split_modifiers(values: tuple, count: int) -> tuple[tuple, float | None, Tensor | None, object]:
    """``(family parameters, softcap, sinks, float_out or out_float)`` of an op's trailing arguments
    (trailing defaults may be dropped: None for each)."""
    extra = values[count:] + (None, None, None)
    return values[:count], extra[0], extra[1], extra[2]


def _define_family(family: str, params: str, stats: int) -> None:
    """``attnorm::<family>_attention_{fwd,bwd}`` over ``triton/attention_<family>.py``'s two functions.

    The forward takes ``bool float_out`` and returns a third tensor, the output in the
    accumulation dtype (half-precision inputs with ``float_out``; else empty), which the
    backward takes as ``Tensor? out_float`` for its ``delta`` (:func:`topk_attention`).
    """
    module = f"attention_{family}"
    count = len(params.split(","))

    def forward(q, k, v, start, stop, dense, additive, scale, *values):
        function = getattr(_module(module), f"{family}_attention_forward")
        family_params, softcap, sinks, wanted = _split_modifiers(values, count)
        mask = AttentionMask(start, stop, dense, additive)
        out, stats, out_float = function(q, k, v, mask, scale, *family_params, softcap, sinks, bool(wanted))
        return out, stats, stats.new_empty(0) if out_float is None else out_float  # an op returns tensors

    def backward(q, k, v, out, grad_out, stats, start, stop, dense, additive, scale, *values):
        function = getattr(_module(module), f"{family}_attention_backward")
        family_params, softcap, sinks, out_float = _split_modifiers(values, count)
        out_float = out_float if out_float is not None and out_float.numel() else None
        dq, dk, dv, d_sinks = function(q, k, v, out, grad_out, stats, AttentionMask(start, stop, dense, additive),
                                       scale, *family_params, softcap, sinks, out_float)
        return dq, dk, dv, _row_grad(q, None) if d_sinks is None else d_sinks

    def fake_forward(q, k, v, start, stop, dense, additive, scale, *values):
        out, row_stats = _fake_forward(stats)(q, k, v)
        wanted = keeps_float_output(q.dtype, _split_modifiers(values, count)[3])
        return out, row_stats, row_stats.new_empty(out.shape if wanted else (0,))

    def fake_backward(q, k, v, out, grad_out, stats, start, stop, dense, additive, scale, *values):
        return *_grads_like(q, k, v), _row_grad(q, _split_modifiers(values, count)[2])

    _define(f"{family}_attention_fwd",
            f"({_QKV}, {_MASK}, float scale, {params}, {_MODIFIERS}, bool float_out=False) -> (Tensor, Tensor, Tensor)",
            forward, fake_forward)
    _define(f"{family}_attention_bwd",
            f"({_BWD}, {_MASK}, float scale, {params}, {_MODIFIERS}, Tensor? out_float=None) "
            "-> (Tensor, Tensor, Tensor, Tensor)",
            backward, fake_backward)


_define_family("self_adjusted", "bool normalized", 7)
_define_family("topk", "float k_keep, bool is_fraction, float temperature", 5)


class _FamilyAttention(torch.autograd.Function):
    """Forward op, then the backward op on the saved ``q, k, v``, mask, sinks, ``out`` and stats (no ``Lq x Lk``).

    ``float_out``: whether the forward also returns the output in the accumulation dtype for
    the backward's ``delta`` (kept for half-precision inputs only).
    """

    @staticmethod
    def forward(family, float_out, q, k, v, start, stop, dense, additive, sinks, scale, softcap, *params):
        forward_op = getattr(torch.ops.attnorm, f"{family}_attention_fwd").default
        return ops.call(forward_op, q, k, v, start, stop, dense, additive, scale, *params, softcap, sinks, float_out)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.family, _, q, k, v, start, stop, dense, additive, sinks, ctx.scale, ctx.softcap, *ctx.params = inputs
        ctx.save_for_backward(q, k, v, start, stop, dense, additive, sinks, *output)
        ctx.mark_non_differentiable(*output[1:])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out, *_grad_rest):
        q, k, v, start, stop, dense, additive, sinks, out, stats, out_float = ctx.saved_tensors
        backward_op = getattr(torch.ops.attnorm, f"{ctx.family}_attention_bwd").default
        dq, dk, dv, d_sinks = ops.call(backward_op, q, k, v, out, grad_out.contiguous(), stats, start, stop, dense,
                                       additive, ctx.scale, *ctx.params, ctx.softcap, sinks,
                                       out_float if out_float.numel() else None)
        return (None, None, dq, dk, dv, None, None, None, None, _input_grad(ctx, 9, d_sinks, sinks), None, None,
                *([None] * len(ctx.params)))


def self_adjusted_attention(q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask, scale: float, normalized: bool,
                            softcap: float | None = None, sinks: Tensor | None = None) -> Tensor:
    """Fused Self-Adjusted Softmax attention (both variants); ``softcap``, ``sinks`` as :func:`entmax_attention`'s.

    With half-precision inputs, the plain variant and a gradient to take, the forward also keeps
    the output in float32 for the backward's ``P = rowsum(dO out)`` (as :func:`topk_attention`).
    """
    q, k, v = _distinct(q, k, v)
    float_out = not normalized and ops.records_grad(q, k, v, sinks)
    return _FamilyAttention.apply("self_adjusted", float_out, q, k, v, *mask, sinks, scale, softcap, normalized)[0]


def topk_attention(q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask, scale: float, k_keep: float,
                   temperature: float, softcap: float | None = None, sinks: Tensor | None = None) -> Tensor:
    """Fused exact top-k attention: ``k_keep`` keys per row (a fraction of the allowed keys when in (0, 1)).

    ``softcap`` and ``sinks`` as :func:`entmax_attention`'s; a sink may take one of the
    ``k_keep`` slots but is not one of the allowed keys a fraction counts.

    With half-precision inputs and a gradient to take, the forward also keeps the output in
    float32 (``Dv`` floats per row more between forward and backward): ``delta =
    rowsum(dO out)`` from the rounded output cancelled against ``dP`` in rows whose weight
    sits on few keys (``ds = p (dP - delta)``), which top-k's are.
    """
    is_fraction = isinstance(k_keep, float) and 0 < k_keep < 1
    q, k, v = _distinct(q, k, v)
    # Asked whenever a gradient will be taken; the op keeps it for half-precision inputs only.
    float_out = ops.records_grad(q, k, v, sinks)
    return _FamilyAttention.apply("topk", float_out, q, k, v, *mask, sinks, scale, softcap, float(k_keep),
                                  is_fraction, float(temperature))[0]
