"""The ``torch.library`` operators: one forward and one backward op per normalizer family.

Every op is defined once here and implemented by the three backends of
``kernels/README.md`` through the PyTorch dispatcher:

* the **CPU** kernel runs the native C kernels;
* the **CUDA** kernel runs the Triton kernels;
* the **default** kernel (any other device) runs the pure-torch reference.

The op's last argument, ``backend``, overrides that choice on CPU and CUDA (resolved
by :mod:`attnorm.kernels.backends`): ``"triton"`` on CPU tensors runs the Triton kernels
under ``TRITON_INTERPRET=1`` (how the tests check them), ``"reference"`` the reference.

Eager calls made through :func:`call` on plain tensors, while nothing else is watching
(no ``torch.compile``, ``torch.export``, ``torch.jit.trace``, ``torch.func`` transform,
dispatch or function mode, autocast or profiler), go straight to the op's device kernel:
the dispatcher's round trip through a Python kernel (boxing every argument, the autograd
fallback, unboxing) costs about as much as everything else in a call on a tiny tensor
(~10 us of ~30 on a slow 2-core CPU), and would only land in the same kernel.  Every
other call goes through the dispatcher, so PyTorch sees the op wherever it looks.

Each op also has a fake kernel (shapes only, for ``torch.compile`` and
``torch.export``), a vmap rule (rows are independent, so a vmapped dim becomes one
more leading dim) and, for forward ops, an autocast rule (float16/bfloat16 inputs are
computed in float32).  The ops are not differentiable themselves:
:mod:`attnorm.kernels.autograd` pairs each forward with its backward.

=============================== ====================================================
op (``torch.ops.attnorm.*``)     outputs
=============================== ====================================================
``softmax_fwd``                 weights, multiplier ``1/T`` per row, sink weight
``scalable_softmax_fwd``        weights, multiplier per row, ``log max(n, 1)`` per row, sink weight
``topk_softmax_fwd``            weights, multiplier ``1/T`` per row, sink weight
``softmax_bwd``                 ``dx``, per-row parameter gradient (shared by the three above), ``dsink``
``entmax_fwd``                  weights, gate per row (sparsemax is ``alpha = 2``), sink weight
``entmax_bwd``                  ``dx``, per-row alpha gradient, ``dsink``
``self_adjusted_softmax_fwd``   weights, statistics ``(..., 5)`` per row, sink weight
``self_adjusted_softmax_bwd``   ``dx``, ``dsink``
=============================== ====================================================

Masks travel as ``(mask, diagonal, key_lengths)``, the fields of
:class:`attnorm.kernels.rules.RowMask`; a per-row parameter as a number plus an
optional tensor ``(..., 1)`` that replaces it when given.  Every op takes an optional
``sink`` (forwards; ``sink_weight`` too for backwards), a column ``(..., 1)`` of
per-row scores of a virtual key whose weight is dropped (``kernels/README.md``, "A
sink per row"); the sink's outputs (its weight, ``dsink``) are empty tensors without one.
``softcap`` (a float, or None) caps the scores as the kernels read them, and the
backward ops take it with the raw scores (``x``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType, SimpleNamespace
from typing import Any

import torch
from torch import _C, Tensor
from torch._C._functorch import TransformType
from torch.autograd import forward_ad

from attnorm.kernels import inductor, reference, rules
from attnorm.kernels.cpu import native
from attnorm.kernels.rules import RowMask

__all__ = [
    "call",
    "entmax_bwd",
    "entmax_fwd",
    "forward_mode",
    "functions",
    "kernel",
    "modifiers",
    "plain",
    "plain_tensor",
    "register_eager",
    "records_grad",
    "scalable_softmax_fwd",
    "self_adjusted_softmax_bwd",
    "self_adjusted_softmax_fwd",
    "softmax_bwd",
    "softmax_fwd",
    "takes_as_is",
    "topk_softmax_fwd",
    "watched",
]

_LOW_PRECISION = (torch.float16, torch.bfloat16)
_MASK = "Tensor? mask, int? diagonal, Tensor? key_lengths"
_MODIFIERS = "Tensor? sink, float? softcap"


@functools.cache
def _triton() -> ModuleType:
    import attnorm.kernels.triton as kernels

    return kernels


CONTRACT = (
    "softmax_forward",
    "softmax_backward",
    "topk_forward",
    "entmax_forward",
    "entmax_backward",
    "self_adjusted_forward",
    "self_adjusted_backward",
)
"""The backend functions of ``kernels/README.md``; a backend that lacks one runs the reference's."""


