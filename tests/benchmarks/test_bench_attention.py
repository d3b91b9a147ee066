"""benchmarks/bench_attention.py runs end to end on its smallest configuration (CPU, seconds)."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import bench_attention  # noqa: E402

SPECS = ["softmax:temperature=0.5", "ssmax:learnable=true,num_heads={heads}", "sparsemax"]


def read_rows(path: Path) -> list[dict]:
    with open(path, newline="") as handle:
        reader = csv.DictReader(handle)
        assert tuple(reader.fieldnames) == bench_attention.COLUMNS
        return list(reader)


def test_grid_writes_every_provider_mode_and_ratio(tmp_path):
    code = bench_attention.main(["--device", "cpu", "--quick", "--lengths", "64", "--specs", *SPECS,
                                 "--providers", "attnorm", "materialised", "--out", str(tmp_path)])
    assert code == 0
    rows = read_rows(tmp_path / "bench_attention_cpu.csv")
    assert not [row for row in rows if row["metric"] == "error"]
    measured = {(row["normalizer"], row["provider"], row["causal"], row["mode"]) for row in rows
                if row["metric"] == "time"}
    specs = [spec.format(heads=2) for spec in SPECS]
    expected = {("softmax", "sdpa")} | {(spec, provider) for spec in specs for provider in ("attnorm", "materialised")}
    assert measured == {(*key, causal, mode) for key in expected for causal in ("True", "False")
                        for mode in bench_attention.MODES}
    baseline = [float(row["median"]) for row in rows
                if row["provider"] == "sdpa" and row["metric"].endswith("_vs_sdpa")]
    assert baseline == [pytest.approx(1.0)] * len(baseline) and baseline
    assert all(float(row["median"]) > 0 for row in rows if row["metric"] == "peak_memory" and row["provider"] != "sdpa")
    assert "| ssmax:learnable=true,num_heads=2 | attnorm |" in (tmp_path / "bench_attention_cpu.md").read_text()
    assert (tmp_path / "bench_attention_cpu.png").stat().st_size > 0


def test_a_failing_provider_becomes_an_error_row(tmp_path, monkeypatch):
    def broken(*args):
        raise RuntimeError("no kernel for this shape")

    monkeypatch.setattr(bench_attention, "materialised_attend", broken)
    bench_attention.main(["--device", "cpu", "--quick", "--lengths", "64", "--specs", "sparsemax",
                          "--providers", "attnorm", "materialised", "--out", str(tmp_path)])
    rows = read_rows(tmp_path / "bench_attention_cpu.csv")
    errors = [row for row in rows if row["metric"] == "error"]
    assert {row["provider"] for row in errors} == {"materialised"}
    assert all("RuntimeError: no kernel for this shape" in row["error"] for row in errors)
    assert any(row["provider"] == "attnorm" and row["metric"] == "time" for row in rows)


def test_check_memory_reports_a_ratio_per_normalizer(tmp_path):
    bench_attention.main(["--check-memory", "--check-length", "256", "--heads", "1", "--specs", "ssmax",
                          "entmax:alpha=1.5", "--out", str(tmp_path)])
    rows = read_rows(tmp_path / "bench_attention_check_memory_cpu.csv")
    ratios = {row["normalizer"]: float(row["median"]) for row in rows if row["metric"] == "memory_ratio_vs_sdpa"}
    assert set(ratios) == {"softmax", "ssmax", "entmax:alpha=1.5"} and ratios["softmax"] == pytest.approx(1.0)


def test_gpt2_step_compares_patched_models_with_sdpa(tmp_path):
    pytest.importorskip("transformers")
    code = bench_attention.main(["--gpt2-step", "--device", "cpu", "--quick", "--specs", "ssmax", "sparsemax",
                                 "--out", str(tmp_path)])
    assert code == 0
    rows = read_rows(tmp_path / "bench_attention_gpt2_cpu.csv")
    ratios = {row["normalizer"]: float(row["median"]) for row in rows if row["metric"] == "time_ratio_vs_sdpa"}
    assert set(ratios) == {"softmax", "ssmax", "sparsemax"} and ratios["softmax"] == pytest.approx(1.0)


def test_a_window_run_gives_sdpa_the_same_window_as_a_dense_mask(tmp_path):
    """``--window W``: attnorm takes ``sliding_window_mask(W)``, SDPA the same mask as a bool tensor, so the
    softmax row and SDPA's compute the same attention; the files are named for the window."""
    q, k, v = (torch.randn(1, 2, 40, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    sdpa = bench_attention.providers(["softmax"], ["attnorm"], "cpu", (1, 2, 8), torch.float32, window=5)
    (baseline, _), (ours, _) = (provider.build(True, 40) for provider in sdpa)
    torch.testing.assert_close(ours(q, k, v), baseline(q, k, v))
    allowed = bench_attention.window_allowed(40, 5, "cpu")
    assert allowed.sum(-1).tolist() == [min(i + 1, 5) for i in range(40)]
    bench_attention.main(["--device", "cpu", "--quick", "--lengths", "64", "--specs", "softmax", "--window", "8",
                          "--providers", "attnorm", "--out", str(tmp_path)])
    rows = read_rows(tmp_path / "bench_attention_cpu_window8.csv")
    assert {row["provider"] for row in rows if row["metric"] == "time"} == {"sdpa", "attnorm"}
    assert "sliding window of 8 keys" in (tmp_path / "bench_attention_cpu_window8.md").read_text()
