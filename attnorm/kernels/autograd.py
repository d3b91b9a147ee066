"""The row operations as differentiable functions: each op's forward paired with its backward.

One ``torch.autograd.Function`` per family, in the form ``torch.func`` and
``torch.compile`` both accept (``setup_context``, ``generate_vmap_rule``):
``vmap``, ``grad``, ``jacrev`` and ``compile(fullgraph=True)`` all go through it.
Each backward calls the family's backward op; when autograd records the backward
itself (double backward, ``torch.func`` transforms) it uses the same closed forms
written in differentiable torch (:mod:`attnorm.kernels.reference.jacobians`), so
second derivatives stay exact.

The entry points (:func:`softmax`, :func:`scalable_softmax`, ...) take scores
normalised over the last axis, a :class:`~attnorm.kernels.rules.RowMask` and
parameters (numbers, or tensors ``(..., 1)`` broadcast against the scores); they
resolve the backend (:mod:`attnorm.kernels.backends`), call the reference directly
for ``"reference"``, and otherwise the op itself when nothing needs a gradient
(one dispatcher call) or the Function.  A plain eager call (:func:`_lane`: nothing
watches it, no tensor subclass) skips the dispatcher: with no gradient needed it runs
the backend's forward directly with ``weights_only=True``, which is what the op's kernel
would run, less the statistics only a backward reads; with one, the Function's forward
runs the op's device kernel itself.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor
from torch.autograd import Function, forward_ad

from attnorm.kernels import backends, ops, reference, rules, shortcut
from attnorm.kernels.reference import jacobians, sinks
from attnorm.kernels.reference.rows import cap_slope, capped
from attnorm.kernels.rules import NO_MASK, RowMask, sum_to_shape

__all__ = ["entmax", "scalable_softmax", "self_adjusted_softmax", "softmax", "sparsemax", "topk_softmax"]

Param = float | Tensor

_NO_PARAM_GRAD, _TEMPERATURE_GRAD, _MULTIPLIER_GRAD = 0, 1, 2


def _split(value: Param) -> tuple[float, Tensor | None]:
    """A parameter as the ops take it: a number, and a tensor that replaces it when given."""
    return (1.0, value) if isinstance(value, Tensor) else (float(value), None)


def _param_grad(per_row: Tensor, param: Tensor) -> Tensor:
    """Per-row gradients (``x.shape[:-1]``) reduced to the shape and dtype of the parameter."""
    return sum_to_shape(per_row.unsqueeze(-1), param.shape).to(param.dtype)


def _live(posinf_row: Tensor, value: Tensor) -> Tensor:
    """``value`` per row, 0 in rows holding +inf (bool ``(..., 1)``), where the kernel zeroed the multiplier."""
    return torch.where(posinf_row, 0.0, value)


def _split_sink(dx: Tensor, sink: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """``dx`` over an extended row as the real positions' gradient and the sink's (None without a sink)."""
    return (dx, None) if sink is None else (dx[..., :-1], dx[..., -1])


def _like_weights(x: Tensor | None, y: Tensor) -> Tensor | None:
    """The raw scores a backward op reads, in the saved weights' dtype (the op's precision follows them).

    They differ under autocast: the forward op ran in float32 (its autocast rule) on half-precision
    scores, and the Function saved the scores as they came; the native kernels take no half precision.
    """
    return x if x is None or x.dtype == y.dtype else x.to(y.dtype)


def _softmax_grads(ctx, y: Tensor, sink: Tensor | None, sink_weight: Tensor | None, grad: Tensor,
                   multiplier: Tensor, m: Callable[[Tensor], Tensor], param_grad: int, x: Tensor | None = None):
    """``dx``, the per-row parameter gradient and ``dsink`` of ``y = softmax(m x)``, from the saved output.

    ``m(posinf_row)`` gives the multiplier as a differentiable function of the parameters, ``(..., 1)``,
    0 in the rows holding +inf (bool ``(..., 1)``: read from the scores when given, else where the kernel's
    multiplier is 0, which a multiplier may also be elsewhere, ``s log n + bias = 0``): called only when
    autograd records the backward (a first-order backward runs no torch op for
    it: on CUDA that was up to four launches a call).  ``x`` holds the raw scores when the forward
    was soft-capped (``ctx.softcap``), or when ``param_grad`` needs them.
    """
    softcap = ctx.softcap
    if not torch.is_grad_enabled():
        dx, per_row, dsink = ops.call(ops.softmax_bwd, y, grad, multiplier, _like_weights(x, y), param_grad,
                                      sink_weight, sink, softcap, ctx.backend)
        return dx, per_row if param_grad else None, dsink if sink is not None else None
    # Recorded by autograd (double backward, torch.func): the same closed forms, differentiable.
    raw = x
    if softcap is not None:
        x = capped(raw, softcap)
    if sink is not None:
        y, grad = sinks.append(y, _sink_weight_of(y, sink_weight)), sinks.append(grad)
        x = None if x is None else sinks.append(x, sink)
    posinf_row = multiplier.unsqueeze(-1) == 0 if x is None else ((x == math.inf) & (y > 0)).any(-1, keepdim=True)
    m = m(posinf_row)
    dx, dsink = _split_sink(jacobians.softmax_vjp(y, grad, m), sink)
    if softcap is not None:
        dx = dx * cap_slope(raw, softcap)
    per_row = None
    if param_grad == _TEMPERATURE_GRAD:
        per_row = jacobians.temperature_grad(y, grad, m).squeeze(-1)
    elif param_grad == _MULTIPLIER_GRAD:
        per_row = jacobians.multiplier_grad(y, grad, x).squeeze(-1)  # 0 in rows holding +inf
    return dx, per_row, dsink


def _temperature_multiplier(multiplier: Tensor, temperature_rows: Tensor | None, posinf_row: Tensor) -> Tensor:
    if temperature_rows is None:
        return multiplier.unsqueeze(-1)
    return _live(posinf_row, 1 / temperature_rows)


def _sink_grad(dsink: Tensor | None, sink: Tensor | None, wanted: bool) -> Tensor | None:
    """The sink column's gradient from the per-row ``dsink``."""
    return _param_grad(dsink, sink) if wanted and dsink is not None else None