@functools.cache
def functions(backend: str) -> SimpleNamespace:
    """The contract's functions (:data:`CONTRACT`) of the implementation ``backend`` names, as resolved by
    :mod:`attnorm.kernels.backends` (``"native"``, ``"triton"`` or ``"reference"``); ``upcast``: whether they
    take half precision only as float32."""
    module = _triton() if backend == "triton" else native if backend == "native" else reference
    functions = {name: getattr(module, name, getattr(reference, name)) for name in CONTRACT}
    # The native kernels read float32/float64: half precision is computed in float32.
    return SimpleNamespace(**functions, upcast=module is native)


def takes_as_is(kernels: SimpleNamespace, dtype: torch.dtype) -> bool:
    """Whether the :func:`functions` ``kernels`` compute rows of ``dtype`` as they are (else in float32)."""
    return not kernels.upcast or dtype not in _LOW_PRECISION


def _upcast(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Half-precision tensors among ``args`` in float32."""
    return tuple(a.float() if isinstance(a, Tensor) and a.dtype in _LOW_PRECISION else a for a in args)


# Ops are defined with the low-level Library API: the dispatcher calls our kernels directly,
# without custom_op's Python autograd and dynamo wrappers (half the per-call cost); the
# autograd lives in :mod:`attnorm.kernels.autograd`.
_LIBRARY = torch.library.Library("attnorm", "DEF")


def _define(name: str, schema: str, body: Callable[..., Any], fake: Callable[..., Any], *,
            vmap_kinds: tuple[str | None, ...], optional_outputs: dict[int, int] | None = None,
            autocast: bool = False):
    """Define ``attnorm::name`` with ``body(kernels, *args)`` as its kernel on every device."""

    def device_kernel(*args):
        kernels = functions(args[-1])
        # The scores (forward) or saved output (backward) set the precision.
        dtype = args[0].dtype
        if takes_as_is(kernels, dtype):
            return body(kernels, *args)
        out = body(kernels, *_upcast(args))
        if isinstance(out, Tensor):
            return out.to(dtype)
        return (out[0].to(dtype), *out[1:])

    qualified = f"attnorm::{name}"
    _LIBRARY.define(name + schema)
    _LIBRARY.impl(name, device_kernel, "CPU")
    _LIBRARY.impl(name, device_kernel, "CUDA")
    _LIBRARY.impl(name, lambda *args: body(functions("reference"), *args), "CompositeExplicitAutograd")
    torch.library.register_fake(qualified, fake, lib=_LIBRARY)
    op = getattr(torch.ops.attnorm, name).default
    register_eager(op, device_kernel)
    torch.library.register_vmap(qualified, _vmap_rule(op, vmap_kinds, optional_outputs or {}), lib=_LIBRARY)
    if autocast:
        for device in ("cpu", "cuda"):
            torch.library.register_autocast(qualified, device, torch.float32, lib=_LIBRARY)
    inductor.register(qualified, lambda *args: body(functions("triton"), *args), _LIBRARY,
                      wants=lambda args: args[-1] == "triton")
    return op


_PLAIN = (Tensor, torch.nn.Parameter)
"""Tensor types :func:`call` hands its kernel directly (a Parameter dispatches as a tensor)."""

_is_legacy_batched = _C._functorch.is_legacy_batchedtensor

_DEVICE_KERNELS: dict[int, Callable[..., Any]] = {}
"""Each op's CPU/CUDA kernel, for :func:`call`, by ``id(op)`` (an ``OpOverload`` hashes in Python, and
lives as long as the process)."""


def register_eager(op, kernel: Callable[..., Any]) -> None:
    """Let :func:`call` run ``kernel``, the op's CPU and CUDA kernel, in plain eager calls of ``op``."""
    _DEVICE_KERNELS[id(op)] = kernel


