"""Native CPU row kernels (``csrc/rows.c``), compiled at first use and called with ctypes.

The fast CPU path (:mod:`attnorm.kernels.cpu`) runs these when they are
available: one pass per row in C with OpenMP across rows, where the torch-only
path needs a dozen tensor operations (see ``csrc/rows.c`` for the algorithms).

One-time cost: the first call on a machine compiles ``rows.c`` with the system C
compiler (``$CC``, else ``cc``) into a cache directory (about a second; no torch
headers, no ninja).  Later processes load the cached library in milliseconds.
:func:`build_info` says what happened.  Without a compiler, or when the build
fails (a warning says why), attnorm uses the torch-only path, which needs no
build: results agree to rounding either way.

Environment:

* ``ATTNORM_NATIVE=0`` turns the native kernels off (:func:`disabled` does it for
  a block of code);
* ``ATTNORM_CACHE_DIR`` chooses the cache directory (default
  ``$XDG_CACHE_HOME/attnorm``, else ``~/.cache/attnorm``, else, when that is not
  writable, ``attnorm-$USER`` in the temporary directory);
* ``CC`` chooses the compiler.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor

__all__ = [
    "build_info",
    "disabled",
    "entmax_backward",
    "entmax_backward_with_alpha",
    "entmax_forward",
    "library",
    "self_adjusted_backward",
    "self_adjusted_forward",
    "softmax_backward",
    "softmax_forward",
    "topk_forward",
    "usable",
]

SOURCE_DIR = Path(__file__).with_name("csrc")
SOURCES = ("rows.c", "rows_impl.h")
FLAGS = (
    "-O3",
    "-fPIC",
    "-shared",
    "-std=gnu11",
    # Lets sqrt vectorise; no -ffast-math, which would drop the inf and NaN rules.
    "-fno-math-errno",
    "-fno-trapping-math",
)
# This machine's vector instructions (the build is cached per CPU kind).
ARCH_FLAGS = ("-march=native", *(("-mprefer-vector-width=512",) if platform.machine() in ("x86_64", "AMD64") else ()))
PARALLEL_FLAGS = ("-fopenmp",)
# Tried in turn: a compiler without OpenMP (e.g. Apple clang) builds one-threaded
# kernels; one that rejects the architecture flags, portable ones.
BUILDS = ((*ARCH_FLAGS, *PARALLEL_FLAGS), ARCH_FLAGS, ())

_SUFFIX = {torch.float32: "f32", torch.float64: "f64"}
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_SIGNATURES = {
    # x, y, rows, length, scale, scale_stride, bad, threads
    "attnorm_softmax_forward": (_ptr, _ptr, _i64, _i64, _ptr, _i64, _ptr, ctypes.c_int),
    # y, grad, grad_x, rows, length, scale, scale_stride, threads
    "attnorm_softmax_backward": (_ptr, _ptr, _ptr, _i64, _i64, _ptr, _i64, ctypes.c_int),
    # x, y, rows, length, normalized, stats, bad, threads
    "attnorm_self_adjusted_forward": (_ptr, _ptr, _i64, _i64, ctypes.c_int, _ptr, _ptr, ctypes.c_int),
    # x, grad, grad_x, rows, length, normalized, stats, threads
    "attnorm_self_adjusted_backward": (_ptr, _ptr, _ptr, _i64, _i64, ctypes.c_int, _ptr, ctypes.c_int),
    "attnorm_entmax_forward": (_ptr, _ptr, _i64, _i64, _ptr, _i64, _ptr, ctypes.c_int),
    # y, grad, grad_x, rows, length, alpha, alpha_stride, alpha_grad (per row, or NULL), threads
    "attnorm_entmax_backward": (_ptr, _ptr, _ptr, _i64, _i64, _ptr, _i64, _ptr, ctypes.c_int),
    # x, y, rows, length, k, k_stride, scale, scale_stride, bad, threads
    "attnorm_topk_forward": (_ptr, _ptr, _i64, _i64, _ptr, _i64, _ptr, _i64, _ptr, ctypes.c_int),
}

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_info: dict[str, object] = {}
_disabled = False


def _cache_dirs() -> list[Path]:
    """Where a build may go: the configured cache, then a per-user temporary directory."""
    if os.environ.get("ATTNORM_CACHE_DIR"):
        return [Path(os.environ["ATTNORM_CACHE_DIR"])]
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    user = os.environ.get("USER") or str(os.getuid() if hasattr(os, "getuid") else "user")
    return [Path(base) / "attnorm", Path(tempfile.gettempdir()) / f"attnorm-{user}"]


def _cpu_signature() -> bytes:
    # -march=native code must not be loaded on a machine with other instructions.
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = platform.processor()
    return flags.encode()


def _library_name(compiler: str) -> str:
    digest = hashlib.sha256()
    for name in SOURCES:
        digest.update((SOURCE_DIR / name).read_bytes())
    digest.update(" ".join((compiler, *FLAGS, *ARCH_FLAGS, *PARALLEL_FLAGS, platform.machine())).encode())
    digest.update(_cpu_signature())
    return f"attnorm_rows_{digest.hexdigest()[:16]}.so"


def _build(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built under a temporary name, then renamed: concurrent processes never load a partial file.
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        partial = Path(scratch) / target.name
        errors = []
        for extra in BUILDS:
            command = [compiler, *FLAGS, *extra, str(SOURCE_DIR / "rows.c"), "-o", str(partial), "-lm"]
            result = subprocess.run(command, capture_output=True, text=True)
            if result.returncode == 0:
                os.replace(partial, target)
                return
            errors.append(f"{' '.join(command)} failed:\n{result.stderr.strip()}")
        raise RuntimeError("\n".join(errors))


def _load() -> ctypes.CDLL | None:
    if os.environ.get("ATTNORM_NATIVE", "1") == "0":
        _info.update(available=False, reason="disabled by ATTNORM_NATIVE=0")
        return None
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        _info.update(available=False, reason=f"no C compiler ({compiler!r} not found); using the torch-only path")
        return None
    name, errors, lib = _library_name(compiler), [], None
    for directory in _cache_dirs():
        path = directory / name
        started = time.perf_counter()
        cached = path.exists()
        try:
            if not cached:
                _build(compiler, path)
            lib = ctypes.CDLL(str(path))
            break
        except OSError as error:  # an unwritable cache: try the next
            errors.append(str(error))
        except RuntimeError as error:  # the compiler failed: it would fail anywhere
            errors.append(str(error))
            break
    if lib is None:
        reason = "; ".join(errors)
        _info.update(available=False, reason=reason)
        warnings.warn(f"attnorm: native CPU kernels unavailable, using the torch-only path ({reason})", stacklevel=3)
        return None
    for function_name, argtypes in _SIGNATURES.items():
        for suffix in _SUFFIX.values():
            function = getattr(lib, f"{function_name}_{suffix}")
            function.argtypes = argtypes
            function.restype = ctypes.c_int
    features = lib.attnorm_build_features()
    _info.update(available=True, path=str(path), cached=cached, seconds=time.perf_counter() - started,
                 openmp=bool(features & 1), avx512=bool(features & 2), avx2=bool(features & 4))
    return lib


def library() -> ctypes.CDLL | None:
    """The loaded kernel library (built on first call), or None when unavailable."""
    global _library
    if not _info:
        with _lock:
            if not _info:
                _library = _load()
    return _library


def build_info() -> dict[str, object]:
    """What loading the native kernels did.

    Returns:
        ``{"available": bool, ...}`` with ``path``, ``cached`` (True when an earlier
        build was reused), ``seconds`` (time to build or load) and what the build
        uses (``openmp``: threads across rows; ``avx512``, ``avx2``: vector
        instructions) when available, or ``reason`` when not.
    """
    library()
    return dict(_info)


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Inside the block, the CPU path runs torch ops only (to compare or to debug)."""
    global _disabled
    previous, _disabled = _disabled, True
    try:
        yield
    finally:
        _disabled = previous