class _RowFunction(Function):
    """Base of the row Functions: vmap through the ops' rules, and ``forward``'s signature computed once.

    ``eager_apply`` is ``apply`` without what only transforms need: ``Function.apply`` binds
    the arguments to ``forward``'s signature (ours takes ``*args``: nothing to bind) and
    unwraps dead functorch wrappers on every call, about 5 us; :func:`_call` uses it
    outside ``torch.compile`` and ``torch.func`` transforms, unwrapping itself.

    Every forward op returns the sink's weight last (empty without a sink), marked
    non-differentiable: see :func:`_sink_weight_of` for how a double backward still
    differentiates through it.
    """

    generate_vmap_rule = True

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        cls.forward.__signature__ = inspect.signature(cls.forward)  # inspect.signature reads it first
        cls.eager_apply = super(Function, cls).apply  # the C apply that Function.apply ends in


def _forward(op, args: tuple) -> Any:
    """A row Function's forward: ``op(*args)``, or what :func:`shortcut.apply_with` has it run in its place.

    The module shortcut applies a Function whose call it has seen end in one replayed launch
    on the scores; the forward then replays it directly (a pending ``(entry, stream)``).  A
    plain eager call (:func:`_call` with ``_PLAIN_GRAD``) hands the op's device kernel itself,
    which the forward runs without :func:`ops.call`'s checks, already made by :func:`_lane`.
    """
    pending = shortcut.take()
    if pending is None:
        out = ops.call(op, *args)
    elif type(pending) is tuple:
        entry, stream = pending
        return entry.outputs(args[0], stream)
    else:
        out = pending(*args)
    if shortcut.listening():
        shortcut.note_outputs(out)
    return out


def _sink_pair(sink: Tensor | None, sink_weight: Tensor) -> tuple[Tensor | None, Tensor | None]:
    """The sink column and its weight, saved last for the backward (None without a sink)."""
    return (None, None) if sink is None else (sink, sink_weight)