def kernel(op) -> Callable[..., Any]:
    """The CPU/CUDA kernel :func:`call` runs for ``op`` in a plain eager call (callers that checked :func:`plain`)."""
    return _DEVICE_KERNELS[id(op)]


def call(op, *args: Any) -> Any:
    """``op(*args)``: straight to the op's CPU/CUDA kernel in a plain eager call, else through the dispatcher.

    Plain: every tensor argument is a ``torch.Tensor`` or an ``nn.Parameter`` (no other
    subclass: no fake, functional or distributed tensor, whose ``__torch_dispatch__`` the
    dispatcher would call) and not batched by the legacy vmap (the incoming gradients of
    ``torch.autograd.functional.jacobian(..., vectorize=True)`` and of
    ``autograd.grad(..., is_grads_batched=True)``, plain tensors to ``type``); and none of
    what the dispatcher serves besides the kernel is at work: ``torch.compile`` /
    ``torch.export`` (``is_compiling``, tested first so that Dynamo reads nothing else),
    ``torch.func`` transforms, ``torch.jit.trace``, dispatch modes (``FakeTensorMode``,
    ``FlopCounterMode``, export's tracer), function modes, autocast (the ops' autocast rule
    casts to float32) or the profiler (which records the op by name).  The kernel is the one
    the dispatcher would pick: both read the ``backend`` argument (callers pass ``"native"``
    or ``"triton"`` on CPU/CUDA tensors only).  The checks cost 1-2 us; the dispatcher's
    round trip ~10 us on a slow CPU.
    """
    return _DEVICE_KERNELS[id(op)](*args) if plain(*args) else op(*args)


def watched() -> bool:
    """True while something besides an op's kernel must see its calls (see :func:`call`).

    ``torch.compile``/``torch.export`` is tested first, so that Dynamo reads nothing else.
    """
    return bool(torch.compiler.is_compiling() or _C._are_functorch_transforms_active()
                or _C._len_torch_dispatch_stack() or _C._is_torch_function_mode_enabled()
                or _C._get_tracing_state() or _C._is_any_autocast_enabled() or _C._autograd._profiler_enabled())


def plain(*args: Any) -> bool:
    """True when an op called with ``args`` may run its kernel directly (the conditions of :func:`call`):
    nothing is :func:`watched`, and every tensor among ``args`` is :func:`plain_tensor`."""
    if watched():
        return False
    for arg in args:
        if isinstance(arg, Tensor) and not plain_tensor(arg):
            return False
    return True


def plain_tensor(tensor: Tensor) -> bool:
    """A ``Tensor`` or ``Parameter`` (no other subclass) not batched by the legacy vmap (see :func:`call`), and
    whose memory holds its values: not a negative view (``torch._neg_view``, the imaginary part of a conjugate
    view: the values negated) nor an efficient zero tensor (no memory: a null data pointer, which C read and
    crashed on).  The dispatcher's fallbacks resolve both before a kernel sees them."""
    return (type(tensor) in _PLAIN and not _is_legacy_batched(tensor) and not tensor.is_neg()
            and not tensor._is_zerotensor())


def records_grad(*tensors: Tensor | None) -> bool:
    """Whether autograd records a call on ``tensors``: grad mode on and one of them (None skipped) requires grad."""
    if not torch.is_grad_enabled():
        return False
    for t in tensors:  # a loop, not any(generator): routes ask on every call
        if t is not None and t.requires_grad:
            return True
    return False


def forward_mode() -> bool:
    """True inside ``torch.autograd.forward_ad.dual_level`` or a ``torch.func.jvp``/``jacfwd`` transform.

    The kernels have no JVP: their callers take the reference (or torch's math attention) then.
    False while compiling (tested first, so that Dynamo traces nothing else): the compiled graph
    keeps the eager route.
    """
    if torch.compiler.is_compiling():
        return False
    if forward_ad._current_level >= 0:
        return True
    if not _C._are_functorch_transforms_active():
        return False
    return any(layer.key() == TransformType.Jvp for layer in _C._functorch.get_interpreter_stack())


