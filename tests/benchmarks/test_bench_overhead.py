"""benchmarks/bench_overhead.py's --triton-launch rows (the timing itself is the benchmark's job)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_overhead  # noqa: E402

from attnorm.kernels import fast_launch  # noqa: E402


def test_triton_launch_rows_switch_the_fast_launch_off_for_their_calls_only():
    found, errors = bench_overhead.calls(None, "cpu", torch.float32, triton_launch=True)
    assert not errors
    rows = [key for key in found if key[0].endswith(bench_overhead.TRITON_LAUNCH)]
    assert len(rows) == 2 * len(bench_overhead.modules(None))
    initial = fast_launch.enabled()
    try:
        for before in (True, False):
            fast_launch.set_enabled(before)
            seen = bench_overhead.with_triton_launch(fast_launch.enabled)()
            assert seen is False and fast_launch.enabled() is before
    finally:
        fast_launch.set_enabled(initial)
    plain, _ = bench_overhead.calls(None, "cpu", torch.float32)
    assert not [key for key in plain if key[0].endswith(bench_overhead.TRITON_LAUNCH)]