def _sink_weight_of(y: Tensor, sink_weight: Tensor) -> Tensor:
    """The sink's weight as a differentiable function of the saved weights ``y``, per row.

    The sink's weight is an output the Functions mark non-differentiable (so compiled
    backwards get no tangent for it and keep the kernels), yet the closed forms a double
    backward differentiates read it.  Softmax, top-k and entmax rows sum to 1 with the
    sink, so ``w = 1 - sum(y)``: the value here is the kernel's (no cancellation), the
    derivative that of ``1 - sum(y)``.
    """
    total = y.sum(-1)
    return sink_weight + (total.detach() - total)


class _Softmax(_RowFunction):

    @staticmethod
    def forward(*args):
        return _forward(ops.softmax_fwd, args)

    @staticmethod
    def setup_context(ctx, inputs, output):
        temperature_rows, sink, ctx.softcap, ctx.backend = inputs[-4:]
        y, multiplier, sink_weight = output
        ctx.mark_non_differentiable(multiplier, sink_weight)
        raw = inputs[0] if ctx.softcap is not None else None
        ctx.save_for_backward(y, multiplier, temperature_rows, raw, *_sink_pair(sink, sink_weight))

    @staticmethod
    def backward(ctx, grad, _grad_multiplier, _grad_sink_weight):
        dx, d_temperature, dsink = _temperature_backward(ctx, grad, ctx.needs_input_grad[5],
                                                         ctx.needs_input_grad[6])
        return dx, None, None, None, None, d_temperature, dsink, None, None


def _temperature_backward(ctx, grad: Tensor, wants_temperature: bool, wants_sink: bool) -> tuple[Tensor | None, ...]:
    """Gradients of ``softmax(x / T)`` over fixed positions: ``(dx, dT, dsink)``."""
    y, multiplier, temperature_rows, raw, sink, sink_weight = ctx.saved_tensors
    param_grad = _TEMPERATURE_GRAD if wants_temperature else _NO_PARAM_GRAD
    dx, per_row, dsink = _softmax_grads(ctx, y, sink, sink_weight, grad, multiplier,
                                        lambda posinf_row: _temperature_multiplier(multiplier, temperature_rows,
                                                                                   posinf_row), param_grad, raw)
    d_temperature = _param_grad(per_row, temperature_rows) if wants_temperature else None
    return dx, d_temperature, _sink_grad(dsink, sink, wants_sink)


class _ScalableSoftmax(_RowFunction):

    @staticmethod
    def forward(*args):
        return _forward(ops.scalable_softmax_fwd, args)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, (ctx.s, s_rows, ctx.bias, bias_rows, sink, ctx.softcap, ctx.backend) = inputs[0], inputs[4:]
        y, multiplier, log_count, sink_weight = output
        ctx.mark_non_differentiable(multiplier, log_count, sink_weight)
        wants_x = (ctx.softcap is not None or (s_rows is not None and s_rows.requires_grad)
                   or (bias_rows is not None and bias_rows.requires_grad))
        ctx.save_for_backward(y, multiplier, log_count, x if wants_x else None, s_rows, bias_rows,
                              *_sink_pair(sink, sink_weight))

    @staticmethod
    def backward(ctx, grad, _grad_multiplier, _grad_log_count, _grad_sink_weight):
        y, multiplier, log_count, x, s_rows, bias_rows, sink, sink_weight = ctx.saved_tensors
        wants_s, wants_bias = ctx.needs_input_grad[5], ctx.needs_input_grad[7]
        s = ctx.s if s_rows is None else s_rows
        bias = ctx.bias if bias_rows is None else bias_rows
        param_grad = _MULTIPLIER_GRAD if wants_s or wants_bias else _NO_PARAM_GRAD
        dx, d_multiplier, dsink = _softmax_grads(ctx, y, sink, sink_weight, grad, multiplier,
                                                 lambda posinf_row: _live(posinf_row,
                                                                          s * log_count.unsqueeze(-1) + bias),
                                                 param_grad, x)
        d_s = _param_grad(d_multiplier * log_count, s_rows) if wants_s else None
        d_bias = _param_grad(d_multiplier, bias_rows) if wants_bias else None
        dsink = _sink_grad(dsink, sink, ctx.needs_input_grad[8])
        return dx, None, None, None, None, d_s, None, d_bias, dsink, None, None


