"""The direct launch and its replays on CPU: JIT kernels whose compiled launcher runs the interpreter.

Under ``TRITON_INTERPRET=1`` attnorm's kernels are the interpreter's functions, which the
direct launch (:mod:`attnorm.kernels.fast_launch`) does not take.  :func:`install` swaps
each launched kernel of :mod:`attnorm.kernels.triton` for a real ``JITFunction`` of the same
body whose Triton path (``run``) runs the interpreted kernel and returns a stand-in
compiled kernel; that stand-in's launcher runs the interpreted kernel with the bound
values it is given.  So a call taking the direct launch, or replayed from its plan
(:mod:`attnorm.kernels.triton.replay`), computes for real from exactly the arguments the
GPU launcher would get.  Used by ``tests/kernels/test_replay.py`` and, for the whole
suite, by ``ATTNORM_TEST_REPLAY=1`` (``tests/conftest.py``).
"""

from __future__ import annotations

import importlib
import pkgutil
import threading
from typing import Any

STREAM = 77
"""The stream the stand-in reports; every launch must be given it."""
INTERPRETER = threading.Lock()
"""Triton's interpreter is not thread-safe (its patched ``tl`` functions are process-wide): kernels run one at a
time, the Python around them (keys, plans, the module shortcut) in as many threads as a test starts."""


class Compiled:
    """A compiled kernel whose launcher runs the interpreted kernel with the bound values it is given."""

    function, packed_metadata = "function handle", ("packed",)

    def __init__(self, interpreted: Any, launches: list | None):
        self.interpreted, self.launches = interpreted, launches

    @property
    def run(self):
        def launcher(grid_0, grid_1, grid_2, stream, function, metadata, hook_args, enter, leave, *bound):
            assert (stream, function, metadata, hook_args, enter, leave) == (
                STREAM, "function handle", ("packed",), None, None, None)
            if self.launches is not None:
                self.launches.append(bound)
            with INTERPRETER:
                self.interpreted[(grid_0, grid_1, grid_2)](*bound)

        return launcher


def jitted(interpreted: Any, launches: list | None = None, triton_runs: list | None = None) -> Any:
    """A ``JITFunction`` of ``interpreted``'s body whose Triton path runs the interpreter and returns a stand-in."""
    from triton.runtime import jit

    kernel = jit.JITFunction(interpreted.fn)
    compiled = Compiled(interpreted, launches)

    def run(*args, grid, warmup, **kwargs):
        if triton_runs is not None:
            triton_runs.append(kernel)
        with INTERPRETER:
            interpreted[grid](*args, **kwargs)
        return compiled

    kernel.run = run
    return kernel


def kernel_modules() -> list[Any]:
    """Every module of :mod:`attnorm.kernels.triton`."""
    import attnorm.kernels.triton as package

    names = [info.name for info in pkgutil.iter_modules(package.__path__)]
    return [importlib.import_module(f"{package.__name__}.{name}") for name in names]


def install(monkeypatch: Any, launches: list | None = None, triton_runs: list | None = None) -> int:
    """Swap every launched kernel (a module-level interpreted function named ``*_kernel``) and switch the
    direct launch on, its device and stream the stand-in's; returns how many kernels were swapped."""
    from triton.runtime.interpreter import InterpretedFunction

    from attnorm.kernels import fast_launch, shortcut

    swapped = 0
    for module in kernel_modules():
        for name, value in list(vars(module).items()):
            if isinstance(value, InterpretedFunction) and name.endswith("_kernel"):
                monkeypatch.setattr(module, name, jitted(value, launches, triton_runs))
                swapped += 1
    monkeypatch.setattr(fast_launch, "_ENABLED", True)
    monkeypatch.setattr(fast_launch, "_device_and_stream", lambda: (0, STREAM))
    monkeypatch.setattr(shortcut, "DEVICE_TYPES", frozenset({"cuda", "cpu"}))
    return swapped