def _plain(tensor: Tensor) -> bool:
    return (
        tensor.device.type == "cpu"
        and tensor.dtype in _SUFFIX
        and tensor.layout == torch.strided
        and 0 < tensor.shape[-1] < 2**31
        and not torch._C._functorch.is_functorch_wrapped_tensor(tensor)  # torch.func.vmap and friends
        and not torch._C._functorch.is_legacy_batchedtensor(tensor)  # jacobian(..., vectorize=True)
    )


def usable(*tensors: Tensor) -> bool:
    """True when the native kernels can run on these tensors: plain (not under vmap)
    float32/float64 CPU tensors with rows of 1 to 2^31 - 1 entries.  The kernels
    themselves need contiguous tensors."""
    return not _disabled and all(_plain(tensor) for tensor in tensors) and library() is not None


_SCALAR = {torch.float64: ctypes.c_double, torch.int64: ctypes.c_int64}


def _per_row(value: float | Tensor, x: Tensor, dtype: torch.dtype) -> tuple[Tensor | ctypes.Array, int]:
    """A parameter as a contiguous per-row array of ``dtype`` and its stride (0: shared)."""
    if isinstance(value, Tensor):
        rows = x.numel() // x.shape[-1]
        return value.detach().expand(*x.shape[:-1], 1).reshape(rows).to(dtype).contiguous(), 1
    return (_SCALAR[dtype] * 1)(value), 0  # a ctypes array: no tensor for one number


def _address(tensor: Tensor) -> int:
    if not tensor.is_contiguous():
        raise ValueError("the native kernels need contiguous tensors")
    return tensor.data_ptr()