class _TopKSoftmax(_RowFunction):

    @staticmethod
    def forward(*args):
        return _forward(ops.topk_softmax_fwd, args)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _Softmax.setup_context(ctx, inputs, output)

    @staticmethod
    def backward(ctx, grad, _grad_multiplier, _grad_sink_weight):
        dx, d_temperature, dsink = _temperature_backward(ctx, grad, ctx.needs_input_grad[7],
                                                         ctx.needs_input_grad[8])
        return dx, None, None, None, None, None, None, d_temperature, dsink, None, None


class _Entmax(_RowFunction):

    @staticmethod
    def forward(*args):
        return _forward(ops.entmax_fwd, args)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.alpha, alpha_rows, sink, ctx.softcap, ctx.backend = inputs[4:]
        y, gate, sink_weight = output
        ctx.mark_non_differentiable(gate, sink_weight)
        raw = inputs[0] if ctx.softcap is not None else None
        ctx.save_for_backward(y, gate, alpha_rows, raw, *_sink_pair(sink, sink_weight))

    @staticmethod
    def backward(ctx, grad, _grad_gate, _grad_sink_weight):
        y, gate, alpha_rows, raw, sink, sink_weight = ctx.saved_tensors
        wants = ctx.needs_input_grad[5]
        if not torch.is_grad_enabled():
            dx, per_row, dsink = ops.call(ops.entmax_bwd, y, grad, gate, ctx.alpha, alpha_rows, wants, sink_weight,
                                          _like_weights(raw, y), ctx.softcap, ctx.backend)
        else:
            alpha = ctx.alpha if alpha_rows is None else alpha_rows
            if sink is not None:
                y, grad = sinks.append(y, _sink_weight_of(y, sink_weight)), sinks.append(grad)
            dx, dsink = _split_sink(jacobians.entmax_vjp(y, grad, gate.unsqueeze(-1), alpha), sink)
            if ctx.softcap is not None:
                dx = dx * cap_slope(raw, ctx.softcap)
            per_row = jacobians.entmax_alpha_grad(y, grad, gate.unsqueeze(-1), alpha).squeeze(-1) if wants else None
        d_alpha = _param_grad(per_row, alpha_rows) if wants else None
        return dx, None, None, None, None, d_alpha, _sink_grad(dsink, sink, ctx.needs_input_grad[6]), None, None


class _SelfAdjustedSoftmax(_RowFunction):

    @staticmethod
    def forward(*args):
        return _forward(ops.self_adjusted_softmax_fwd, args)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, mask, ctx.diagonal, key_lengths, ctx.normalized, sink, ctx.softcap, ctx.backend = inputs
        _, stats, sink_weight = output
        # The backward recomputes from x and the sink: the sink's weight is not read.
        ctx.mark_non_differentiable(stats, sink_weight)
        ctx.save_for_backward(x, mask, key_lengths, stats, sink)

    @staticmethod
    def backward(ctx, grad, _grad_stats, _grad_sink_weight):
        x, mask, key_lengths, stats, sink = ctx.saved_tensors
        if not torch.is_grad_enabled():
            dx, dsink = ops.call(ops.self_adjusted_softmax_bwd, x, mask, ctx.diagonal, key_lengths, grad, stats,
                                 ctx.normalized, sink, ctx.softcap, ctx.backend)
            dsink = dsink if sink is not None else None
        else:
            raw, row_mask = x, RowMask(mask, ctx.diagonal, key_lengths)
            if ctx.softcap is not None:
                x = capped(raw, ctx.softcap)
            if sink is not None:
                x, row_mask, _ = sinks.extend(x, row_mask, sink)
                grad = sinks.append(grad)
            dx, dsink = _split_sink(jacobians.self_adjusted_vjp(x, row_mask, grad, ctx.normalized), sink)
            if ctx.softcap is not None:
                dx = dx * cap_slope(raw, ctx.softcap)
        return dx, None, None, None, None, _sink_grad(dsink, sink, ctx.needs_input_grad[5]), None, None


# ---- entry points -------------------------------------------------------------------------


