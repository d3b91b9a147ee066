"""Triton kernels that ``torch.compile`` can see: the Triton-backed ops decompose into their launches.

By default every attnorm op is opaque to ``torch.compile``: Inductor calls it through its
fake kernel's shapes and never looks inside.  With the switch on
(``ATTNORM_INDUCTOR_KERNELS=1`` in the environment, or :func:`set_enabled`), an op whose
work runs on Triton is *decomposed while AOTAutograd traces it*: a rule registered for
``FunctionalTensorMode`` runs the op's Triton body on the traced tensors, and every
kernel launch goes through :func:`torch.library.wrap_triton`, so the graph holds
``triton_kernel_wrapper_functional`` nodes that Inductor compiles and schedules with the
rest of the graph (and that AOTInductor can package, which cannot call a Python op).
This is what :func:`torch.library.triton_op` does for an op with one implementation;
attnorm's ops have three (reference, native C, Triton), so the rule decomposes only calls
that would run Triton anyway:

* every tensor argument is on a device of :data:`DEVICES` (CUDA), and for the row ops the
  op's ``backend`` argument is ``"triton"``;
* every size is static: under symbolic sizes the launchers' block choices (powers of two of
  a row length) would specialise the graph, so the op stays opaque;
* not while ``torch.export`` traces: the exported program keeps the op, as it keeps a
  ``triton_op`` (AOTInductor decomposes it later, when it lowers the program).

Everything else, and every eager call, takes the op unchanged: an eager launch is never
wrapped, since ``wrap_triton``'s higher-order-op dispatch would cost about a millisecond.

The switch is off by default because what Inductor then compiles was never run on a
GPU by this project's sessions: the tests trace every op's decomposition on CPU
(``tests/kernels/test_inductor_kernels.py``), but executing and timing it needs CUDA.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch._subclasses.functional_tensor import FunctionalTensorMode

from attnorm.kernels import fast_launch
from attnorm.validation import check_bool

__all__ = ["DEVICES", "enabled", "launchable", "register", "set_enabled"]

DEVICES: tuple[str, ...] = ("cuda",)
"""Device types whose Triton calls decompose (tests add ``"cpu"`` to trace them without a GPU)."""

_ENABLED = os.environ.get("ATTNORM_INDUCTOR_KERNELS", "0") == "1"
_STATE = threading.local()
_check_switch = check_bool("value")


def enabled() -> bool:
    """Whether Triton-backed ops decompose into their kernel launches under ``torch.compile``."""
    return _ENABLED


def set_enabled(value: bool) -> None:
    """Turn the decomposition on or off for graphs traced from now on (compiled graphs keep theirs)."""
    global _ENABLED
    _ENABLED = _check_switch(value)


def launchable(kernel: Any) -> Any:
    """``kernel`` wrapped by :func:`torch.library.wrap_triton` while an op decomposes, else launched eagerly.

    Eagerly: ``kernel`` itself, or its direct launcher when :mod:`attnorm.kernels.fast_launch` is on.
    """
    if getattr(_STATE, "tracing", False):
        return torch.library.wrap_triton(kernel)
    return fast_launch.launcher(kernel)


@contextmanager
def _tracing() -> Iterator[None]:
    previous = getattr(_STATE, "tracing", False)
    _STATE.tracing = True
    try:
        yield
    finally:
        _STATE.tracing = previous


def _decomposes(args: tuple[Any, ...], kwargs: dict[str, Any], types: tuple[type, ...]) -> bool:
    if not _ENABLED:
        return False
    from torch.export._trace import custom_triton_ops_decomposition_disabled

    if custom_triton_ops_decomposition_disabled():
        return False
    known = (torch.Tensor, torch._subclasses.FakeTensor, torch._subclasses.functional_tensor.FunctionalTensor)
    if any(not issubclass(kind, known) for kind in types):
        return False  # another tensor subclass: leave the op to it
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    return all(t.device.type in DEVICES and all(isinstance(size, int) for size in t.shape) for t in tensors)


def register(qualified: str, body: Callable[..., Any], lib: torch.library.Library,
             wants: Callable[[tuple[Any, ...]], bool] = lambda args: True) -> None:
    """Decompose op ``qualified`` into ``body(*args, **kwargs)`` (its Triton launches) when traced on CUDA.

    ``wants(args)`` says whether this call runs on Triton at all (the row ops' ``backend`` argument).
    """

    def rule(mode, op, types, args, kwargs):
        if wants(args) and _decomposes(args, kwargs, types):
            with _tracing(), mode:
                return body(*args, **kwargs)
        return mode.__torch_dispatch__(op, types, args, kwargs)

    torch.library.register_torch_dispatch(qualified, FunctionalTensorMode, rule, lib=lib)
