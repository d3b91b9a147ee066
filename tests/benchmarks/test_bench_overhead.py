"""benchmarks/bench_overhead.py's --fast-launch rows (the timing itself is the benchmark's job)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_overhead  # noqa: E402

from attnorm.kernels import fast_launch  # noqa: E402


def test_direct_launch_rows_switch_the_fast_launch_on_for_their_calls_only():
    found, errors = bench_overhead.calls(None, "cpu", torch.float32, fast_launch=True)
    assert not errors
    direct = [key for key in found if key[0].endswith(bench_overhead.DIRECT)]
    assert len(direct) == 2 * len(bench_overhead.modules(None))
    seen = bench_overhead.with_direct_launch(fast_launch.enabled)()
    assert seen is True and fast_launch.enabled() is False
    plain, _ = bench_overhead.calls(None, "cpu", torch.float32)
    assert not [key for key in plain if key[0].endswith(bench_overhead.DIRECT)]
