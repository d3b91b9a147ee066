"""Checks of normalizer parameters, shared by the functions and the modules.

Python numbers are always checked; tensors only where reading their values costs no
device synchronisation and no graph break (CPU tensors, with or without grad, in eager mode).
Each error names the argument and the value.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable
from numbers import Real

import torch
from torch import Tensor

__all__ = [
    "SMALLEST_TEMPERATURE",
    "check_alpha",
    "check_bool",
    "check_finite",
    "check_k",
    "check_softcap",
    "check_temperature",
    "quiet_shape_checks_while_tracing",
    "values_readable",
]

Scalar = float | Tensor


def _check_number(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (Real, Tensor)):
        raise TypeError(f"{name} must be a real number or a tensor, got {value!r}")
    if isinstance(value, Tensor) and not value.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {value.dtype}")


def values_readable(value: Tensor) -> bool:
    """Whether an eager check may read ``value``'s values: on the CPU (elsewhere a device sync), not while
    compiling (a graph break), under a ``torch.func`` transform (values batched per example: a Python bool
    of them is data-dependent control flow) nor while ``torch.jit.trace`` records (a TracerWarning: the
    trace would keep the check's outcome)."""
    return (value.device.type == "cpu" and not torch.compiler.is_compiling()
            and not torch._C._are_functorch_transforms_active() and not torch._C._get_tracing_state())


def _holds(value: Scalar, condition) -> bool:
    """``condition`` (True for valid values) of a number, or of all a tensor's values;
    True for tensors whose values are not read (:func:`values_readable`; a tensor that requires grad is read
    too: not reading one let T = 0 give NaN and T = -1 softmax(-x) with no error)."""
    if isinstance(value, Real):  # no tensor round trip: these checks run on every call
        return condition(float(value))
    return not values_readable(value) or bool(condition(value.detach()).all())


# The smallest temperature whose reciprocal (the logit multiplier) is finite in float32.
SMALLEST_TEMPERATURE = 1 / torch.finfo(torch.float32).max


def check_temperature(temperature: Scalar) -> Scalar:
    """Raise unless ``temperature`` is finite and >= :data:`SMALLEST_TEMPERATURE` (1/T finite in float32)."""
    _check_number("temperature", temperature)
    if not _holds(temperature, lambda t: (t >= SMALLEST_TEMPERATURE) & (t < math.inf)):
        raise ValueError(
            f"temperature must be finite and >= {SMALLEST_TEMPERATURE:.3g} (so that 1/T is finite in float32), "
            f"got {_show(temperature)}"
        )
    return temperature


def check_finite(name: str, value: Scalar) -> Scalar:
    """Raise unless ``value`` is finite."""
    _check_number(name, value)
    if not _holds(value, lambda v: (v > -math.inf) & (v < math.inf)):
        raise ValueError(f"{name} must be finite, got {_show(value)}")
    return value


def check_alpha(alpha: Scalar) -> Scalar:
    """Raise unless ``alpha`` >= 1 and finite."""
    _check_number("alpha", alpha)
    if not _holds(alpha, lambda a: (a >= 1) & (a < math.inf)):
        raise ValueError(f"alpha must be >= 1 and finite, got {_show(alpha)}")
    return alpha


def check_k(k: float) -> int | float:
    """Raise unless ``k`` is an int >= 1 or a float fraction in (0, 1)."""
    if isinstance(k, bool) or not isinstance(k, (int, float)):
        raise TypeError(f"k must be an int >= 1 or a float in (0, 1), got {k!r}")
    if isinstance(k, int) and k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if isinstance(k, float) and not 0 < k < 1:
        raise ValueError(f"k given as a float is a fraction of the allowed positions and must be in (0, 1), got {k}")
    return k


def check_softcap(softcap: float, compute: torch.dtype | None = None) -> float:
    """Raise unless ``softcap`` is a finite python number > 0 (held by ``compute``, the dtype the scores are
    computed in, when given: a larger cap would compute ``inf / inf``); return it as a float."""
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not 0 < softcap < math.inf:
        raise ValueError(f"softcap must be a finite number > 0 or None, got {softcap!r}")
    if compute is not None and softcap > torch.finfo(compute).max:
        raise ValueError(f"softcap {softcap!r} exceeds the largest {compute} ({torch.finfo(compute).max:.4g}), the "
                         f"precision the scores are computed in: give a smaller cap, or None for no cap")
    return float(softcap)


def check_bool(name: str) -> Callable[[bool], bool]:
    """A check raising ``TypeError`` unless the value is a bool."""

    def check(value: bool) -> bool:
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {value!r}")
        return value

    return check


def _show(value: Scalar) -> str:
    if isinstance(value, Tensor):
        return f"tensor with values {value.detach().flatten()[:8].tolist()}"
    return repr(float(value))


def quiet_shape_checks_while_tracing(function: Callable) -> Callable:
    """Run ``function`` without the TracerWarnings of attnorm's own checks under ``torch.jit.trace``.

    While tracing, ``x.shape[i]`` and ``x.numel()`` are tensors, so each check of a shape in
    Python (broadcasting, emptiness, ``dim``, the attention route) warns that the trace treats
    it as a constant. attnorm branches only on shapes and Python parameters, never on tensor
    values (no host synchronisation), so the trace specialises exactly as it does on any
    shape; the value checks of CPU tensors above only raise, and a trace keeps none of them.
    Warnings raised from other modules (the caller's own branches) pass through.
    """

    @functools.wraps(function)
    def run(*args, **kwargs):
        if not torch._C._get_tracing_state():  # torch.jit.is_tracing() in one C call: this runs on every call
            return function(*args, **kwargs)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=torch.jit.TracerWarning, module=r"attnorm\.")
            return function(*args, **kwargs)

    return run