def _needs_grad(args: tuple, params: tuple[int, ...]) -> bool:
    if not torch.is_grad_enabled():
        return False
    if args[0].requires_grad:
        return True
    for i in params:  # a loop, not any(generator): this runs on every call
        if args[i] is not None and args[i].requires_grad:
            return True
    return False


_WATCHED, _PLAIN, _PLAIN_GRAD = 0, 1, 2
"""What :func:`_lane` says of a call besides its direct functions: seen by more than the op's kernel
(the dispatcher serves it), or plain (the op's device kernel may run without the dispatcher), with
no gradient needed or with one."""


def _call(function: type[_RowFunction], op, args: tuple, lane: int, *params: int) -> Tensor:
    """The weights from ``op(*args)``, through ``function`` when a differentiable input needs a gradient.

    The differentiable inputs are the scores ``args[0]`` and the parameters at positions ``params``.
    ``lane``: :func:`_lane`'s verdict, ``_WATCHED``, ``_PLAIN`` or ``_PLAIN_GRAD``.  A plain call
    skips what only a watched one needs (the dispatcher, ``Function.apply``'s transform handling).
    """
    if lane == _PLAIN:
        return ops.kernel(op)(*args)[0]
    if lane == _WATCHED:
        if torch._C._are_functorch_transforms_active():
            # A vmap wrapper does not show the requires_grad of the tensor it batches (False while that tensor
            # needs a gradient): the op alone left the output without a path back to it, and
            # vmap(module)(x).sum().backward() gave x no gradient.  The Function decides.
            return function.apply(*args)[0]
        if not _needs_grad(args, params):
            return ops.call(op, *args)[0]
        if torch.compiler.is_compiling():
            return function.apply(*args)[0]
    # Function.apply's first step outside transforms: unwrap tensors that escaped a
    # finished torch.func call (dead wrappers); only differentiable inputs matter.
    unwrap, args = torch._C._functorch.unwrap_if_dead, list(args)
    for i in (0, *params):
        if args[i] is not None:
            args[i] = unwrap(args[i])
    out = function.eager_apply(*args) if lane == _WATCHED else shortcut.apply_with(function, args, ops.kernel(op))
    if shortcut.listening():
        shortcut.note_apply(function, tuple(args), out[0])
    return out[0]


def _lane(implementation: str, x: Tensor, mask: RowMask, *inputs: object) -> SimpleNamespace | int:
    """How a call runs: the backend's functions (:func:`ops.functions`) when it may run its forward
    directly and keep the weights alone; else ``_PLAIN``, ``_PLAIN_GRAD`` or ``_WATCHED`` for :func:`_call`.

    Directly when no gradient is needed (what else the forward op returns is read by its
    backward only), when :func:`ops.plain` holds for the scores, the mask's fields and the
    other ``inputs`` (parameters, sink: the op would go straight to the same function), and
    when the backend takes ``x``'s dtype as it is (:func:`ops.takes_as_is`; else the op
    computes in float32).  The op's layers (argument packing, :func:`ops.call`, the op body)
    and the statistics only a backward reads cost about a third of a call on a tiny tensor.
    ``_PLAIN_GRAD`` when :func:`ops.plain` holds but a gradient is needed, ``_PLAIN`` when
    none is but the dtype is upcast: the op's device kernel then runs without :func:`ops.call`'s
    second look (~1.5 us of a ~19 us call with a gradient on a 4x16 tensor).
    :func:`ops.watched` first, so that Dynamo reads nothing else; then one pass over the
    inputs: this runs on every call.
    """
    if ops.watched() or not ops.plain_tensor(x):
        return _WATCHED
    grad = torch.is_grad_enabled()
    direct = not (grad and x.requires_grad)
    if mask is not NO_MASK:
        inputs = (*mask, *inputs)
    for value in inputs:
        if isinstance(value, Tensor):
            if not ops.plain_tensor(value):
                return _WATCHED
            if grad and value.requires_grad:
                direct = False
    if not direct:
        return _PLAIN_GRAD
    functions = ops.functions(implementation)
    return functions if ops.takes_as_is(functions, x.dtype) else _PLAIN


