"""bench_attention's ``radix`` provider: the top-k forward with its radix select forced, the switch restored."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import bench_attention  # noqa: E402

pytest.importorskip("triton")

from attnorm.kernels.triton import attention_topk  # noqa: E402


def test_radix_provider_forces_the_radix_select_and_restores_the_switch(monkeypatch):
    seen = []
    monkeypatch.setattr(bench_attention, "make_normalizer", lambda spec, device: bench_attention.attnorm.make(spec))
    monkeypatch.setattr(bench_attention.attnorm, "attention",
                        lambda *args, **kwargs: seen.append(attention_topk.CANDIDATE_KEEP))
    cases = bench_attention.providers(["topk:k=64", "sparsemax"], ["radix"], "cuda", (1, 2, 16), torch.float32)
    assert [case.key for case in cases] == [bench_attention.BASELINE, ("topk:k=64", "radix")]
    attend, _ = cases[1].build(True, 128)
    before = attention_topk.CANDIDATE_KEEP
    attend(None, None, None)
    assert seen == [0] and attention_topk.CANDIDATE_KEEP == before > 0
    assert not bench_attention.providers(["topk:k=64"], ["radix"], "cpu", (1, 2, 16), torch.float32)[1:]