# ---- vmap: a vmapped dim is one more leading dim of every row tensor -------------------------


def _vmap_rule(op, kinds: tuple[str | None, ...], optional_outputs: dict[int, int]):
    """A vmap rule for a row op whose positional arguments are described by ``kinds``.

    ``"x"`` and ``"full"``: tensors shaped like the rows (expanded when not batched);
    ``"bcast"``: tensors broadcast against ``x`` (a unit dim added when not batched);
    ``"lengths"``: key lengths, which index ``x``'s dim 0 and so become a bool mask
    (the ``"bcast"`` argument just before the diagonal) once another dim leads;
    None: not a tensor.  ``optional_outputs`` maps an output that may be empty (a per-row
    gradient, a sink's outputs) to the argument that says whether it exists (a flag, or an
    optional tensor).
    """

    def rule(info, in_dims, *args):
        size = info.batch_size
        args = list(args)
        x_index = kinds.index("x")
        logical_shape = _logical_shape(args[x_index], in_dims[x_index])
        if "lengths" in kinds:
            lengths_index = kinds.index("lengths")
            if args[lengths_index] is not None:
                mask_index = lengths_index - 2
                mask, mask_dim = _lengths_as_mask(
                    args[lengths_index], in_dims[lengths_index], args[mask_index], in_dims[mask_index],
                    logical_shape, size,
                )
                args[mask_index], args[lengths_index] = mask, None
                in_dims = list(in_dims)
                in_dims[mask_index], in_dims[lengths_index] = mask_dim, None
        for index, (kind, value, dim) in enumerate(zip(kinds, args, in_dims, strict=True)):
            if kind is None or value is None or kind == "lengths":
                continue
            if dim is not None:
                args[index] = value.movedim(dim, 0)
            elif kind == "bcast":
                args[index] = value.unsqueeze(0)
            else:
                args[index] = value.expand(size, *value.shape)
        out = op(*args)
        if isinstance(out, Tensor):
            return out, 0
        dims = [0] * len(out)
        for output, flag in optional_outputs.items():
            if not isinstance(args[flag], Tensor) and not args[flag]:  # None, False or 0
                dims[output] = None
        return tuple(out), tuple(dims)

    return rule


def _logical_shape(x: Tensor, dim: int | None) -> tuple[int, ...]:
    shape = list(x.shape)
    if dim is not None:
        del shape[dim]
    return tuple(shape)


def _lengths_as_mask(lengths, lengths_dim, mask, mask_dim, shape, size):
    """Key lengths as a bool mask broadcasting over rows of ``shape``; batched when either input is."""
    keys = torch.arange(shape[-1], device=lengths.device)
    if lengths_dim is None:
        allowed = keys < lengths.reshape(-1, *([1] * (len(shape) - 1)))
    else:
        lengths = lengths.movedim(lengths_dim, 0)
        allowed = keys < lengths.reshape(size, -1, *([1] * (len(shape) - 1)))
    if mask is None:
        return allowed, None if lengths_dim is None else 0
    if lengths_dim is None and mask_dim is None:
        return allowed & mask, None
    allowed = allowed if lengths_dim is not None else allowed.unsqueeze(0)
    mask = mask.movedim(mask_dim, 0) if mask_dim is not None else mask.unsqueeze(0)
    return allowed & mask, 0


# ---- fake kernels ------------------------------------------------------------------------


def _rows(x: Tensor, *extra: int) -> Tensor:
    return x.new_empty((*x.shape[:-1], *extra), dtype=rules.accumulation_dtype(x.dtype))


def _param(value: float, rows: Tensor | None) -> float | Tensor:
    return value if rows is None else rows


def _empty(x: Tensor) -> Tensor:
    """An absent per-row output (no parameter gradient asked, no sink)."""
    return x.new_empty(0, dtype=rules.accumulation_dtype(x.dtype))


def _absent(x: Tensor) -> Tensor:
    """What a kernel returns for an absent per-row output: a fresh :func:`_empty`, made cheaply.

    ``x.new()`` (an empty tensor of ``x``'s dtype and device) costs half of ``new_empty``'s
    0.7 us, a share of a tiny call; fake kernels keep :func:`_empty`.
    """
    if x.dtype is rules.accumulation_dtype(x.dtype) and type(x) is Tensor:
        return x.new()
    return _empty(x)


