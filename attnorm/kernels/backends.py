"""Which implementation runs: the user's ``backend=`` override, resolved through one table.

Backends (see ``kernels/README.md`` for the contract each implements):

* ``"reference"``: pure torch (:mod:`attnorm.kernels.reference`), differentiated by
  autograd; any device.  The oracle in tests.
* ``"native"``: the C kernels (:mod:`attnorm.kernels.cpu`), CPU tensors.
* ``"triton"``: the Triton kernels (:mod:`attnorm.kernels.triton`), CUDA tensors, or
  CPU tensors under ``TRITON_INTERPRET=1``.
* ``"auto"`` (default): the table below.  ``"torch"`` is kept as an alias for code
  written before the operators existed: native on CPU, reference elsewhere.

======================= ============ =========== ===========
requested \\ device      cpu          cuda        other
======================= ============ =========== ===========
auto                    native [1]   triton [2]  reference
torch (alias)           native [1]   reference   reference
native                  native       error       error
triton                  triton [3]   triton      error
reference               reference    reference   reference
======================= ============ =========== ===========

[1] reference when the native kernels cannot be built (one warning says why);
[2] reference when triton is not installed; [3] under ``TRITON_INTERPRET=1``.
A backend that is asked for by name and cannot run raises a clear error instead of
silently running another one.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterator

import torch

from attnorm.kernels.cpu import build

__all__ = ["BACKENDS", "check_backend", "get_backend", "resolve", "set_backend", "use_backend"]

BACKENDS = ("auto", "reference", "native", "triton", "torch")

_default_backend = "auto"


def check_backend(backend: str | None) -> str | None:
    """Validate a backend name (None means: use the global default)."""
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    return backend


def set_backend(backend: str) -> None:
    """Set the global default backend (one of :data:`BACKENDS`)."""
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


@torch.compiler.assume_constant_result
def native_available() -> bool:
    """True when the native CPU kernels are built and loaded (builds them on first call)."""
    return build.usable()


_TRITON_INSTALLED = importlib.util.find_spec("triton") is not None  # looked up once, at import (not imported)


def triton_installed() -> bool:
    # A module constant, not a cached call: torch.compile (2.11) will not trace find_spec.
    return _TRITON_INSTALLED


@torch.compiler.assume_constant_result
def _triton_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _native_ok() -> bool:
    # Eager asks build.usable() itself (cheap once loaded, and it follows build.disabled());
    # under torch.compile the wrapped function, which must not trace the build.
    return native_available() if torch.compiler.is_compiling() else build.usable()


def resolve(backend: str | None, device: torch.device | str) -> str:
    """The implementation (``"reference"``, ``"native"`` or ``"triton"``) that runs on ``device`` (or device type).

    Raises:
        ValueError: a backend asked for by name that does not run on ``device``.
        RuntimeError: a backend asked for by name that cannot load here.
    """
    requested = _default_backend if backend is None else backend
    kind = device if isinstance(device, str) else device.type
    if kind == "cpu" and (requested == "auto" or requested == "torch"):  # the common case first
        return "native" if _native_ok() else "reference"
    if requested == "reference":
        return "reference"
    if requested == "triton":
        if kind not in ("cuda", "cpu"):
            raise ValueError(f"backend='triton' runs on CUDA tensors (CPU under TRITON_INTERPRET=1), got {kind}")
        if not triton_installed():
            raise RuntimeError("backend='triton' was requested but triton is not installed (pip install triton)")
        if kind == "cpu" and not _triton_interpreted():
            raise RuntimeError(
                "backend='triton' got CPU tensors: Triton runs them only under its interpreter "
                "(set TRITON_INTERPRET=1 before importing triton), else give it CUDA tensors"
            )
        return "triton"
    if requested == "native":
        if kind != "cpu":
            raise ValueError(f"backend='native' runs on CPU tensors, got a {kind} tensor")
        if not _native_ok():
            reason = build.build_info().get("reason")
            raise RuntimeError(f"backend='native' was requested but the native kernels are unavailable: {reason}")
        return "native"
    if requested != "auto" and requested != "torch":
        check_backend(requested)  # a misspelt name raises here rather than taking the reference
    # "auto" and the "torch" alias on devices other than CPU
    if kind == "cuda" and requested == "auto" and triton_installed():
        return "triton"
    return "reference"
