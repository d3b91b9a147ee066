"""Peak memory of causal attention: attnorm's Scalable-Softmax route against plain SDPA.

Scalable-Softmax multiplies each query row's logits by ``s log n + bias`` (``n`` =
keys that row may attend), so ``attnorm.attention`` folds the multiplier into ``q``
and runs ``torch.nn.functional.scaled_dot_product_attention`` a block of query rows
at a time.  This script checks that this costs no more memory than SDPA itself
(within 1.2x at L = 8192) and that the output equals a materialised float64 reference.

How peak memory is measured (forward, ``torch.no_grad``, CPU, float32), each
variant in a fresh process after one warm-up call at L = 256:

* ``alloc``: torch's CPU allocator, recorded by ``torch.profiler`` with
  ``profile_memory=True``: the peak of the running sum of allocated minus freed
  bytes during the call (the CPU analogue of ``torch.cuda.max_memory_allocated``
  minus the memory held before).  Inputs are allocated before and do not count.
* ``rss``: the process's resident-set high-water mark (``VmHWM``, reset through
  ``/proc/self/clear_refs``) minus the resident size just before the call; it also
  includes the C allocator's own overheads.

Usage::

    python benchmarks/bench_attention_memory.py [--lengths 1024 2048 4096 8192] [--threads N]

Timings are secondary here; on a shared machine the SDPA route's per-block ops wait for
busy cores, so compare them with ``--threads 1`` too.
Writes ``benchmarks/results/bench_attention_memory.csv`` and ``.png``; exits 1 if the ratio check fails.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch
from profiler_memory import allocator_peak_bytes
from reporting import versions

import attnorm

BATCH, HEADS, HEAD_DIM = 1, 8, 64
CHECK_LENGTH, MAX_RATIO = 8192, 1.2
MATERIALISED_MAX_LENGTH = 2048
VARIANTS = {
    "sdpa": lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True),
    "attnorm_softmax": lambda q, k, v: attnorm.attention(q, k, v, "softmax", is_causal=True),
    "attnorm_ssmax": lambda q, k, v: attnorm.attention(q, k, v, attnorm.ScalableSoftmax(), is_causal=True),
    "attnorm_ssmax_per_head": lambda q, k, v: attnorm.attention(
        q, k, v, attnorm.ScalableSoftmax(num_heads=HEADS), is_causal=True
    ),
    "attnorm_ssmax_materialised": lambda q, k, v: attnorm.attention(
        q, k, v, attnorm.ScalableSoftmax(), is_causal=True, return_weights=True
    ),
}
RESULTS = Path(__file__).resolve().parent / "results"


def inputs(length: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shape = (BATCH, HEADS, length, HEAD_DIM)
    return tuple(torch.randn(shape, generator=generator) for _ in range(3))


def resident_bytes() -> tuple[int, int]:
    """(current resident size, high-water mark) of this process, in bytes."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024


def measure(variant: str, length: int) -> dict:
    """Run in a fresh process: warm up, measure one call's peak memory both ways, then time it (best of 3)."""
    attend = VARIANTS[variant]
    with torch.no_grad():
        attend(*inputs(256))
        q, k, v = inputs(length)
        Path("/proc/self/clear_refs").write_text("5")
        before, _ = resident_bytes()
        out = attend(q, k, v)
        _, high_water = resident_bytes()
        del out
        alloc = allocator_peak_bytes(lambda: attend(q, k, v))
        seconds = []
        for _ in range(3):
            start = time.perf_counter()
            attend(q, k, v)
            seconds.append(time.perf_counter() - start)
    rss = (high_water - before) / 2**20
    return {"variant": variant, "L": length, "alloc_MiB": alloc / 2**20, "rss_MiB": rss, "seconds": min(seconds)}