def _sink_out(x: Tensor, sink: Tensor | None) -> Tensor:
    """Fake sink output: one value per row with a sink, empty without."""
    return _empty(x) if sink is None else _rows(x)


def modifiers(sink: Tensor | None, softcap: float | None = None) -> dict[str, Any]:
    """The backend functions' sink and softcap keywords, each passed only when set (a sink adds an output)."""
    keywords = {} if sink is None else {"sink": sink}
    if softcap is not None:
        keywords["softcap"] = softcap
    return keywords


def weights(functions: SimpleNamespace, kernel: str, x: Tensor, mask: RowMask, params: dict[str, Any],
            sink: Tensor | None = None, softcap: float | None = None, out_dtype: torch.dtype | None = None) -> Tensor:
    """The weights alone of the row operation ``kernel`` from the :func:`functions` ``functions``' forward.

    Each family's calling convention, written once: the forward runs with ``weights_only=True``
    (what else it returns is read by a backward only).  ``kernel`` names the entry point of
    :mod:`attnorm.kernels.autograd` (a normalizer's ``kernel``), ``params`` its parameters as a
    normalizer's ``kernel_params()`` gives them (numbers, or per-row tensors ``(..., 1)``).
    ``out_dtype``: the weights' dtype when not ``x``'s (Triton's forwards only).

    Raises:
        KeyError: a ``kernel`` without row kernels.
    """
    keywords = modifiers(sink, softcap)
    if out_dtype is not None:  # Triton's forwards only (the decoding route's weights in the query's dtype)
        keywords["out_dtype"] = out_dtype
    if kernel == "entmax" or kernel == "sparsemax":
        alpha = 2.0 if kernel == "sparsemax" else params["alpha"]
        return functions.entmax_forward(x, mask, alpha, **keywords, weights_only=True)[0]
    if kernel == "softmax":
        return functions.softmax_forward(x, mask, 0, params["temperature"], 0.0, **keywords, weights_only=True)[0]
    if kernel == "scalable_softmax":
        return functions.softmax_forward(x, mask, 1, params["s"], params["bias"], **keywords, weights_only=True)[0]
    if kernel == "topk_softmax":
        k = params["k"]
        return functions.topk_forward(x, mask, float(k), isinstance(k, float), params["temperature"], **keywords,
                                      weights_only=True)[0]
    if kernel == "self_adjusted_softmax":
        return functions.self_adjusted_forward(x, mask, params["normalized"], **keywords, weights_only=True)[0]
    raise KeyError(f"no row kernels for {kernel!r}")


ROW_KERNELS = frozenset({"softmax", "scalable_softmax", "topk_softmax", "entmax", "sparsemax", "self_adjusted_softmax"})
"""The row operations :func:`weights` computes (every normalizer ``kernel`` with row kernels)."""


def _row_mask(mask: Tensor | None, diagonal: int | None, key_lengths: Tensor | None) -> RowMask:
    # Building a NamedTuple costs more than the check (a sizeable share of a tiny call).
    if mask is None and diagonal is None and key_lengths is None:
        return rules.NO_MASK
    return RowMask(mask, diagonal, key_lengths)


# ---- softmax family: softmax with temperature, Scalable-Softmax, top-k --------------------

_SOFTMAX_KINDS = ("x", "bcast", None, "lengths")


def _softmax_fwd(kernels, x, mask, diagonal, key_lengths, temperature, temperature_rows, sink, softcap, backend):
    mask = _row_mask(mask, diagonal, key_lengths)
    out = kernels.softmax_forward(x, mask, 0, _param(temperature, temperature_rows), 0.0, **modifiers(sink, softcap))
    return out[0], out[1], out[3] if sink is not None else _absent(x)


