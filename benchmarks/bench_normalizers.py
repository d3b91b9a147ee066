"""Time and peak memory of every attnorm normalizer against torch.softmax and the entmax package.

For each normalizer and backend (``torch`` on CPU; ``torch`` and ``triton`` on CUDA)
and each shape ``rows x L``: forward, backward and forward+backward time (median,
p20 and p80 over repeats, after warm-up) and peak memory.  Baselines run in the same
process, interleaved with the normalizers (one repeat of each in turn, so a busy
machine slows all of them alike): ``torch.softmax`` (the reference for every ratio),
the ``entmax`` package (``sparsemax``, ``entmax15``, ``entmax_bisect``), and on CUDA
Liger-Kernel's softmax and sparsemax and AdaSplash's ``triton_entmax`` when installed.
Ratios against ``torch.softmax`` are the median over rounds of each round's ratio,
so load that comes and goes on a shared machine cancels out.

Scores are ``torch.randn(rows, L)`` (unit-variance logits, as attention scores at
initialisation), normalised over ``L``; backward uses a fixed random upstream gradient.

* forward: ``y = f(x)`` with ``x.requires_grad`` (a training forward, saving for backward);
* backward: ``y.backward(g)`` alone, after an untimed forward;
* forward+backward: both.

Peak memory is the most memory allocated during the call beyond what was held
before it (inputs, and for backward the saved tensors, do not count).  On CUDA it is
``torch.cuda.max_memory_allocated``.  On the CPU ``tracemalloc`` does not see torch's
allocations and the process RSS mixes in the C allocator's caching, so it is the
peak of the running sum of bytes allocated minus freed by torch's CPU allocator, as
``torch.profiler`` records them (``profile_memory=True``): the CPU analogue of the CUDA
number.  On CUDA the report adds achieved GB/s for attnorm's kernels: the minimum
bytes each kernel moves (:func:`attnorm.kernels.traffic.bytes_moved`) over the median
time, against the device's peak bandwidth.

On the CPU, attnorm's ``torch`` backend runs native C kernels (built once per
machine, see :mod:`attnorm.kernels.native`); their one-time build and load times
are measured in fresh processes and reported apart from the steady-state times
(CSV rows with mode ``one-time``).  ``--torch-only`` adds attnorm's torch-only CPU
path (native kernels off) as backend ``torch-only``, in the same interleaved rounds.

Usage::

    python benchmarks/bench_normalizers.py              # 16384x512, 2048x4096, 256x32768
    python benchmarks/bench_normalizers.py --quick      # under a minute on a 2-core CPU
    python benchmarks/bench_normalizers.py --torch-only # also attnorm without its native kernels
    python benchmarks/bench_normalizers.py --shapes 4096x1024 --dtype bfloat16 --device cuda

Writes ``bench_normalizers.csv``, ``.md`` (ratios vs torch.softmax, also printed) and
``.png`` into ``--out`` (default ``benchmarks/results/``).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import importlib
import importlib.metadata
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from profiler_memory import allocator_peak_bytes
from tqdm import tqdm

import attnorm
from attnorm.kernels.cpu import native

MODES = ("forward", "backward", "forward+backward")
COLUMNS = (
    "normalizer", "backend", "provider", "mode", "metric", "unit", "L", "rows", "dtype", "device",
    "median", "p20", "p80", "versions",
)
FULL_SHAPES = ((16384, 512), (2048, 4096), (256, 32768))
QUICK_SHAPES = ((2048, 256), (128, 4096))
TOPK = 32
GENERAL_ALPHA = 1.3
BASELINE = ("softmax", "-", "torch")
# Peak bandwidth (bytes/s) of devices whose properties do not report it.
KNOWN_BANDWIDTH = {"H100": 3.35e12, "H200": 4.8e12, "A100": 2.0e12}


@dataclass(frozen=True)
class Case:
    """One implementation to time: a normalizer from one provider, on one backend."""

    normalizer: str
    backend: str
    provider: str
    build: Callable[[], Callable[[torch.Tensor], torch.Tensor]]
    op: str | None = None  # attnorm row operation, for the bytes it must move

    @property
    def key(self) -> tuple[str, str, str]:
        return self.normalizer, self.backend, self.provider


def without_native(build: Callable[[], Callable]) -> Callable[[], Callable]:
    """``build`` with its calls run on the torch-only CPU path (native kernels off)."""

    def build_torch_only() -> Callable:
        fn = build()

        def run(x: torch.Tensor) -> torch.Tensor:
            with native.disabled():
                return fn(x)

        return run

    return build_torch_only


def attnorm_cases(backend: str, torch_only: bool = False) -> list[Case]:
    modules = {
        "softmax": (lambda: attnorm.Softmax(backend=backend), "softmax"),
        "softmax(T=0.5)": (lambda: attnorm.Softmax(temperature=0.5, backend=backend), "softmax"),
        "ssmax": (lambda: attnorm.ScalableSoftmax(backend=backend), "scalable_softmax"),
        "sa_softmax": (lambda: attnorm.SelfAdjustedSoftmax(backend=backend), "self_adjusted_softmax"),
        f"topk(k={TOPK})": (lambda: attnorm.TopKSoftmax(TOPK, backend=backend), "topk_softmax"),
        "sparsemax": (lambda: attnorm.Sparsemax(backend=backend), "sparsemax"),
        "entmax(1.5)": (lambda: attnorm.Entmax(1.5, backend=backend), "entmax"),
        f"entmax({GENERAL_ALPHA})": (lambda: attnorm.Entmax(GENERAL_ALPHA, backend=backend), "entmax"),
    }
    if torch_only:
        return [Case(name, "torch-only", "attnorm", without_native(build), op) for name, (build, op) in modules.items()]
    return [Case(name, backend, "attnorm", build, op) for name, (build, op) in modules.items()]


def native_one_time_cost() -> dict[str, object]:
    """The native kernels' one-time cost, in fresh processes with an empty cache:
    ``build_info()`` of the first (which compiles) and of the second (which loads)."""
    script = "import json; from attnorm.kernels.cpu import native; print(json.dumps(native.build_info()))"
    package_root = str(Path(attnorm.__file__).resolve().parent.parent)
    with tempfile.TemporaryDirectory() as cache:
        environment = {**os.environ, "ATTNORM_CACHE_DIR": cache,
                       "PYTHONPATH": os.pathsep.join(filter(None, (package_root, os.environ.get("PYTHONPATH"))))}
        runs = [subprocess.run([sys.executable, "-c", script], env=environment, capture_output=True, text=True,
                               check=True) for _ in range(2)]
    build, load = (json.loads(run.stdout.strip().splitlines()[-1]) for run in runs)
    return {"available": build["available"], "build_s": build.get("seconds"), "load_s": load.get("seconds"),
            "reason": build.get("reason")}


def baseline_cases(device: str) -> list[Case]:
    cases = [Case(*BASELINE, build=lambda: lambda x: torch.softmax(x, dim=-1))]
    try:
        import entmax
    except ImportError:
        entmax = None
    if entmax is not None:
        cases += [
            Case("sparsemax", "-", "entmax", lambda: lambda x: entmax.sparsemax(x, dim=-1)),
            Case("entmax(1.5)", "-", "entmax", lambda: lambda x: entmax.entmax15(x, dim=-1)),
            Case(
                f"entmax({GENERAL_ALPHA})", "-", "entmax", lambda: lambda x: entmax.entmax_bisect(x, GENERAL_ALPHA, -1)
            ),
        ]
    if device == "cuda":
        for normalizer, name in (("softmax", "LigerSoftmax"), ("sparsemax", "LigerSparsemax")):
            factory = _optional(f"liger_kernel.transformers.{normalizer}", name)
            if factory is not None:
                cases.append(Case(normalizer, "triton", "liger", factory))
        triton_entmax = _optional("adasplash", "triton_entmax")
        if triton_entmax is not None:
            for alpha in (1.5, GENERAL_ALPHA):
                build = lambda alpha=alpha: lambda x: triton_entmax(x, alpha=alpha)
                cases.append(Case(f"entmax({alpha})", "triton", "adasplash", build))
    return cases


def _optional(module: str, name: str):
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


def versions(device: str) -> str:
    found = {"python": platform.python_version(), "torch": torch.__version__, "attnorm": attnorm.__version__}
    for package in ("entmax", "triton", "liger_kernel", "adasplash"):
        try:
            found[package] = importlib.metadata.version(package.replace("_", "-"))
        except importlib.metadata.PackageNotFoundError:
            continue
    found["threads"] = str(torch.get_num_threads())
    if device == "cuda":
        found["gpu"] = torch.cuda.get_device_name()
    return ";".join(f"{name}={value}" for name, value in found.items())


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def one_run(fn: Callable, x: torch.Tensor, grad: torch.Tensor, mode: str, device: str) -> float:
    """Seconds for one call of ``mode``."""
    x.grad = None
    if mode == "backward":
        out = fn(x)
        synchronize(device)
        start = time.perf_counter()
        out.backward(grad)
    else:
        synchronize(device)
        start = time.perf_counter()
        out = fn(x)
        if mode == "forward+backward":
            out.backward(grad)
    synchronize(device)
    return time.perf_counter() - start


def peak_memory(fn: Callable, x: torch.Tensor, grad: torch.Tensor, mode: str, device: str) -> float:
    """Peak bytes allocated during one call of ``mode`` beyond those held before it."""
    x.grad = None
    if mode == "backward":
        out = fn(x)
        run = lambda: out.backward(grad)
    elif mode == "forward":
        run = lambda: fn(x)
    else:
        run = lambda: fn(x).backward(grad)
    if device == "cuda":
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        run()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - held
    with _quiet_stderr():
        return allocator_peak_bytes(run)


@contextlib.contextmanager
def _quiet_stderr():
    """Silence file descriptor 2 (the profiler's C++ start/stop lines) for the block."""
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def percentiles(samples: list[float]) -> tuple[float, float, float]:
    """(median, p20, p80)."""
    if len(samples) == 1:
        return samples[0], samples[0], samples[0]
    cuts = statistics.quantiles(samples, n=10, method="inclusive")
    return statistics.median(samples), cuts[1], cuts[7]


def device_bandwidth() -> float | None:
    properties = torch.cuda.get_device_properties(torch.cuda.current_device())
    clock_khz, bus_bits = getattr(properties, "memory_clock_rate", 0), getattr(properties, "memory_bus_width", 0)
    if clock_khz and bus_bits:
        return 2 * clock_khz * 1e3 * bus_bits / 8  # double data rate
    return next((value for name, value in KNOWN_BANDWIDTH.items() if name in properties.name), None)


def benchmark(cases: list[Case], shapes, dtype, device: str, repeats: int, budget: float, progress) -> list[dict]:
    """Interleaved timings and peak memory of every case, shape and mode."""
    bytes_moved = _optional("attnorm.kernels.traffic", "bytes_moved") if device == "cuda" else None
    rows_out = []
    for rows, length in shapes:
        generator = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(rows, length, device=device, dtype=dtype, generator=generator).requires_grad_(True)
        grad = torch.randn(rows, length, device=device, dtype=dtype, generator=generator)
        functions = {case.key: case.build() for case in cases}
        for mode in MODES:
            first = {key: one_run(fn, x, grad, mode, device) for key, fn in functions.items()}  # warm-up
            wanted = {key: max(3, min(repeats, int(budget / max(first[key], 1e-9)))) for key in functions}
            samples = {key: [] for key in functions}
            for round_index in range(repeats):
                for key, fn in functions.items():
                    if round_index < wanted[key]:
                        samples[key].append(one_run(fn, x, grad, mode, device))
            for case in cases:
                fn = functions[case.key]
                median, p20, p80 = percentiles(samples[case.key])
                common = dict(zip(COLUMNS[:3], case.key, strict=True), mode=mode, L=length, rows=rows,
                              dtype=str(dtype).removeprefix("torch."), device=device)
                rows_out.append({**common, "metric": "time", "unit": "ms",
                                 "median": median * 1e3, "p20": p20 * 1e3, "p80": p80 * 1e3})
                # Each round's time over torch.softmax's in the same round: load that
                # comes and goes on a shared machine cancels out of the ratio.
                ratios = [t / base for t, base in zip(samples[case.key], samples[BASELINE], strict=False)]
                rows_out.append({**common, "metric": "time_ratio_vs_softmax", "unit": "x",
                                 **dict(zip(("median", "p20", "p80"), percentiles(ratios), strict=True))})
                memory = peak_memory(fn, x, grad, mode, device) / 2**20
                rows_out.append({**common, "metric": "peak_memory", "unit": "MiB",
                                 "median": memory, "p20": memory, "p80": memory})
                if bytes_moved is not None and case.op is not None:
                    moved = bytes_moved(case.op, rows, length, x.dtype, mode) / 1e9
                    rows_out.append({**common, "metric": "bandwidth", "unit": "GB/s",
                                     "median": moved / median, "p20": moved / p80, "p80": moved / p20})
                progress.update(1)
    return rows_out


def ratio_table(results: list[dict], shapes) -> str:
    """Markdown: median over rounds of time / torch.softmax time, per shape and mode."""
    times = {(r["normalizer"], r["backend"], r["provider"], r["rows"], r["L"], r["mode"], r["metric"]): r["median"]
             for r in results if r["metric"] in ("time", "time_ratio_vs_softmax")}
    keys = list(dict.fromkeys((r["normalizer"], r["backend"], r["provider"]) for r in results if r["metric"] == "time"))
    short = {"forward": "fwd", "backward": "bwd", "forward+backward": "fwd+bwd"}
    header = ["normalizer", "backend", "provider"]
    header += [f"{rows}x{length} {short[mode]}" for rows, length in shapes for mode in MODES]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for key in keys:
        cells = []
        for rows, length in shapes:
            for mode in MODES:
                if key == BASELINE:
                    cells.append(f"{times[(*key, rows, length, mode, 'time')]:.1f} ms")
                else:
                    cells.append(f"{times[(*key, rows, length, mode, 'time_ratio_vs_softmax')]:.2f}x")
        lines.append("| " + " | ".join([*key, *cells]) + " |")
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(MODES), figsize=(6 * len(MODES), 5), sharey=True)
    ratios = [r for r in results if r["metric"] == "time_ratio_vs_softmax"]
    key_of = lambda row: (row["normalizer"], row["backend"], row["provider"])
    for axis, mode in zip(axes, MODES, strict=True):
        for key in dict.fromkeys(key_of(r) for r in ratios):
            points = sorted((r["L"], r["median"]) for r in ratios if r["mode"] == mode and key_of(r) == key)
            style = "-o" if key[2] == "attnorm" else "--s"
            axis.plot([p[0] for p in points], [p[1] for p in points], style, label=" / ".join(key), markersize=4)
        axis.set(xscale="log", yscale="log", title=mode, xlabel="L (rows x L fixed per shape)")
        axis.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("median time / torch.softmax")
    axes[-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def one_time_note(one_time: dict[str, object]) -> str:
    if not one_time["available"]:
        return f"Native kernels unavailable ({one_time['reason']}): attnorm ran its torch-only CPU path."
    return (f"One-time cost, not in the times above: building the native CPU kernels took "
            f"{one_time['build_s']:.2f} s (once per machine; then cached), loading the cached build "
            f"{1e3 * one_time['load_s']:.1f} ms (once per process).")


def parse_shape(text: str) -> tuple[int, int]:
    rows, _, length = text.lower().partition("x")
    return int(rows), int(length)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", type=parse_shape, help="rows x L, e.g. 2048x4096")
    parser.add_argument("--quick", action="store_true", help="small shapes and few repeats (under a minute on CPU)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16", "float64"))
    parser.add_argument("--repeats", type=int, default=15, help="timed repeats per case (slow cases get fewer)")
    parser.add_argument("--budget", type=float, default=6.0, help="seconds of timed repeats per slow case and mode")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--torch-only", action="store_true",
                        help="on CPU, also time attnorm with its native kernels off (backend 'torch-only')")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = args.shapes or (QUICK_SHAPES if args.quick else FULL_SHAPES)
    repeats, budget = (3, 0.5) if args.quick else (args.repeats, args.budget)
    dtype = getattr(torch, args.dtype)
    backends = ["torch", "triton"] if args.device == "cuda" else ["torch"]
    cases = baseline_cases(args.device) + [case for backend in backends for case in attnorm_cases(backend)]
    if args.torch_only and args.device == "cpu":
        cases += attnorm_cases("torch", torch_only=True)
    stamp = versions(args.device)
    one_time = native_one_time_cost() if args.device == "cpu" else None
    print(f"shapes (rows x L): {', '.join(f'{r}x{n}' for r, n in shapes)}; dtype {args.dtype}; device {args.device}")
    print(f"versions: {stamp}; attnorm from {Path(attnorm.__file__).parent}")
    print(f"top-k k = {TOPK}; general alpha = {GENERAL_ALPHA}; repeats <= {repeats} (>= 3), interleaved")
    if one_time is not None:
        print(one_time_note(one_time))
    with tqdm(total=len(cases) * len(shapes) * len(MODES), desc="bench", unit="case") as progress:
        results = benchmark(cases, shapes, dtype, args.device, repeats, budget, progress)
    if one_time is not None and one_time["available"]:
        for metric in ("build_s", "load_s"):
            seconds = one_time[metric]
            results.append({"normalizer": "native kernels", "backend": "torch", "provider": "attnorm",
                            "mode": "one-time", "metric": metric.removesuffix("_s"), "unit": "s", "L": "-",
                            "rows": "-", "dtype": "-", "device": "cpu", "median": seconds, "p20": seconds,
                            "p80": seconds})
    for row in results:
        row["versions"] = stamp
    if args.device == "cuda" and (bandwidth := device_bandwidth()):
        print(f"device peak bandwidth: {bandwidth / 1e9:.0f} GB/s")
        for row in results:
            if row["metric"] == "bandwidth" and row["mode"] == "forward+backward":
                print(f"  {row['normalizer']:>14} {row['backend']:>6} {row['rows']}x{row['L']}: "
                      f"{row['median']:.0f} GB/s ({100 * row['median'] * 1e9 / bandwidth:.0f}% of peak)")
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / "bench_normalizers"
    with open(stem.with_suffix(".csv"), "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows({key: round(v, 4) if isinstance(v, float) else v for key, v in row.items()} for row in results)
    table = ratio_table(results, shapes)
    note = (f"Time / `torch.softmax` time, median over interleaved rounds (each ratio taken within one round); "
            f"the softmax row holds its own median time.  dtype {args.dtype}, device {args.device}.  "
            f"Versions: {stamp.replace(';', ', ')}.")
    if one_time is not None:
        note += "  " + one_time_note(one_time)
    stem.with_suffix(".md").write_text(f"{table}\n\n{note}\n")
    print(table)
    plot(results, stem.with_suffix(".png"))
    print(f"wrote {stem}.csv, .md, .png")
    if not math.isfinite(sum(r["median"] for r in results)):
        raise SystemExit("some measurements are not finite")


if __name__ == "__main__":
    main()