@functools.cache
def _kernel(name: str, dtype: torch.dtype) -> ctypes._CFuncPtr:
    return getattr(library(), f"{name}_{_SUFFIX[dtype]}")


def _launch(name: str, x: Tensor, *arguments: object) -> None:
    """Call kernel ``name`` for ``x``'s dtype; tensors go as addresses, threads last."""
    function = _kernel(name, x.dtype)
    values = [_address(value) if isinstance(value, Tensor) else value for value in arguments]
    if function(*values, torch.get_num_threads()) != 0:
        raise MemoryError(f"attnorm native kernel {name} could not allocate its row buffers")


def _forward(name: str, x: Tensor, out: Tensor | None, *row_arguments: object) -> tuple[Tensor, Tensor]:
    """Run a forward kernel ``(x, out, rows, length, *row_arguments, bad)``; returns ``(out, bad)``."""
    out = torch.empty_like(x) if out is None else out
    bad = torch.empty(x.shape[:-1], dtype=torch.bool)  # one byte, written as 0 or 1
    length = x.shape[-1]
    _launch(name, x, x, out, x.numel() // length, length, *row_arguments, bad)
    return out, bad


def _backward(name: str, saved: Tensor, grad: Tensor, *row_arguments: object) -> Tensor:
    """Run a backward kernel ``(saved, grad, grad_x, rows, length, *row_arguments)``."""
    grad = grad.to(saved.dtype).contiguous()
    grad_x = torch.empty_like(saved)
    length = saved.shape[-1]
    _launch(name, saved, saved, grad, grad_x, saved.numel() // length, length, *row_arguments)
    return grad_x


def softmax_forward(x: Tensor, scale: float | Tensor, out: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``softmax(scale * x)`` over the last axis (-inf masked); ``out`` may be ``x``.

    Returns ``(weights, bad)``: rows that are fully masked, hold +inf or NaN or
    overflow are zeros, flagged in ``bad`` (bool, ``x.shape[:-1]``).
    """
    return _forward("attnorm_softmax_forward", x, out, *_per_row(scale, x, torch.float64))


def softmax_backward(out: Tensor, grad: Tensor, scale: float | Tensor) -> Tensor:
    """``scale * J^T grad`` of softmax, from its output."""
    return _backward("attnorm_softmax_backward", out, grad, *_per_row(scale, out, torch.float64))


def self_adjusted_forward(x: Tensor, normalized: bool, out: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """SA-Softmax over the last axis; as :func:`softmax_forward`, plus the per-row
    statistics its backward needs (float64 ``(rows, 5)``: max, log-sum-exp below the
    max, low, high, and a gate that is 0 in flagged rows)."""
    stats = torch.empty(x.numel() // x.shape[-1], 5, dtype=torch.float64)
    return (*_forward("attnorm_self_adjusted_forward", x, out, int(normalized), stats), stats)


def self_adjusted_backward(x: Tensor, grad: Tensor, normalized: bool, stats: Tensor) -> Tensor:
    """``J^T grad`` of SA-Softmax, from its input and :func:`self_adjusted_forward`'s statistics."""
    return _backward("attnorm_self_adjusted_backward", x, grad, int(normalized), stats)


def entmax_forward(x: Tensor, alpha: float | Tensor, out: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """alpha-entmax (alpha >= 1.05; 2 is sparsemax) over the last axis; as :func:`softmax_forward`."""
    return _forward("attnorm_entmax_forward", x, out, *_per_row(alpha, x, torch.float64))


def entmax_backward(out: Tensor, grad: Tensor, alpha: float | Tensor) -> Tensor:
    """``J^T grad`` of alpha-entmax, from its output."""
    return _backward("attnorm_entmax_backward", out, grad, *_per_row(alpha, out, torch.float64), None)


def entmax_backward_with_alpha(out: Tensor, grad: Tensor, alpha: Tensor) -> tuple[Tensor, Tensor]:
    """``J^T grad`` of alpha-entmax and, per row (float64, ``out.shape[:-1]``), the
    derivative of ``sum(grad * out)`` with respect to that row's alpha."""
    alpha_grad = torch.empty(out.shape[:-1], dtype=torch.float64)
    grad_x = _backward("attnorm_entmax_backward", out, grad, *_per_row(alpha, out, torch.float64), alpha_grad)
    return grad_x, alpha_grad


def topk_forward(x: Tensor, k: int | Tensor, scale: float | Tensor, out: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Softmax of ``scale * x`` over the ``k`` largest finite scores per row (``k`` an int
    or a per-row integer tensor), ties kept in index order; as :func:`softmax_forward`."""
    counts = _per_row(k, x, torch.int64)
    return _forward("attnorm_topk_forward", x, out, *counts, *_per_row(scale, x, torch.float64))
