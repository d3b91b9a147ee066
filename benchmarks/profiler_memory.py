"""Peak CPU memory of a call, from torch's allocator events (shared by the benchmark scripts).

tracemalloc does not see torch's allocations and RSS mixes in the C allocator's
caching, so the peak is the running sum of the profiler's ``[memory]`` events.
"""

from __future__ import annotations

from collections.abc import Callable

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
