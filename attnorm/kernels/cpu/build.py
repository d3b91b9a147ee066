"""Building, caching and loading the native CPU kernels (``csrc/rows.c``).

One-time cost: the first call on a machine compiles ``rows.c`` with the system C
compiler (``$CC``, else ``cc``) into a cache directory (about a second; no torch
headers, no ninja).  Later processes load the cached library in milliseconds.
:func:`build_info` says what happened.  Without a compiler, or when the build fails
(one warning says why), :func:`usable` is False and the operator layer runs the
reference backend instead.

The cache is safe to share: a build is written under a temporary name and renamed
into place with a SHA-256 sidecar (``<library>.sha256``); a cached library is read
and checked against it before it is loaded (a truncated or empty file would
otherwise crash the process with SIGBUS when mapped), rebuilt when it does not
match, and probed with a small known call once loaded.  Concurrent first calls in
one process build once.

Environment:

* ``ATTNORM_NATIVE=0`` turns the native kernels off (:func:`disabled` does it for
  a block of code);
* ``ATTNORM_CACHE_DIR`` chooses the cache directory (default
  ``$XDG_CACHE_HOME/attnorm``, else ``~/.cache/attnorm``, else, when that is not
  writable, ``attnorm-$USER`` in the temporary directory);
* ``CC`` chooses the compiler, possibly with flags (``CC="gcc -O0"``).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import math
import os
import platform
import shlex
import shutil
import struct
import subprocess
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["build_info", "disabled", "kernel", "library", "usable"]

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

SUFFIX = {torch.float32: "f32", torch.float64: "f64"}
_i64, _int, _ptr, _double = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_double
# The C entry points (one per row type, suffixed _f32 / _f64): rows, length, then each
# per-row parameter as (double for all rows, array per row in the row type | NULL); the thread count last.
# The sink is such a parameter (its score, -inf: none; its weight in a backward, 0: none), and
# its per-row output (sink_weight, dsink) is NULL when there is no sink.  The soft cap comes
# just before the thread count (a double, 0: off); backward passes take the raw scores with it.
# The forwards (and Self-Adjusted's backward, which reads the scores) then take the mask: ``stops``,
# each row's allowed prefix under a causal mask and key lengths (int64 per row; NULL: no bound),
# and a bool mask, ``allow`` (NULL: none) with ``allow_rows``, the offset of each row's mask row
# in it (int64 per row).
SIGNATURES = {
    # x, y, rows, length, variant, first, first_rows, second, second_rows, multiplier | NULL, log_count | NULL,
    # sink, sink_rows, sink_weight | NULL, cap, stops | NULL, allow | NULL, allow_rows, threads
    "attnorm_softmax_forward": (_ptr, _ptr, _i64, _i64, _int, _double, _ptr, _double, _ptr, _ptr, _ptr,
                                _double, _ptr, _ptr, _double, _ptr, _ptr, _ptr, _int),
    # y, grad, x | NULL, grad_x, rows, length, multiplier, multiplier_rows, param_grad, per_row | NULL,
    # sink_weight, sink_weight_rows, sink, sink_rows, dsink | NULL, cap, threads
    "attnorm_softmax_backward": (_ptr, _ptr, _ptr, _ptr, _i64, _i64, _double, _ptr, _int, _ptr,
                                 _double, _ptr, _double, _ptr, _ptr, _double, _int),
    # x, y, rows, length, k, is_fraction, temperature, temperature_rows, multiplier | NULL,
    # sink, sink_rows, sink_weight | NULL, cap, stops | NULL, allow | NULL, allow_rows, threads
    "attnorm_topk_forward": (_ptr, _ptr, _i64, _i64, _double, _int, _double, _ptr, _ptr, _double, _ptr, _ptr,
                             _double, _ptr, _ptr, _ptr, _int),
    # x, y, rows, length, alpha, alpha_rows, gate | NULL, sink, sink_rows, sink_weight | NULL, cap, stops | NULL,
    # allow | NULL, allow_rows, threads
    "attnorm_entmax_forward": (_ptr, _ptr, _i64, _i64, _double, _ptr, _ptr, _double, _ptr, _ptr, _double, _ptr,
                               _ptr, _ptr, _int),
    # y, grad, grad_x, rows, length, gate, gate_rows, alpha, alpha_rows, alpha_grad | NULL,
    # sink_weight, sink_weight_rows, dsink | NULL, x | NULL, cap, threads
    "attnorm_entmax_backward": (_ptr, _ptr, _ptr, _i64, _i64, _double, _ptr, _double, _ptr, _ptr,
                                _double, _ptr, _ptr, _ptr, _double, _int),
    # x, y, rows, length, normalized, stats | NULL, sink, sink_rows, sink_weight | NULL, cap, stops | NULL,
    # allow | NULL, allow_rows, threads
    "attnorm_self_adjusted_forward": (_ptr, _ptr, _i64, _i64, _int, _ptr, _double, _ptr, _ptr, _double, _ptr,
                                      _ptr, _ptr, _int),
    # x, grad, grad_x, rows, length, normalized, stats, sink, sink_rows, dsink | NULL, cap, stops | NULL,
    # allow | NULL, allow_rows, threads
    "attnorm_self_adjusted_backward": (_ptr, _ptr, _ptr, _i64, _i64, _int, _ptr, _double, _ptr, _ptr, _double,
                                       _ptr, _ptr, _ptr, _int),
}

# A call goes through the kernel's packed entry point (``<name>_packed_<suffix>``, the end of
# csrc/rows_impl.h): its arguments packed here into one buffer of 8-byte slots, preceded by
# their count, which C checks.  ctypes converts each argument of a direct call in Python
# (about 0.1 us apiece, 1.8 us for softmax's 16, most of a tiny call's native time); one
# buffer costs 0.2 us to pack and one argument to pass.  Pointers go as addresses (0: NULL).
_SLOTS = {_ptr: "Q", _i64: "q", _int: "q", _double: "d"}
PACKED_MISMATCH = -1  # what a packed entry point returns when the slot count is not its own

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_callers: dict[tuple[str, torch.dtype], Callable[..., int]] = {}
_info: dict[str, object] = {}
_disabled = False


class _BuildError(RuntimeError):
    """The compiler is missing or failed: it would fail in any cache directory."""


def _cache_dirs() -> list[Path]:
    """Where a build may go: the configured cache, then a per-user temporary directory."""
    if os.environ.get("ATTNORM_CACHE_DIR"):
        return [Path(os.environ["ATTNORM_CACHE_DIR"])]
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    user = os.environ.get("USER") or str(os.getuid() if hasattr(os, "getuid") else "user")
    return [Path(base) / "attnorm", Path(tempfile.gettempdir()) / f"attnorm-{user}"]


def _compiler() -> list[str]:
    """``$CC`` split like a shell would (``"gcc -O0"`` is a compiler and a flag), else ``cc``."""
    return shlex.split(os.environ.get("CC", "")) or ["cc"]


def _cpu_signature() -> bytes:
    # -march=native code must not be loaded on a machine with other instructions.
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = platform.processor()
    return flags.encode()


def _library_name(compiler: list[str]) -> str:
    digest = hashlib.sha256()
    for name in SOURCES:
        digest.update((SOURCE_DIR / name).read_bytes())
    digest.update(" ".join((*compiler, *FLAGS, *ARCH_FLAGS, *PARALLEL_FLAGS, platform.machine())).encode())
    digest.update(_cpu_signature())
    return f"attnorm_rows_{digest.hexdigest()[:16]}.so"


def _checksum_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _checksum(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _verified(path: Path) -> bool:
    """True when ``path`` is non-empty and matches its checksum: read, never mapped, so a truncated file is harmless."""
    try:
        return path.stat().st_size > 0 and _checksum(path) == _checksum_path(path).read_text().strip()
    except OSError:
        return False


def _build(compiler: list[str], target: Path) -> None:
    """Compile into a scratch directory beside ``target``, then rename the library and its checksum into place."""
    if shutil.which(compiler[0]) is None:
        raise _BuildError(f"no C compiler ({compiler[0]!r} not found)")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        partial = Path(scratch) / target.name
        errors = []
        for extra in BUILDS:
            command = [*compiler, *FLAGS, *extra, str(SOURCE_DIR / "rows.c"), "-o", str(partial), "-lm"]
            result = subprocess.run(command, capture_output=True, text=True)
            if result.returncode == 0 and partial.is_file() and partial.stat().st_size > 0:
                checksum = _checksum_path(partial)
                checksum.write_text(_checksum(partial))
                os.replace(partial, target)
                os.replace(checksum, _checksum_path(target))
                return
            errors.append(f"{' '.join(command)} failed:\n{result.stderr.strip()}")
        raise _BuildError("\n".join(errors))


def _caller(function: ctypes._CFuncPtr, argtypes: tuple[type, ...]) -> Callable[..., int]:
    """``call(*arguments) -> status``: ``arguments`` (as :data:`SIGNATURES` lists them) packed for ``function``."""
    pack = struct.Struct("=q" + "".join(_SLOTS[kind] for kind in argtypes)).pack
    count = len(argtypes)

    def call(*arguments: object) -> int:
        return function(pack(count, *arguments))

    return call


def _probe(callers: dict[tuple[str, torch.dtype], Callable[..., int]]) -> bool:
    """A tiny known call: softmax of (0, log 3) with a sink of score log 4 is (1/8, 3/8) and 1/2 for the sink.

    The first kernel call may come inside ``torch.func.grad``/``jvp`` (whose transforms wrap even
    new tensors: no data pointer), a dispatch mode (fake tensors) or ``torch.jit.trace`` (which
    would record the probe and warn about its checks): it runs outside all three.
    """
    tracing = torch._C._get_tracing_state()
    torch._C._set_tracing_state(None)
    try:
        with torch._C._DisableFuncTorch(), _disable_current_modes():
            return _probe_call(callers)
    finally:
        torch._C._set_tracing_state(tracing)


def _probe_call(callers: dict[tuple[str, torch.dtype], Callable[..., int]]) -> bool:
    # On the CPU even inside a device context (``with torch.device(...)``): C writes these.
    x = torch.tensor([0.0, math.log(3.0)], dtype=torch.float64, device="cpu")
    y, multiplier, sink_weight = (torch.full((size,), math.nan, dtype=torch.float64, device="cpu")
                                  for size in (2, 1, 1))
    status = callers["attnorm_softmax_forward", torch.float64](
        x.data_ptr(), y.data_ptr(), 1, 2, 0, 1.0, 0, 1.0, 0, multiplier.data_ptr(), 0, math.log(4.0), 0,
        sink_weight.data_ptr(), 0.0, 0, 0, 0, 1)
    expected = torch.tensor([0.125, 0.375, 0.5], dtype=torch.float64, device="cpu")
    return status == 0 and torch.allclose(torch.cat([y, sink_weight]), expected, rtol=0, atol=1e-12) \
        and multiplier.item() == 1.0


def _open(path: Path) -> tuple[ctypes.CDLL, dict[tuple[str, torch.dtype], Callable[..., int]]]:
    """Load a verified library, declare its packed entry points and probe it.

    Raises:
        _BuildError: the library loads but computes a wrong result.
    """
    lib = ctypes.CDLL(str(path))
    callers = {}
    for function_name, argtypes in SIGNATURES.items():
        for dtype, suffix in SUFFIX.items():
            function = getattr(lib, f"{function_name}_packed_{suffix}")
            function.argtypes = (ctypes.c_char_p,)
            function.restype = ctypes.c_int
            callers[function_name, dtype] = _caller(function, argtypes)
    if not _probe(callers):
        raise _BuildError(f"{path} loads but fails its probe call")
    return lib, callers


def _load() -> ctypes.CDLL | None:
    if os.environ.get("ATTNORM_NATIVE", "1") == "0":
        _info.update(available=False, reason="disabled by ATTNORM_NATIVE=0")
        return None
    compiler = _compiler()
    name, errors = _library_name(compiler), []
    for directory in _cache_dirs():
        path = directory / name
        started = time.perf_counter()
        try:
            cached = _verified(path)
            if not cached:
                _build(compiler, path)
                if not _verified(path):  # replaced meanwhile by a broken file
                    raise _BuildError(f"{path} does not match its checksum after the build")
            lib, callers = _open(path)
        except _BuildError as error:  # it would fail in any directory
            errors.append(str(error))
            break
        except OSError as error:  # an unwritable cache: try the next
            errors.append(str(error))
            continue
        _callers.update(callers)
        features = lib.attnorm_build_features()
        _info.update(available=True, path=str(path), cached=cached, seconds=time.perf_counter() - started,
                     compiler=" ".join(compiler), openmp=bool(features & 1), avx512=bool(features & 2),
                     avx2=bool(features & 4))
        return lib
    reason = "; ".join(errors)
    _info.update(available=False, reason=reason)
    warnings.warn(f"attnorm: native CPU kernels unavailable, the reference backend runs instead ({reason})",
                  stacklevel=4)
    return None


def library() -> ctypes.CDLL | None:
    """The loaded kernel library (built on first call, once per process), or None when unavailable."""
    global _library
    if not _info:
        with _lock:
            if not _info:
                _library = _load()
    return _library


@functools.cache
def kernel(name: str, dtype: torch.dtype) -> Callable[..., int]:
    """The C kernel ``name`` for rows of ``dtype`` (float32 or float64), as ``call(*arguments) -> status``.

    ``arguments`` are those :data:`SIGNATURES` lists, pointers as addresses (0 for NULL);
    they travel packed (see :data:`PACKED_MISMATCH`).

    Raises:
        RuntimeError: the native kernels are unavailable (see :func:`build_info`).
    """
    if library() is None:
        raise RuntimeError(f"attnorm native kernels are unavailable: {_info.get('reason')}")
    return _callers[name, dtype]


def build_info() -> dict[str, object]:
    """What loading the native kernels did.

    Returns:
        ``{"available": bool, ...}`` with ``path``, ``cached`` (True when an earlier
        build was reused), ``seconds`` (time to build or load), ``compiler`` and what
        the build uses (``openmp``: threads across rows; ``avx512``, ``avx2``: vector
        instructions) when available, or ``reason`` when not.
    """
    library()
    return dict(_info)


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Inside the block, :func:`usable` is False (the operator layer runs the reference; to compare or debug)."""
    global _disabled
    previous, _disabled = _disabled, True
    try:
        yield
    finally:
        _disabled = previous


def usable() -> bool:
    """True when the native kernels run: not disabled, and built and loaded (on the first call)."""
    return not _disabled and library() is not None