softmax_fwd = _define(
    "softmax_fwd",
    f"(Tensor x, {_MASK}, float temperature, Tensor? temperature_rows, {_MODIFIERS}, str backend)"
    " -> (Tensor, Tensor, Tensor)",
    _softmax_fwd,
    lambda x, *args: (torch.empty_like(x), _rows(x), _sink_out(x, args[-3])),
    vmap_kinds=(*_SOFTMAX_KINDS, None, "bcast", "bcast", None, None),
    optional_outputs={2: 6},
    autocast=True,
)


def _scalable_softmax_fwd(kernels, x, mask, diagonal, key_lengths, s, s_rows, bias, bias_rows, sink, softcap,
                          backend):
    mask = _row_mask(mask, diagonal, key_lengths)
    out = kernels.softmax_forward(x, mask, 1, _param(s, s_rows), _param(bias, bias_rows), **modifiers(sink, softcap))
    return out[0], out[1], out[2], out[3] if sink is not None else _absent(x)


scalable_softmax_fwd = _define(
    "scalable_softmax_fwd",
    f"(Tensor x, {_MASK}, float s, Tensor? s_rows, float bias, Tensor? bias_rows, {_MODIFIERS}, str backend)"
    " -> (Tensor, Tensor, Tensor, Tensor)",
    _scalable_softmax_fwd,
    lambda x, *args: (torch.empty_like(x), _rows(x), _rows(x), _sink_out(x, args[-3])),
    vmap_kinds=(*_SOFTMAX_KINDS, None, "bcast", None, "bcast", "bcast", None, None),
    optional_outputs={3: 8},
    autocast=True,
)


def _topk_softmax_fwd(kernels, x, mask, diagonal, key_lengths, k, is_fraction, temperature, temperature_rows,
                      sink, softcap, backend):
    mask = _row_mask(mask, diagonal, key_lengths)
    temperature = _param(temperature, temperature_rows)
    out = kernels.topk_forward(x, mask, k, is_fraction, temperature, **modifiers(sink, softcap))
    return out[0], out[1], out[2] if sink is not None else _absent(x)


topk_softmax_fwd = _define(
    "topk_softmax_fwd",
    f"(Tensor x, {_MASK}, float k, bool is_fraction, float temperature, Tensor? temperature_rows, {_MODIFIERS},"
    " str backend) -> (Tensor, Tensor, Tensor)",
    _topk_softmax_fwd,
    lambda x, *args: (torch.empty_like(x), _rows(x), _sink_out(x, args[-3])),
    vmap_kinds=(*_SOFTMAX_KINDS, None, None, None, "bcast", "bcast", None, None),
    optional_outputs={2: 8},
    autocast=True,
)


def _softmax_bwd(kernels, y, grad, multiplier, x, param_grad, sink_weight, sink, softcap, backend):
    capping = {} if softcap is None else {"softcap": softcap}
    if sink_weight is None:
        dx, per_row = kernels.softmax_backward(y, grad, multiplier, x, param_grad, **capping)
        dsink = _absent(multiplier)
    else:
        dx, per_row, dsink = kernels.softmax_backward(y, grad, multiplier, x, param_grad, sink_weight=sink_weight,
                                                      sink=sink, **capping)
    return dx, per_row if per_row is not None else _absent(multiplier), dsink


softmax_bwd = _define(
    "softmax_bwd",
    "(Tensor y, Tensor grad, Tensor multiplier, Tensor? x, int param_grad, Tensor? sink_weight, Tensor? sink,"
    " float? softcap, str backend) -> (Tensor, Tensor, Tensor)",
    _softmax_bwd,
    lambda y, grad, multiplier, x, param_grad, sink_weight, sink, softcap, backend: (
        torch.empty_like(y), _rows(y) if param_grad else _empty(multiplier),
        _empty(multiplier) if sink_weight is None else _rows(y),
    ),
    vmap_kinds=("x", "full", "full", "full", None, "full", "bcast", None, None),
    optional_outputs={1: 4, 2: 5},
)


# ---- alpha-entmax (sparsemax at alpha = 2) ------------------------------------------------


def _entmax_fwd(kernels, x, mask, diagonal, key_lengths, alpha, alpha_rows, sink, softcap, backend):
    mask = _row_mask(mask, diagonal, key_lengths)
    out = kernels.entmax_forward(x, mask, _param(alpha, alpha_rows), **modifiers(sink, softcap))
    return out[0], out[1], out[2] if sink is not None else _absent(x)


