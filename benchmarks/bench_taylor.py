"""Causal Taylor attention (order 2): the linear-time scan against the quadratic form and SDPA.

Variants, each on causal ``(B, H, L, D)`` float32 inputs, forward under ``torch.no_grad``:

* ``taylor_linear``: ``attnorm.attention(q, k, v, TaylorSoftmax(linear=True), is_causal=True)``,
  the chunked scan over a ``(1 + D + D^2) x Dv`` state per head (``O(L D^2 Dv)``);
* ``taylor_quadratic``: the same weights materialised (``attnorm.attention(..., "taylor")``, ``O(L^2 D)``
  time and an ``L x L`` score matrix per head);
* ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention(is_causal=True)`` (softmax), the baseline.

Time is the median of ``--repeats`` calls after a warm-up; memory is the peak of torch's CPU
allocator during one call (:mod:`profiler_memory`).  Each row also checks the linear output
against the quadratic one (max abs difference).  The quadratic form is skipped above
``--max-quadratic`` tokens.

Usage::

    python benchmarks/bench_taylor.py [--lengths 256 512 1024 2048 4096] [--head-dim 32] [--heads 4]

Writes ``benchmarks/results/bench_taylor.csv`` and ``bench_taylor.md``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from profiler_memory import allocator_peak_bytes
from reporting import attnorm_commit, markdown_table, percentiles, versions, write_csv

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
import attnorm  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
COLUMNS = ["variant", "length", "heads", "head_dim", "ms", "ms_p20", "ms_p80", "ms_vs_sdpa", "peak_mib",
           "max_abs_diff_vs_quadratic"]


def variants() -> dict:
    linear = attnorm.TaylorSoftmax(linear=True)
    return {
        "sdpa": lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True),
        "taylor_linear": lambda q, k, v: attnorm.attention(q, k, v, linear, is_causal=True),
        "taylor_quadratic": lambda q, k, v: attnorm.attention(q, k, v, "taylor", is_causal=True),
    }


def measure(attend, q, k, v, repeats: int) -> tuple[torch.Tensor, list[float], int]:
    with torch.no_grad():
        out = attend(q, k, v)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            attend(q, k, v)
            times.append(1e3 * (time.perf_counter() - start))
        peak = allocator_peak_bytes(lambda: attend(q, k, v))
    return out, times, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", nargs="+", type=int, default=[256, 512, 1024, 2048, 4096])
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-quadratic", type=int, default=4096)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    rows = []
    for length in args.lengths:
        generator = torch.Generator().manual_seed(length)
        q, k, v = (torch.randn(1, args.heads, length, args.head_dim, generator=generator) for _ in range(3))
        outputs, baseline = {}, None
        for name, attend in variants().items():
            if name == "taylor_quadratic" and length > args.max_quadratic:
                continue
            out, times, peak = measure(attend, q, k, v, args.repeats)
            outputs[name] = out
            median, low, high = percentiles(times)
            baseline = median if name == "sdpa" else baseline
            rows.append({"variant": name, "length": length, "heads": args.heads, "head_dim": args.head_dim,
                         "ms": median, "ms_p20": low, "ms_p80": high, "ms_vs_sdpa": median / baseline,
                         "peak_mib": peak / 2**20})
            print(f"L={length:6d} {name:17s} {median:9.2f} ms  {peak / 2**20:8.2f} MiB", flush=True)
        if "taylor_quadratic" in outputs:
            difference = float((outputs["taylor_linear"] - outputs["taylor_quadratic"]).abs().max())
            next(row for row in reversed(rows) if row["variant"] == "taylor_linear")[
                "max_abs_diff_vs_quadratic"] = difference
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / "bench_taylor.csv", rows, COLUMNS)
    header = ["variant", "L", "ms (median)", "x SDPA", "peak MiB", "max |linear - quadratic|"]
    table = markdown_table(header, [
        [row["variant"], str(row["length"]), f"{row['ms']:.2f}", f"{row['ms_vs_sdpa']:.2f}",
         f"{row['peak_mib']:.1f}", f"{row['max_abs_diff_vs_quadratic']:.1e}" if "max_abs_diff_vs_quadratic" in row
         else ""]
        for row in rows
    ])
    state = (1 + args.head_dim + args.head_dim**2) * args.head_dim
    text = (f"# Causal Taylor attention (order 2): linear scan vs quadratic vs SDPA\n\n"
            f"B = 1, H = {args.heads}, D = Dv = {args.head_dim}, float32, forward, CPU; commit {attnorm_commit()}; "
            f"{versions('cpu')}\n\nState per head of the linear form: (1 + D + D^2) Dv = {state} floats; "
            f"a KV cache holds 2 D = {2 * args.head_dim} floats per token, so the state is smaller than the "
            f"cache beyond L = {state // (2 * args.head_dim)} tokens.\n\n{table}\n")
    (args.out / "bench_taylor.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
