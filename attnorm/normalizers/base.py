"""The Normalizer interface and the rules every normalizer shares.

Every normalizer maps scores to weights along one axis.  The rules below are
implemented once, here, and every normalizer (and every backend) obeys them:

* ``dim``: any axis, negative or positive; any number of leading dims; L = 1 works.
* ``mask``: a bool tensor broadcastable to ``scores`` (True = may attend, the
  ``scaled_dot_product_attention`` convention) or a :class:`attnorm.masks.StructuredMask`.
  A score of -inf counts as masked.  Masked positions get weight 0 and gradient 0;
  a row with no allowed position gives zeros (never NaN).  A row holding +inf
  scores puts all its mass uniformly on them (the limit of the finite case).
  A NaN score at an allowed position makes its row NaN, and the row's gradients
  (scores, parameters, sink) NaN too, as ``torch.softmax`` does.
* dtype: float16/bfloat16 are computed in float32 and returned in the input
  dtype; float32 and float64 are computed as they are.
* Tensor parameters (``s``, ``bias``, ``alpha``, ``temperature``) broadcast against
  the scores and must be constant along ``dim``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from attnorm.kernels import autograd, backends, shortcut
from attnorm.kernels.rules import NO_MASK, RowMask, accumulation_dtype, broadcasts_to, check_key_lengths
from attnorm.masks import StructuredMask
from attnorm.validation import check_softcap, quiet_shape_checks_while_tracing

__all__ = ["Checked", "Normalizer", "broadcast_param", "fits_bool_mask", "incoming_state", "normalize"]


def _check_scores(scores: Any) -> None:
    if not isinstance(scores, Tensor):
        raise TypeError(f"scores must be a torch.Tensor, got {type(scores).__name__}")
    if not scores.dtype.is_floating_point:
        raise TypeError(f"scores must be a floating-point tensor, got dtype {scores.dtype}")
    if scores.is_nested:
        raise TypeError("scores must be a dense (strided) tensor, got a nested tensor; pad it "
                        "(.to_padded_tensor(), with a mask that forbids the padding)")
    if scores.layout != torch.strided:
        raise TypeError(f"scores must be a dense (strided) tensor, got layout {scores.layout}; "
                        "convert it (.to_dense())")


def _normalize_dim(dim: int, ndim: int) -> int:
    if type(dim) is int and -ndim <= dim < ndim:  # the common case, in one test (bool is not int here)
        return dim % ndim
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise TypeError(f"dim must be an int, got {dim!r}")
    size = max(ndim, 1)
    if not -size <= dim < size:
        raise IndexError(f"dim out of range: got {dim} for scores with {ndim} dims")
    return dim % size


def fits_bool_mask(mask: Any, shape: torch.Size | tuple[int, ...], device: torch.device) -> bool:
    """Whether ``mask`` is a bool tensor on ``device`` that broadcasts to scores of ``shape``: the tensor masks
    :func:`_check_mask` accepts (it says what is wrong with any other)."""
    return (isinstance(mask, Tensor) and mask.dtype == torch.bool and mask.device == device
            and broadcasts_to(mask.shape, shape))


def _check_mask(mask: Any, scores: Tensor) -> Tensor | StructuredMask | None:
    if mask is None or isinstance(mask, StructuredMask) or fits_bool_mask(mask, scores.shape, scores.device):
        return mask
    if not isinstance(mask, Tensor):
        raise TypeError(f"mask must be a bool tensor, a StructuredMask or None, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise TypeError(f"mask must have dtype torch.bool (True = may attend), got {mask.dtype}")
    if mask.device != scores.device:
        raise ValueError(f"mask is on {mask.device} but scores are on {scores.device}: put them on one device")
    _check_broadcasts("mask", mask, scores)
    return mask


def _check_broadcasts(name: str, value: Tensor, scores: Tensor) -> None:
    if not broadcasts_to(value.shape, scores.shape):
        raise ValueError(
            f"{name} of shape {tuple(value.shape)} does not broadcast to scores of shape {tuple(scores.shape)}"
        )


def broadcast_param(name: str, value: Tensor, scores: Tensor, dim: int) -> Tensor:
    """Reshape a tensor parameter so it broadcasts against scores moved to ``dim=-1``.

    Raises:
        ValueError: if ``value`` is on another device than ``scores`` (a 0-d CPU tensor excepted, as torch
            takes one), does not broadcast to ``scores`` or varies along ``dim``.
    """
    if value.device != scores.device and not (value.ndim == 0 and value.is_cpu):
        raise ValueError(f"{name} is on {value.device} but scores are on {scores.device}: put them on one device")
    _check_broadcasts(name, value, scores)
    if value.ndim != scores.ndim:
        value = value.reshape((1,) * (scores.ndim - value.ndim) + tuple(value.shape))
    if scores.ndim == 0:
        return value
    if dim != scores.ndim - 1:
        value = value.movedim(dim, -1)
    if value.shape[-1] != 1:
        raise ValueError(f"{name} must be constant along dim={dim}, got shape {tuple(value.shape)}")
    return value


def _row_mask(mask: Tensor | StructuredMask | None, x: Tensor, dim: int) -> RowMask:
    """The mask as the kernels take it, for scores ``x`` moved to normalise over their last axis."""
    if mask is None:
        return NO_MASK
    last = x.ndim - 1
    if isinstance(mask, StructuredMask):
        if dim == last and x.ndim >= 2 and mask.row_fields_only:
            lengths = mask.key_lengths
            if lengths is not None:
                check_key_lengths(lengths, tuple(x.shape))
                lengths = lengths.to(device=x.device, dtype=torch.int64)
            return RowMask(None, mask.causal_diagonal, lengths)
        mask = mask.materialize(x.shape, x.device)
    mask = mask.reshape((1,) * (x.ndim - mask.ndim) + tuple(mask.shape))
    return RowMask(mask.movedim(dim, -1), None, None)


@quiet_shape_checks_while_tracing
def normalize(
    op: str,
    scores: Tensor,
    mask: Tensor | StructuredMask | None,
    dim: int,
    params: dict[str, Any],
    backend: str | None = None,
    sink: float | Tensor | None = None,
    softcap: float | None = None,
) -> Tensor:
    """Apply the row operation ``op`` along ``dim`` under the shared rules.

    Args:
        op: the row operation, a function of :mod:`attnorm.kernels.autograd` (``"softmax"``, ...).
        scores: floating-point tensor of any shape.
        mask: bool tensor broadcastable to ``scores``, a StructuredMask, or None.
        dim: the axis to normalise over.
        params: the op's parameters; python numbers or tensors broadcastable to ``scores``.
        backend: one of :data:`attnorm.kernels.backends.BACKENDS`, or None (the global default).
        sink: the score of a virtual key appended to every row, whose weight is dropped
            (an attention sink, ``kernels/README.md``): a number, or a tensor broadcastable
            to ``scores`` and constant along ``dim``; None for no sink.
        softcap: when given, the scores become ``softcap * tanh(scores / softcap)`` as the
            kernels read them (Gemma 2's soft-capping; -inf stays -inf); None for none.

    Returns:
        Weights with the shape and dtype of ``scores``.

    Raises:
        TypeError: a ``sink`` that is not a number or a floating tensor.
        ValueError: a ``sink`` on another device, not broadcastable, or varying along ``dim``;
            a ``softcap`` that is not a finite number > 0.
    """
    if (mask is None and sink is None and softcap is None and type(scores) is Tensor and scores.dtype.is_floating_point
            and scores.layout is torch.strided and not scores.is_nested and scores.ndim and type(dim) is int
            and (dim == -1 or dim == scores.ndim - 1) and scores.numel()):
        # The common call (no mask, sink or cap; rows along the last axis): what the general path below would
        # do, without its bookkeeping (~2 us of a 4x16 call's ~27).
        for value in params.values():
            if isinstance(value, Tensor):
                break
        else:
            return getattr(autograd, op)(scores, NO_MASK, **params, backend=backend)
    _check_scores(scores)
    if mask is not None:
        mask = _check_mask(mask, scores)
    ndim = scores.ndim
    dim = _normalize_dim(dim, ndim)
    if scores.numel() == 0:
        return scores.clone()  # nothing to normalise (e.g. no keys); row ops reduce over the last axis
    squeeze = ndim == 0
    x = scores.reshape(1) if squeeze else scores
    row_mask = _row_mask(mask, x, dim)
    for value in params.values():
        if isinstance(value, Tensor):
            params = _row_params(params, x, dim)
            break
    if sink is not None:
        params = {**params, "sink": _row_sink(sink, x, dim)}
    if softcap is not None:
        params = {**params, "softcap": check_softcap(softcap, accumulation_dtype(x.dtype))}
    last = squeeze or dim == ndim - 1  # the common case: no moves
    out = getattr(autograd, op)(x if last else x.movedim(dim, -1), row_mask, **params, backend=backend)
    out = out if last else out.movedim(-1, dim)
    return out.reshape(()) if squeeze else out


def incoming_state(module: nn.Module, state_dict: dict[str, Tensor], prefix: str) -> dict[str, Tensor]:
    """The values a state-dict load would copy into ``module``'s own parameters and buffers, by name, on the CPU
    (what a ``check_state`` method reads before anything is copied)."""
    names = (*module._parameters, *module._buffers)
    return {name: state_dict[prefix + name].detach().cpu() for name in names if prefix + name in state_dict}


def _row_sink(sink: float | Tensor, x: Tensor, dim: int) -> Tensor:
    """The sink as a column ``(..., 1)`` against ``x`` moved to normalise over ``dim=-1``, in the kernels' precision."""
    dtype = accumulation_dtype(x.dtype)
    if isinstance(sink, (int, float)) and not isinstance(sink, bool):
        if math.isnan(sink):  # a number is checked like the other parameters; a tensor's NaN gives NaN rows
            raise ValueError("sink must not be NaN (-inf: no sink)")
        return torch.full((1,) * x.ndim, float(sink), dtype=dtype, device=x.device)
    if not isinstance(sink, Tensor) or not sink.dtype.is_floating_point:
        kind = sink.dtype if isinstance(sink, Tensor) else type(sink).__name__
        raise TypeError(f"sink must be a number or a floating tensor, got {kind}")
    if sink.device != x.device:
        raise ValueError(f"sink is on {sink.device} but scores are on {x.device}: put them on one device")
    sink = broadcast_param("sink", sink, x, dim)
    return sink if sink.dtype == dtype else sink.to(dtype)


def _row_params(params: dict[str, Any], x: Tensor, dim: int) -> dict[str, Any]:
    """``params`` with each tensor broadcast against ``x`` moved to normalise over ``dim=-1``, in the
    precision the kernels compute in (float32 for half-precision scores)."""
    dtype = accumulation_dtype(x.dtype)
    row_params = {}
    for name, value in params.items():
        if isinstance(value, Tensor):
            value = broadcast_param(name, value, x, dim)
            if value.dtype != dtype:  # .to() costs a dispatch even when it has nothing to do
                value = value.to(dtype)
        row_params[name] = value
    return row_params


class Checked:
    """A hyperparameter validated on every assignment with the constructor's check.

    ``temperature = Checked(check_temperature)`` in a class body: ``module.temperature = -1``
    then raises the same error as ``Module(temperature=-1)`` and leaves the old value.
    """

    def __init__(self, check: Callable[[Any], Any]) -> None:
        self.check = check

    def __set_name__(self, owner: type, name: str) -> None:
        self.slot = f"_{name}"

    def __get__(self, module: Any, owner: type | None = None) -> Any:
        return self if module is None else getattr(module, self.slot)

    def __set__(self, module: Any, value: Any) -> None:
        setattr(module, self.slot, self.check(value))


class Normalizer(nn.Module):
    """Base class: an ``nn.Module`` mapping scores to attention weights.

    Subclasses set ``kernel`` (the row operation in :mod:`attnorm.kernels`) and
    implement :meth:`kernel_params`.  ``forward(scores, mask=None)`` applies the
    shared rules described in this module's docstring.

    Class attributes describe the normalizer for tables and for the attention
    fast paths and for property tests: ``sums_to_one`` (rows with an allowed position
    sum to 1), ``nonnegative`` (weights are >= 0) and ``sparse`` (can output exact zeros).
    """

    kernel: str = ""
    sums_to_one: bool = True
    nonnegative: bool = True
    sparse: bool = False

    def __init__(self, dim: int = -1, backend: str | None = None) -> None:
        super().__init__()
        if not isinstance(dim, int) or isinstance(dim, bool):
            raise TypeError(f"dim must be an int, got {dim!r}")
        self.dim = dim
        self.backend = backends.check_backend(backend)

    def kernel_params(self) -> dict[str, Any]:
        """The parameters passed to the row operation (numbers or tensors)."""
        return {}

    def check_state(self, state: dict[str, Tensor]) -> None:
        """Raise ``ValueError`` if a value about to be loaded (by name) is invalid."""

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        # Loaded values skip the constructor's checks: they are checked before anything
        # is copied, so a failed load leaves the module as it was.
        self.check_state(incoming_state(self, state_dict, prefix))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        shortcut.forget(self)

    # Any change of state gives the module a new token: its calls are looked up afresh (kernels/shortcut.py).
    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        shortcut.forget(self)

    def register_buffer(self, name: str, tensor: Tensor | None, persistent: bool = True) -> None:
        super().register_buffer(name, tensor, persistent)
        shortcut.forget(self)

    def register_parameter(self, name: str, param: nn.Parameter | None) -> None:
        super().register_parameter(name, param)
        shortcut.forget(self)

    def forward(self, scores: Tensor, mask: Tensor | StructuredMask | None = None, *,
                sink: float | Tensor | None = None, softcap: float | None = None) -> Tensor:
        """Weights of ``scores`` along ``dim``.

        ``sink``: a virtual key's score per row, its weight dropped; ``softcap``: normalise
        ``softcap * tanh(scores / softcap)`` instead (see :func:`normalize`).
        """
        if mask is None and sink is None and softcap is None:
            return shortcut.call(self, scores, self._plain)
        return normalize(self.kernel, scores, mask, self.dim, self.kernel_params(), self.backend, sink, softcap)

    def _plain(self, scores: Tensor) -> Tensor:
        """The weights of ``scores`` with no mask, sink or cap (a call :func:`shortcut.call` may replay)."""
        return normalize(self.kernel, scores, None, self.dim, self.kernel_params(), self.backend)

    def _repr_fields(self) -> dict[str, Any]:
        return {}

    def extra_repr(self) -> str:
        fields = dict(self._repr_fields())
        fields["dim"] = self.dim
        if self.backend is not None:
            fields["backend"] = repr(self.backend)
        return ", ".join(f"{key}={_format_field(value)}" for key, value in fields.items())





def _format_field(value: Any) -> str:
    """A parameter for ``extra_repr``: tensors (learnable or per head) show their current values."""
    if not isinstance(value, Tensor):
        return str(value)
    if torch.compiler.is_compiling():  # vmap names the module in a traced call: no values to read there
        return f"tensor of shape {tuple(value.shape)}"
    values = [float(f"{item:.4g}") for item in value.detach().flatten().tolist()]
    return str(values[0]) if value.ndim == 0 else str(values)
