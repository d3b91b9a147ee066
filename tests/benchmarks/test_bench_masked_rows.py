"""benchmarks/bench_masked_rows.py runs end to end on its smallest configuration (CPU, seconds)."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import bench_masked_rows  # noqa: E402


def test_every_mask_kind_against_unmasked_and_torch_softmax(tmp_path):
    specs = ["softmax", "sparsemax"]
    assert bench_masked_rows.main(["--quick", "--device", "cpu", "--specs", *specs, "--out", str(tmp_path)]) == 0
    with open(tmp_path / "bench_masked_rows_cpu.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert {(row["spec"], row["mask"]) for row in rows} == {(s, m) for s in specs for m in bench_masked_rows.MASKS}
    assert not [row for row in rows if row["error"]]
    assert all(float(row["x_unmasked"]) > 0 and float(row["x_torch_softmax"]) > 0 for row in rows)
    assert all(float(row["x_unmasked"]) == 1 for row in rows if row["mask"] == "none")
    assert (tmp_path / "bench_masked_rows_cpu.md").read_text().count("\n| ") == 1 + len(rows)