entmax_fwd = _define(
    "entmax_fwd",
    f"(Tensor x, {_MASK}, float alpha, Tensor? alpha_rows, {_MODIFIERS}, str backend) -> (Tensor, Tensor, Tensor)",
    _entmax_fwd,
    lambda x, *args: (torch.empty_like(x), _rows(x), _sink_out(x, args[-3])),
    vmap_kinds=(*_SOFTMAX_KINDS, None, "bcast", "bcast", None, None),
    optional_outputs={2: 6},
    autocast=True,
)


def _entmax_bwd(kernels, y, grad, gate, alpha, alpha_rows, alpha_grad, sink_weight, x, softcap, backend):
    alpha = _param(alpha, alpha_rows)
    capping = {} if softcap is None else {"x": x, "softcap": softcap}
    if sink_weight is None:
        dx, per_row = kernels.entmax_backward(y, grad, gate, alpha, alpha_grad, **capping)
        dsink = _absent(gate)
    else:
        dx, per_row, dsink = kernels.entmax_backward(y, grad, gate, alpha, alpha_grad, sink_weight=sink_weight,
                                                     **capping)
    return dx, per_row if per_row is not None else _absent(gate), dsink


entmax_bwd = _define(
    "entmax_bwd",
    "(Tensor y, Tensor grad, Tensor gate, float alpha, Tensor? alpha_rows, bool alpha_grad, Tensor? sink_weight,"
    " Tensor? x, float? softcap, str backend) -> (Tensor, Tensor, Tensor)",
    _entmax_bwd,
    lambda y, grad, gate, alpha, alpha_rows, alpha_grad, sink_weight, x, softcap, backend: (
        torch.empty_like(y), _rows(y) if alpha_grad else _empty(gate),
        _empty(gate) if sink_weight is None else _rows(y),
    ),
    vmap_kinds=("x", "full", "full", None, "bcast", None, "full", "full", None, None),
    optional_outputs={1: 5, 2: 6},
)


# ---- Self-Adjusted Softmax ----------------------------------------------------------------


def _self_adjusted_fwd(kernels, x, mask, diagonal, key_lengths, normalized, sink, softcap, backend):
    mask = _row_mask(mask, diagonal, key_lengths)
    out = kernels.self_adjusted_forward(x, mask, normalized, **modifiers(sink, softcap))
    return out[0], out[1], out[2] if sink is not None else _absent(x)


self_adjusted_softmax_fwd = _define(
    "self_adjusted_softmax_fwd",
    f"(Tensor x, {_MASK}, bool normalized, {_MODIFIERS}, str backend) -> (Tensor, Tensor, Tensor)",
    _self_adjusted_fwd,
    lambda x, *args: (torch.empty_like(x), _rows(x, 5), _sink_out(x, args[-3])),
    vmap_kinds=(*_SOFTMAX_KINDS, None, "bcast", None, None),
    optional_outputs={2: 5},
    autocast=True,
)


def _self_adjusted_bwd(kernels, x, mask, diagonal, key_lengths, grad, stats, normalized, sink, softcap, backend):
    mask = _row_mask(mask, diagonal, key_lengths)
    if sink is None:
        return kernels.self_adjusted_backward(x, mask, grad, stats, normalized, **modifiers(None, softcap)), _absent(x)
    return kernels.self_adjusted_backward(x, mask, grad, stats, normalized, **modifiers(sink, softcap))


self_adjusted_softmax_bwd = _define(
    "self_adjusted_softmax_bwd",
    f"(Tensor x, {_MASK}, Tensor grad, Tensor stats, bool normalized, {_MODIFIERS}, str backend)"
    " -> (Tensor, Tensor)",
    _self_adjusted_bwd,
    lambda x, mask, diagonal, key_lengths, grad, stats, normalized, sink, softcap, backend: (
        torch.empty_like(x), _sink_out(x, sink)
    ),
    vmap_kinds=(*_SOFTMAX_KINDS, "full", "full", None, "bcast", None, None),
    optional_outputs={1: 7},
)