def _implementation(backend: str | None, x: Tensor) -> str:
    """The backend that computes this call; the reference while a forward-mode derivative may be taken.

    The kernels' Functions have no ``jvp``, and with no input requiring grad :func:`_call`
    skips them: under ``torch.autograd.forward_ad`` the tangent was silently dropped, under
    ``torch.func.jvp``/``jacfwd`` a kernel got functorch's wrapper (a data-pointer error).
    The reference is differentiated by torch (softmax, Scalable-Softmax, top-k) or by the
    closed-form ``jvp`` of its entmax and Self-Adjusted Functions.

    Raises:
        NotImplementedError: forward mode with ``"native"`` or ``"triton"`` asked for by name.
    """
    # x.is_cpu is cheaper than x.device.type (which builds a device object and a string).
    implementation = backends.resolve(backend, "cpu" if x.is_cpu else x.device)
    if implementation == "reference":
        return implementation
    transforms = torch._C._are_functorch_transforms_active()
    if not transforms and forward_ad._current_level < 0:  # the common call: no transform, no dual level
        return implementation
    if transforms and torch.compiler.is_compiling():  # the C call first: cheaper
        # torch.compile of a torch.func transform (grad, jacrev, vmap): Dynamo traces the kernels' Function
        # there without its gradient (compiled grad came out wrong) or not at all (vmap of a learnable module)
        return "reference"
    if not ops.forward_mode():
        return implementation
    requested = backends.get_backend() if backend is None else backend
    if requested in ("native", "triton"):
        raise NotImplementedError(f"forward-mode AD (torch.func.jvp, jacfwd, torch.autograd.forward_ad) runs on "
                                  f"backend='reference' only; backend={requested!r} was asked for")
    return "reference"


def _sink(sink: Tensor | None, x: Tensor) -> Tensor | None:
    """The sink column ``(..., 1)`` in the precision the kernels compute in."""
    if sink is None:
        return None
    dtype = rules.accumulation_dtype(x.dtype)
    return sink if sink.dtype == dtype else sink.to(dtype)


def _reference(kernel: str, x: Tensor, mask: RowMask, sink: Tensor | None, softcap: float | None,
               **params) -> Tensor:
    """The pure-torch reference (differentiable), with the sink and the cap when given.

    Half-precision scores are computed in float32 and the weights rounded once, as every kernel
    does (computed in bfloat16 a Scalable-Softmax row of two scores came out 0.031 off); under
    autocast they stay float32, as the ops' autocast rule (and ``torch.softmax``'s) gives them.
    """
    dtype = x.dtype
    if dtype in (torch.float16, torch.bfloat16):
        if torch.is_autocast_enabled(x.device.type):
            dtype = torch.float32
        x = x.float()
    if softcap is not None:
        # Masked scores -inf first: a masked score takes no part, NaN included (the cap's slope carried NaN back).
        x = capped(rules.masked_scores(x, mask), softcap)
    if sink is not None:
        y = sinks.extended_weights(kernel, x, mask, sink, **params)[..., :-1]
    elif kernel == "sparsemax":
        y = reference.sparsemax(x, mask)
    else:
        y = getattr(reference, kernel)(x, mask, *params.values())
    return y.to(dtype)


def softmax(x: Tensor, mask: RowMask, temperature: Param, backend: str | None, sink: Tensor | None = None,
            softcap: float | None = None) -> Tensor:
    """``softmax(x / T)`` over the allowed positions of each row (and a sink's, when given)."""
    implementation = _implementation(backend, x)
    if implementation == "reference":
        return _reference("softmax", x, mask, sink, softcap, temperature=temperature)
    sink = _sink(sink, x)
    lane = _lane(implementation, x, mask, temperature, sink)
    if type(lane) is not int:
        return ops.weights(lane, "softmax", x, mask, {"temperature": temperature}, sink, softcap)
    value, rows = _split(temperature)
    args = (x, *mask, value, rows, sink, softcap, implementation)
    return _call(_Softmax, ops.softmax_fwd, args, lane, 5, 6)  # rows, sink


