"""benchmarks/bench_decoding.py runs end to end on its smallest configuration (CPU, seconds)."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import bench_decoding  # noqa: E402


def test_decoding_rows_for_every_spec_and_kv_length(tmp_path):
    specs = ["ssmax:learnable=true,num_heads={heads}", "sparsemax", "topk:k=0.06"]
    assert bench_decoding.main(["--device", "cpu", "--quick", "--lengths", "64", "96", "--queries", "2",
                                "--specs", *specs, "--out", str(tmp_path)]) == 0
    with open(tmp_path / "bench_decoding_cpu.csv", newline="") as handle:
        reader = csv.DictReader(handle)
        assert tuple(reader.fieldnames) == bench_decoding.COLUMNS
        rows = list(reader)
    expected = {"sdpa", *(spec.format(heads=8) for spec in specs)}
    cells = {(row["normalizer"], row["kv_length"]) for row in rows}
    assert cells == {(name, length) for name in expected for length in ("64", "96")}
    assert not [row for row in rows if row["error"]]
    assert all(float(row["ratio_vs_sdpa"]) > 0 for row in rows)
    assert "KV 96" in (tmp_path / "bench_decoding_cpu.md").read_text()


def read_rows(out):
    with open(out / "bench_decoding_cpu.csv", newline="") as handle:
        return list(csv.DictReader(handle))


def test_route_providers_time_both_decoding_routes(tmp_path):
    """A family with a split-K kernel gets [rows] and [split_k] providers (the interpreter here) and a choice table."""
    spec = "sa_softmax:normalized=false"
    assert bench_decoding.main(["--device", "cpu", "--quick", "--lengths", "40", "--specs", spec,
                                "--out", str(tmp_path)]) == 0
    rows = read_rows(tmp_path)
    assert {row["normalizer"] for row in rows} == {"sdpa", spec, f"{spec}[rows]", f"{spec}[split_k]"}
    assert not [row for row in rows if row["error"]]
    report = (tmp_path / "bench_decoding_cpu.md").read_text()
    assert "split_k / rows" in report and f"| {spec} |" in report


def test_route_providers_are_left_out_without_the_interpreter(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert bench_decoding.main(["--device", "cpu", "--quick", "--lengths", "40", "--specs", "sa_softmax",
                                "--out", str(tmp_path)]) == 0
    assert {row["normalizer"] for row in read_rows(tmp_path)} == {"sdpa", "sa_softmax"}
    assert "route providers left out: split-K runs CPU tensors only under TRITON_INTERPRET=1" in capsys.readouterr().out


def test_copies_providers_for_rows_route_families(tmp_path):
    """--copies: one '[f32 copies]' provider per family on the rows route (not SDPA's, not split-K's)."""
    specs = ["softmax", "sparsemax", "sa_softmax"]
    assert bench_decoding.main(["--device", "cpu", "--quick", "--lengths", "40", "--copies", "--specs", *specs,
                                "--out", str(tmp_path)]) == 0
    names = {row["normalizer"] for row in read_rows(tmp_path)}
    assert "sparsemax[f32 copies]" in names
    assert "softmax[f32 copies]" not in names and "sa_softmax[f32 copies]" not in names


def test_with_copies_switches_the_scores_kernel_off_for_the_call_only():
    import torch

    import attnorm
    from attnorm.routes import decoding

    q, k = torch.zeros(1, 2, 1, 16, dtype=torch.bfloat16), torch.zeros(1, 2, 8, 16, dtype=torch.bfloat16)
    sparsemax = attnorm.Sparsemax(backend="triton")
    seen = bench_decoding.with_copies(lambda: decoding.scores_kernel_applies(sparsemax, q, k))()
    assert seen is False and decoding.scores_kernel_applies(sparsemax, q, k)


def test_cuda_timing_interleaves_providers_and_isolates_a_failing_one(monkeypatch):
    """Every provider once per round (order effects cancel in the per-round ratios); a provider that fails in a
    round becomes an error and leaves the others' rounds whole.  The CUDA sample itself is stubbed."""
    order, calls_made = [], []

    def sample(call, inputs):
        order.append(call.name)
        if call.name == "flaky" and len([n for n in order if n == "flaky"]) == 2:
            raise RuntimeError("out of resources")
        call(*inputs)
        return 1.0

    class Provider:
        def __init__(self, name):
            self.name = name

        def __call__(self, *inputs):
            calls_made.append(self.name)

    monkeypatch.setattr(bench_decoding, "_cuda_sample", sample)
    errors = {}
    calls = {name: Provider(name) for name in ("sdpa", "flaky", "sparsemax")}
    samples = bench_decoding.time_providers(calls, (), "cuda", 3, errors)
    assert order == ["sdpa", "flaky", "sparsemax", "sdpa", "flaky", "sparsemax", "sdpa", "sparsemax"]
    assert samples == {"sdpa": [1.0] * 3, "sparsemax": [1.0] * 3}
    assert list(errors) == ["flaky"] and "out of resources" in errors["flaky"]
    assert calls_made[:3] == ["sdpa", "flaky", "sparsemax"]  # the warm-up call of each, before any round


def test_growing_cache_attends_to_one_more_key_every_call(tmp_path, monkeypatch):
    """``--growing``: every provider sees a new KV length each call, and the run writes its own files."""
    import attnorm

    seen = []
    real = attnorm.attention
    monkeypatch.setattr(attnorm, "attention", lambda q, k, *args, **kwargs: seen.append(k.shape[-2]) or real(
        q, k, *args, **kwargs))
    assert bench_decoding.main(["--device", "cpu", "--quick", "--growing", "--lengths", "40", "--specs", "sparsemax",
                                "--out", str(tmp_path)]) == 0
    assert seen[:3] == [40, 41, 42] and len(set(seen)) == len(seen)
    rows = list(csv.DictReader(open(tmp_path / "bench_decoding_cpu_growing.csv", newline="")))
    assert {row["normalizer"] for row in rows} == {"sdpa", "sparsemax"} and not [row for row in rows if row["error"]]
    assert "one key longer every call" in (tmp_path / "bench_decoding_cpu_growing.md").read_text()


def test_padded_batch_gives_every_provider_the_left_padding_mask(tmp_path, monkeypatch):
    """``--padded``: attnorm and SDPA get one bool mask ``(B, 1, Lq, Lk)``, each sequence starting later."""
    import attnorm

    masks = []
    real = attnorm.attention
    monkeypatch.setattr(attnorm, "attention", lambda *args, attn_mask=None, **kwargs: masks.append(attn_mask) or real(
        *args, attn_mask=attn_mask, **kwargs))
    assert bench_decoding.main(["--device", "cpu", "--quick", "--padded", "--lengths", "40", "--specs", "sparsemax",
                                "--out", str(tmp_path)]) == 0
    mask = masks[0]
    assert mask.dtype == torch.bool and mask.shape == (mask.shape[0], 1, 1, 40) and mask.shape[0] > 1
    starts = (~mask[:, 0, 0]).sum(-1)
    assert starts[0] == 0 and (starts[1:] > 0).all() and (starts.diff() >= 0).all()
    rows = list(csv.DictReader(open(tmp_path / "bench_decoding_cpu_padded.csv", newline="")))
    assert {row["normalizer"] for row in rows} == {"sdpa", "sparsemax"} and not [row for row in rows if row["error"]]
    with pytest.raises(SystemExit):
        bench_decoding.parse_args(["--padded", "--growing"])