def check_against_reference(length: int) -> float:
    """Max |attnorm SSMax route - float64 materialised softmax((s log n + b) scores) v| over all heads."""
    q, k, v = inputs(length)
    with torch.no_grad():
        out = attnorm.attention(q, k, v, attnorm.ScalableSoftmax(), is_causal=True)
        allowed = torch.ones(length, length, dtype=torch.bool).tril()
        multiplier = 0.43 * torch.log(torch.arange(1, length + 1, dtype=torch.float64))[:, None]
        error = 0.0
        for head in range(HEADS):
            scores = q[0, head].double() @ k[0, head].double().T / math.sqrt(HEAD_DIM)
            weights = torch.softmax((multiplier * scores).masked_fill_(~allowed, -math.inf), dim=-1)
            error = max(error, float((weights @ v[0, head].double() - out[0, head]).abs().max()))
            del scores, weights
    return error


def run_worker(variant: str, length: int, threads: int | None) -> dict:
    command = [sys.executable, __file__, "--worker", variant, str(length)]
    if threads:
        command += ["--threads", str(threads)]
    result = subprocess.run(command, check=True, capture_output=True, text=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, CHECK_LENGTH])
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    parser.add_argument("--worker", nargs=2, metavar=("VARIANT", "L"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.worker:
        print(json.dumps(measure(args.worker[0], int(args.worker[1]))))
        return 0

    from tqdm import tqdm

    print(f"versions: {versions('cpu')}; {platform.processor() or platform.machine()}")
    print(f"causal attention, q/k/v ({BATCH}, {HEADS}, L, {HEAD_DIM}) float32 on CPU, forward under no_grad")
    jobs = [(variant, length) for length in args.lengths for variant in VARIANTS
            if variant != "attnorm_ssmax_materialised" or length <= MATERIALISED_MAX_LENGTH]
    rows = [run_worker(variant, length, args.threads) for variant, length in tqdm(jobs, desc="measuring", unit="run")]
    print(f"load average during the runs: {Path('/proc/loadavg').read_text().split()[0]} (timings are best of 3)")
    baseline = {row["L"]: row for row in rows if row["variant"] == "sdpa"}
    for row in rows:
        base = baseline[row["L"]]
        row["alloc_ratio"] = row["alloc_MiB"] / base["alloc_MiB"]
        row["rss_ratio"] = row["rss_MiB"] / base["rss_MiB"]
        row["time_ratio"] = row["seconds"] / base["seconds"]

    columns = ("alloc MiB", "x sdpa", "rss MiB", "x sdpa", "seconds", "x sdpa")
    print(f"{'variant':<28}{'L':>6}" + "".join(f"{column:>10}" for column in columns))
    for row in rows:
        print(f"{row['variant']:<28}{row['L']:>6}{row['alloc_MiB']:>10.1f}{row['alloc_ratio']:>10.2f}"
              f"{row['rss_MiB']:>10.1f}{row['rss_ratio']:>10.2f}{row['seconds']:>10.3f}{row['time_ratio']:>10.2f}")

    RESULTS.mkdir(exist_ok=True)
    with open(RESULTS / "bench_attention_memory.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, RESULTS / "bench_attention_memory.png")

    passed = True
    if CHECK_LENGTH in baseline:
        check = next(row for row in rows if row["variant"] == "attnorm_ssmax" and row["L"] == CHECK_LENGTH)
        passed = check["alloc_ratio"] <= MAX_RATIO and check["rss_ratio"] <= MAX_RATIO
        error = check_against_reference(CHECK_LENGTH)
        passed = passed and error < 1e-5
        print(f"L={CHECK_LENGTH}: Scalable-Softmax peak / SDPA peak = {check['alloc_ratio']:.3f} (allocator), "
              f"{check['rss_ratio']:.3f} (RSS); limit {MAX_RATIO}.  Max |out - float64 materialised reference| = "
              f"{error:.2e}.  {'PASS' if passed else 'FAIL'}")
    print(f"wrote {RESULTS / 'bench_attention_memory.csv'} and .png")
    return 0 if passed else 1


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 4))
    for variant in VARIANTS:
        points = [(row["L"], row["alloc_MiB"]) for row in rows if row["variant"] == variant]
        if points:
            axis.plot(*zip(*points, strict=True), marker="o", label=variant)
    axis.set(xscale="log", yscale="log", xlabel="sequence length L", ylabel="peak allocated MiB (forward)",
             title=f"causal attention, B={BATCH} H={HEADS} D={HEAD_DIM} float32, CPU")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
