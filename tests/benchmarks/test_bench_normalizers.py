"""benchmarks/bench_normalizers.py's --graphs switch (the timing itself is the benchmark's job, on a GPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_normalizers  # noqa: E402


def test_graphs_need_cuda_and_say_so(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["bench_normalizers.py", "--graphs", "--device", "cpu"])
    with pytest.raises(SystemExit):
        bench_normalizers.main()
    assert "--graphs needs --device cuda" in capsys.readouterr().err
    assert bench_normalizers.CUDA_GRAPHS is False
