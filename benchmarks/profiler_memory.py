"""Peak CPU memory of a call, from torch's allocator events (shared by the benchmark scripts).

tracemalloc does not see torch's allocations and RSS mixes in the C allocator's
caching, so the peak is the running sum of the profiler's ``[memory]`` events.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

import torch


def allocator_peak_bytes(run: Callable[[], object]) -> int:
    """Peak of bytes allocated minus bytes freed by torch's CPU allocator while ``run()`` runs."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as profiler:
        run()
    events = sorted(
        (event for event in profiler.profiler.kineto_results.events() if event.name() == "[memory]"),
        key=lambda event: event.start_ns(),
    )
    running = peak = 0
    for event in events:
        running += event.nbytes()
        peak = max(peak, running)
    return peak


def peak_bytes(run: Callable[[], object], device: str) -> int:
    """Peak bytes allocated while ``run()`` runs, beyond those held before it, on ``device``.

    CUDA: ``max_memory_allocated`` after ``reset_peak_memory_stats``; CPU: :func:`allocator_peak_bytes`
    (with the profiler's start/stop lines on stderr silenced).
    """
    if device == "cuda":
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        run()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - held
    with quiet_stderr():
        return allocator_peak_bytes(run)


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """Silence file descriptor 2 (the profiler's C++ start/stop lines) for the block."""
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)
