"""benchmarks/bench_modifiers.py runs end to end on its smallest configuration (CPU, seconds)."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import bench_modifiers  # noqa: E402


def test_every_normalizer_with_each_modifier_against_plain(tmp_path):
    assert bench_modifiers.main(["--device", "cpu", "--quick", "--out", str(tmp_path)]) == 0
    with open(tmp_path / "bench_modifiers_cpu.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    cells = {(row["spec"], row["modifier"]) for row in rows}
    assert cells == {(spec, name) for spec in bench_modifiers.SPECS for name in ("plain", *bench_modifiers.MODIFIERS)}
    assert not [row for row in rows if row["error"]]
    assert all(float(row["ratio_to_plain"]) > 0 for row in rows)
    assert all(float(row["ratio_to_plain"]) == 1 for row in rows if row["modifier"] == "plain")
