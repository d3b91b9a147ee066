"""Backend selection: which implementation of a row operation runs.

A row operation takes ``x`` (float32 or float64, normalised over the last axis),
a mask (None, a bool tensor broadcastable to ``x``, or a
:class:`~attnorm.masks.StructuredMask` when the last axis holds the keys of
``(..., Lq, Lk)`` scores) and its parameters (python numbers, or tensors of
shape ``(..., 1)`` broadcastable to ``x``), and returns weights shaped like ``x``.

Backends:

* ``"torch"``: pure PyTorch, every device.  CPU tensors take the fast exact path
  of :mod:`attnorm.kernels.cpu`, which falls back, row by row, to the reference
  in :mod:`attnorm.kernels.old_reference` (also what other devices run).
* ``"triton"``: fused Triton kernels (CUDA, or CPU under ``TRITON_INTERPRET=1``).
* ``"auto"`` (default): Triton for CUDA tensors when Triton imports, else torch.

Choose per call (``backend=`` on every function and module) or globally with
:func:`set_backend` / the :func:`use_backend` context manager.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from torch import Tensor

__all__ = ["BACKENDS", "check_backend", "get_backend", "register", "run", "set_backend", "use_backend"]

BACKENDS = ("auto", "torch", "triton")

RowOp = Callable[..., Tensor]
_REGISTRY: dict[str, dict[str, RowOp]] = {"torch": {}, "triton": {}}
_default_backend = "auto"
_torch_ops_loaded = False


def check_backend(backend: str | None) -> str | None:
    """Validate a backend name (None means: use the global default)."""
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    return backend


def register(backend: str, op: str) -> Callable[[RowOp], RowOp]:
    """Decorator registering ``fn`` as the implementation of ``op`` on ``backend``."""

    def decorator(fn: RowOp) -> RowOp:
        _REGISTRY[backend][op] = fn
        return fn

    return decorator


def set_backend(backend: str) -> None:
    """Set the global default backend (``"auto"``, ``"torch"`` or ``"triton"``)."""
    global _default_backend
    if backend is None:
        raise ValueError("set_backend needs a backend name, got None")
    _default_backend = check_backend(backend)


def get_backend() -> str:
    """The global default backend."""
    return _default_backend


@contextlib.contextmanager
def use_backend(backend: str) -> Iterator[None]:
    """Context manager: use ``backend`` by default inside the block."""
    previous = get_backend()
    set_backend(backend)
    try:
        yield
    finally:
        set_backend(previous)


def _triton_ops() -> dict[str, RowOp]:
    if not _REGISTRY["triton"]:
        try:
            import attnorm.kernels.triton  # noqa: F401  (registers the Triton row ops)
        except ImportError:
            pass
    return _REGISTRY["triton"]


def _torch_ops() -> dict[str, RowOp]:
    global _torch_ops_loaded
    if not _torch_ops_loaded:
        # Imports the reference first, then registers the fast CPU ops over it, even
        # when the reference module was imported (and registered) on its own before.
        import attnorm.kernels.fast_cpu  # noqa: F401
        _torch_ops_loaded = True
    return _REGISTRY["torch"]


def _triton_usable(x: Tensor) -> bool:
    return x.is_cuda and bool(_triton_ops())


def resolve(op: str, x: Tensor, backend: str | None) -> RowOp:
    """The implementation of ``op`` that runs for ``x`` under ``backend``."""
    backend = check_backend(backend) or _default_backend
    if backend == "auto":
        backend = "triton" if _triton_usable(x) and op in _triton_ops() else "torch"
    if backend == "triton":
        ops = _triton_ops()
        if op not in ops:
            raise RuntimeError(
                f"backend='triton' was requested but no Triton kernel for {op!r} is available (is triton installed?)"
            )
        return ops[op]
    return _torch_ops()[op]


def run(op: str, x: Tensor, mask: Any, params: dict[str, Any], backend: str | None = None) -> Tensor:
    """Run row operation ``op`` on ``x`` with the selected backend."""
    return resolve(op, x, backend)(x, mask, **params)