def scalable_softmax(x: Tensor, mask: RowMask, s: Param, bias: Param, backend: str | None,
                     sink: Tensor | None = None, softcap: float | None = None) -> Tensor:
    """``softmax((s log n + bias) x)``, ``n`` the allowed positions of each row (a sink is not counted)."""
    implementation = _implementation(backend, x)
    if implementation == "reference":
        return _reference("scalable_softmax", x, mask, sink, softcap, s=s, bias=bias)
    sink = _sink(sink, x)
    lane = _lane(implementation, x, mask, s, bias, sink)
    if type(lane) is not int:
        return ops.weights(lane, "scalable_softmax", x, mask, {"s": s, "bias": bias}, sink, softcap)
    s_value, s_rows = _split(s)
    bias_value, bias_rows = _split(bias)
    args = (x, *mask, s_value, s_rows, bias_value, bias_rows, sink, softcap, implementation)
    return _call(_ScalableSoftmax, ops.scalable_softmax_fwd, args, lane, 5, 7, 8)  # s_rows, bias_rows, sink


def topk_softmax(x: Tensor, mask: RowMask, k: int | float, temperature: Param, backend: str | None,
                 sink: Tensor | None = None, softcap: float | None = None) -> Tensor:
    """Softmax of ``x / T`` over the ``k`` largest allowed scores (ties: lowest index), 0 elsewhere."""
    implementation = _implementation(backend, x)
    is_fraction = isinstance(k, float)
    if implementation == "reference":
        return _reference("topk_softmax", x, mask, sink, softcap, k=float(k), is_fraction=is_fraction,
                          temperature=temperature)
    sink = _sink(sink, x)
    lane = _lane(implementation, x, mask, temperature, sink)
    if type(lane) is not int:
        return ops.weights(lane, "topk_softmax", x, mask, {"k": k, "temperature": temperature}, sink, softcap)
    value, rows = _split(temperature)
    args = (x, *mask, float(k), is_fraction, value, rows, sink, softcap, implementation)
    return _call(_TopKSoftmax, ops.topk_softmax_fwd, args, lane, 7, 8)  # rows, sink


def entmax(x: Tensor, mask: RowMask, alpha: Param, backend: str | None, sink: Tensor | None = None,
           softcap: float | None = None) -> Tensor:
    """alpha-entmax (alpha >= 1; 1 is softmax, 2 sparsemax)."""
    implementation = _implementation(backend, x)
    if implementation == "reference":
        return _reference("entmax", x, mask, sink, softcap, alpha=alpha)
    sink = _sink(sink, x)
    lane = _lane(implementation, x, mask, alpha, sink)
    if type(lane) is not int:
        return ops.weights(lane, "entmax", x, mask, {"alpha": alpha}, sink, softcap)
    value, rows = _split(alpha)
    args = (x, *mask, value, rows, sink, softcap, implementation)
    return _call(_Entmax, ops.entmax_fwd, args, lane, 5, 6)  # rows, sink


def sparsemax(x: Tensor, mask: RowMask, backend: str | None, sink: Tensor | None = None,
              softcap: float | None = None) -> Tensor:
    """Sparsemax, i.e. 2-entmax."""
    implementation = _implementation(backend, x)
    if implementation == "reference":
        return _reference("sparsemax", x, mask, sink, softcap)
    sink = _sink(sink, x)
    lane = _lane(implementation, x, mask, sink)
    if type(lane) is not int:
        return ops.weights(lane, "sparsemax", x, mask, {}, sink, softcap)
    return _call(_Entmax, ops.entmax_fwd, (x, *mask, 2.0, None, sink, softcap, implementation), lane, 6)


def self_adjusted_softmax(x: Tensor, mask: RowMask, normalized: bool, backend: str | None,
                          sink: Tensor | None = None, softcap: float | None = None) -> Tensor:
    """``phi(x) softmax(x)`` (Self-Adjusted Softmax)."""
    implementation = _implementation(backend, x)
    if implementation == "reference":
        return _reference("self_adjusted_softmax", x, mask, sink, softcap, normalized=normalized)
    sink = _sink(sink, x)
    lane = _lane(implementation, x, mask, sink)
    if type(lane) is not int:
        return ops.weights(lane, "self_adjusted_softmax", x, mask, {"normalized": normalized}, sink, softcap)
    args = (x, *mask, normalized, sink, softcap, implementation)
    return _call(_SelfAdjustedSoftmax, ops.self_adjusted_softmax_fwd, args, lane, 5)
