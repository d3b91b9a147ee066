"""Time and peak memory of every attnorm normalizer against torch.softmax, the entmax package and others.

For each normalizer and attnorm backend (``native`` on CPU, where ``--backends native
reference`` adds attnorm's pure-torch oracle; ``reference`` and ``triton`` on CUDA),
each shape ``rows x L`` and each dtype: forward, backward and forward+backward time
(median, p20 and p80) and peak memory.
Baselines run in the same process: ``torch.softmax`` (the reference for every
ratio), the ``entmax`` package (``sparsemax``, ``entmax15``, ``entmax_bisect``), and on
CUDA Liger-Kernel's softmax and sparsemax and AdaSplash's ``triton_entmax`` when
installed.  Each provider is isolated: an exception while building, compiling or
running one (say a Triton kernel that fails to compile for bf16) becomes an ``error``
row in the CSV and an ``error`` cell in the table, and the run goes on.  (A CUDA
fault that poisons the context still ends the run: rerun without that provider.)

Scores are ``torch.randn(rows, L)`` (unit-variance logits, as attention scores at
initialisation), normalised over ``L``; backward uses a fixed random upstream gradient.

* forward: ``y = f(x)`` with ``x.requires_grad`` (a training forward, saving for backward);
* backward: ``y.backward(g)`` alone, after an untimed forward;
* forward+backward: both.

How time is measured:

* CPU: interleaved rounds, one call of each case in turn, so a busy machine slows
  all of them alike; slow cases get fewer rounds (at least 3).  The ratio against
  ``torch.softmax`` is the median over rounds of each round's ratio, so load that
  comes and goes on a shared machine cancels out.
* CUDA: ``triton.testing.do_bench`` per case (warm-up, then CUDA events around each
  call, the L2 cache flushed before each); the backward is timed by re-running
  ``y.backward(g, retain_graph=True)`` on one forward's graph.  The ratio is of the
  medians, both taken in this run.  Achieved bandwidth is reported too: the minimum
  bytes the operation must move (:func:`traffic.bytes_moved`, an effective bandwidth
  as in Triton's fused-softmax tutorial) over the time, against the device's peak.

Peak memory is the most memory allocated during the call beyond what was held
before it (inputs, and for backward the saved tensors, do not count): on CUDA
``torch.cuda.max_memory_allocated``; on the CPU the peak of the running sum of bytes
torch's CPU allocator allocated minus freed, as ``torch.profiler`` records them
(:mod:`profiler_memory`).

On the CPU, attnorm's ``native`` backend runs C kernels built once per machine;
their one-time build and load times are measured in fresh processes and reported
apart from the steady-state times (CSV rows with mode ``one-time``).

Usage::

    python benchmarks/bench_normalizers.py              # 16384x512, 2048x4096, 256x32768
    python benchmarks/bench_normalizers.py --quick      # under a minute on a 2-core CPU
    python benchmarks/bench_normalizers.py --backends native reference     # also attnorm's reference (slow)
    python benchmarks/bench_normalizers.py --device cuda                    # float32 and bfloat16
    python benchmarks/bench_normalizers.py --device cuda --graphs           # the kernels alone (CUDA graphs)
    python benchmarks/bench_normalizers.py --shapes 4096x1024 --dtype bfloat16 --backends triton

Writes ``bench_normalizers.csv``, ``.md`` (ratios vs torch.softmax, also printed) and
``.png`` into ``--out`` (default ``benchmarks/results/``).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from profiler_memory import peak_bytes
from reporting import error_text, markdown_table, percentiles, versions, write_csv
from tqdm import tqdm
from traffic import MODES, bytes_moved

import attnorm

COLUMNS = (
    "normalizer", "backend", "provider", "mode", "metric", "unit", "L", "rows", "dtype", "device",
    "median", "p20", "p80", "error", "versions",
)
FULL_SHAPES = ((16384, 512), (2048, 4096), (256, 32768))
QUICK_SHAPES = ((2048, 256), (128, 4096))
BACKENDS = {"cpu": ("native",), "cuda": ("reference", "triton")}
DTYPES = {"cpu": ("float32",), "cuda": ("float32", "bfloat16")}
TOPK = 32
GENERAL_ALPHA = 1.3
BASELINE = ("softmax", "-", "torch")
SHORT_MODE = {"forward": "fwd", "backward": "bwd", "forward+backward": "fwd+bwd"}
# Peak bandwidth (bytes/s) of devices whose properties do not report it.
KNOWN_BANDWIDTH = {"H100": 3.35e12, "H200": 4.8e12, "A100": 2.0e12}


@dataclass(frozen=True)
class Case:
    """One implementation to time: a normalizer from one provider, on one backend."""

    normalizer: str
    backend: str
    provider: str
    build: Callable[[], Callable[[torch.Tensor], torch.Tensor]]
    op: str  # the row operation, for the bytes it must move (traffic.bytes_moved)

    @property
    def key(self) -> tuple[str, str, str]:
        return self.normalizer, self.backend, self.provider


def attnorm_cases(backend: str) -> list[Case]:
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
    return [Case(name, backend, "attnorm", build, op) for name, (build, op) in modules.items()]


def baseline_cases(device: str) -> list[Case]:
    """torch.softmax, and every other provider that is installed (imported when its case is built)."""
    cases = [Case(*BASELINE, build=lambda: lambda x: torch.softmax(x, dim=-1), op="softmax")]
    if _installed("entmax"):
        entmax = lambda: importlib.import_module("entmax")
        cases += [
            Case("sparsemax", "-", "entmax", lambda: entmax().sparsemax, "sparsemax"),
            Case("entmax(1.5)", "-", "entmax", lambda: entmax().entmax15, "entmax"),
            Case(f"entmax({GENERAL_ALPHA})", "-", "entmax",
                 lambda: lambda x: entmax().entmax_bisect(x, GENERAL_ALPHA, -1), "entmax"),
        ]
    if device == "cuda" and _installed("liger_kernel"):
        for normalizer, name in (("softmax", "LigerSoftmax"), ("sparsemax", "LigerSparsemax")):
            module = f"liger_kernel.transformers.{normalizer}"
            build = lambda module=module, name=name: getattr(importlib.import_module(module), name)()
            cases.append(Case(normalizer, "triton", "liger", build, normalizer))
    if device == "cuda" and _installed("adasplash"):
        for alpha in (1.5, GENERAL_ALPHA):
            build = lambda alpha=alpha: lambda x: importlib.import_module("adasplash").triton_entmax(x, alpha=alpha)
            cases.append(Case(f"entmax({alpha})", "triton", "adasplash", build, "entmax"))
    return cases


def _installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


NATIVE_BUILD_INFO = """
import json
try:
    from attnorm.kernels.cpu.build import build_info
except ImportError:
    from attnorm.kernels.cpu.native import build_info
print(json.dumps(build_info()))
"""


def native_one_time_cost() -> dict[str, object]:
    """The native kernels' one-time cost, in fresh processes with an empty cache:
    ``build_info()`` of the first (which compiles) and of the second (which loads)."""
    package_root = str(Path(attnorm.__file__).resolve().parent.parent)
    try:
        with tempfile.TemporaryDirectory() as cache:
            environment = {**os.environ, "ATTNORM_CACHE_DIR": cache,
                           "PYTHONPATH": os.pathsep.join(filter(None, (package_root, os.environ.get("PYTHONPATH"))))}
            runs = [subprocess.run([sys.executable, "-c", NATIVE_BUILD_INFO], env=environment, capture_output=True,
                                   text=True, check=True) for _ in range(2)]
        build, load = (json.loads(run.stdout.strip().splitlines()[-1]) for run in runs)
    except subprocess.CalledProcessError as error:
        return {"available": False, "reason": (error.stderr.strip().splitlines() or ["no output"])[-1]}
    except (ValueError, IndexError) as error:
        return {"available": False, "reason": error_text(error)}
    return {"available": build.get("available", False), "build_s": build.get("seconds"),
            "load_s": load.get("seconds"), "reason": build.get("reason")}


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def one_run(fn: Callable, x: torch.Tensor, grad: torch.Tensor, mode: str, device: str) -> float:
    """Seconds for one call of ``mode`` (the CPU method)."""
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


def interleaved_samples(functions: dict, x, grad, mode: str, device: str, repeats: int, budget: float,
                        errors: dict) -> dict[tuple, list[float]]:
    """Seconds per round for each case, one call of each in turn; failing cases move to ``errors``."""
    first = {}
    for key, fn in functions.items():
        try:
            first[key] = one_run(fn, x, grad, mode, device)  # warm-up
        except Exception as error:  # one provider failing must not end the run
            errors[key] = error_text(error)
    wanted = {key: max(3, min(repeats, int(budget / max(seconds, 1e-9)))) for key, seconds in first.items()}
    samples = {key: [] for key in first}
    for round_index in range(repeats):
        for key in list(samples):
            if round_index < wanted[key]:
                try:
                    samples[key].append(one_run(functions[key], x, grad, mode, device))
                except Exception as error:
                    errors[key] = error_text(error)
                    del samples[key]
    return samples


CUDA_GRAPHS = False
"""``--graphs``: time CUDA-graph replays (``triton.testing.do_bench_cudagraph``) instead of eager calls."""


def cuda_quantiles(functions: dict, x, grad, mode: str, errors: dict) -> dict[tuple, tuple[float, float, float]]:
    """(median, p20, p80) seconds of each case from ``triton.testing.do_bench`` (L2 flushed per call), or with
    :data:`CUDA_GRAPHS` from ``do_bench_cudagraph`` (the calls captured once and replayed: the GPU's time alone,
    no host time and no L2 flush, for every provider alike)."""
    from triton.testing import do_bench, do_bench_cudagraph

    if CUDA_GRAPHS:
        do_bench = do_bench_cudagraph  # noqa: F811 (same signature for what is passed here)

    found = {}
    for key, fn in functions.items():
        x.grad = None
        try:
            if mode == "backward":
                out = fn(x)
                call = lambda out=out: out.backward(grad, retain_graph=True)
            elif mode == "forward":
                call = lambda fn=fn: fn(x)
            else:
                call = lambda fn=fn: fn(x).backward(grad)
            milliseconds = do_bench(call, grad_to_none=[x], quantiles=[0.5, 0.2, 0.8])
            found[key] = tuple(value / 1e3 for value in milliseconds)
        except Exception as error:  # one provider failing must not end the run
            errors[key] = error_text(error)
    return found


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
    return peak_bytes(run, device)


def device_bandwidth() -> float | None:
    properties = torch.cuda.get_device_properties(torch.cuda.current_device())
    clock_khz, bus_bits = getattr(properties, "memory_clock_rate", 0), getattr(properties, "memory_bus_width", 0)
    if clock_khz and bus_bits:
        return 2 * clock_khz * 1e3 * bus_bits / 8  # double data rate
    return next((value for name, value in KNOWN_BANDWIDTH.items() if name in properties.name), None)


def benchmark(cases: list[Case], shapes, dtype, device: str, repeats: int, budget: float, progress) -> list[dict]:
    """Time, ratio to torch.softmax, peak memory (and on CUDA GB/s) of every case, shape and mode."""
    results = []
    for rows, length in shapes:
        generator = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(rows, length, device=device, dtype=dtype, generator=generator).requires_grad_(True)
        grad = torch.randn(rows, length, device=device, dtype=dtype, generator=generator)
        functions, build_errors = {}, {}
        for case in cases:
            try:
                functions[case.key] = case.build()
            except Exception as error:  # one provider failing must not end the run
                build_errors[case.key] = error_text(error)
        for mode in MODES:
            errors = dict(build_errors)
            if device == "cuda":
                times = cuda_quantiles(functions, x, grad, mode, errors)
                base = times.get(BASELINE, (math.nan,))[0]
                ratios = {key: tuple(value / base for value in quantiles) for key, quantiles in times.items()}
            else:
                samples = interleaved_samples(functions, x, grad, mode, device, repeats, budget, errors)
                times = {key: percentiles(values) for key, values in samples.items()}
                # Each round's time over torch.softmax's in the same round.
                ratios = {key: percentiles([t / b for t, b in zip(values, samples[BASELINE], strict=False)])
                          for key, values in samples.items() if BASELINE in samples}
            for case in cases:
                common = dict(zip(COLUMNS[:3], case.key, strict=True), mode=mode, L=length, rows=rows,
                              dtype=str(dtype).removeprefix("torch."), device=device)
                results += case_rows(case, functions, times, ratios, errors, x, grad, common)
                progress.update(1)
    return results


def case_rows(case: Case, functions: dict, times: dict, ratios: dict, errors: dict, x, grad, common: dict):
    """The CSV rows of one case in one shape and mode: its measurements, or one error row."""
    if case.key in errors:
        return [{**common, "metric": "error", "unit": "-", "error": errors[case.key]}]
    median, p20, p80 = times[case.key]
    out = [{**common, "metric": "time", "unit": "ms", "median": median * 1e3, "p20": p20 * 1e3, "p80": p80 * 1e3}]
    if case.key in ratios:
        out.append({**common, "metric": "time_ratio_vs_softmax", "unit": "x",
                    **dict(zip(("median", "p20", "p80"), ratios[case.key], strict=True))})
    try:
        memory = peak_memory(functions[case.key], x, grad, common["mode"], common["device"]) / 2**20
        out.append({**common, "metric": "peak_memory", "unit": "MiB", "median": memory, "p20": memory,
                    "p80": memory})
    except Exception as error:  # timed fine, failed under the memory probe: keep the times
        out.append({**common, "metric": "error", "unit": "-", "error": f"peak memory: {error_text(error)}"})
    if common["device"] == "cuda":
        moved = bytes_moved(case.op, common["rows"], common["L"], x.dtype, common["mode"]) / 1e9
        out.append({**common, "metric": "bandwidth", "unit": "GB/s", "median": moved / median, "p20": moved / p80,
                    "p80": moved / p20})
    return out


def _indexed(results: list[dict]) -> dict[tuple, dict]:
    return {(r["normalizer"], r["backend"], r["provider"], r["dtype"], r["rows"], r["L"], r["mode"], r["metric"]): r
            for r in results}


def ratio_table(results: list[dict], shapes, dtype: str) -> str:
    """Markdown: median time / torch.softmax time, per shape and mode; the softmax row in ms."""
    found = _indexed(results)
    keys = dict.fromkeys((r["normalizer"], r["backend"], r["provider"]) for r in results if r["dtype"] == dtype)
    header = ["normalizer", "backend", "provider"]
    header += [f"{rows}x{length} {SHORT_MODE[mode]}" for rows, length in shapes for mode in MODES]

    def cell(key, rows, length, mode) -> str:
        where = (*key, dtype, rows, length, mode)
        if (*where, "error") in found and (*where, "time") not in found:
            return "error"
        if key == BASELINE:
            return f"{found[(*where, 'time')]['median']:.2f} ms"
        ratio = found.get((*where, "time_ratio_vs_softmax"))
        return f"{ratio['median']:.2f}x" if ratio else "-"

    return markdown_table(header, [[*key, *(cell(key, rows, length, mode) for rows, length in shapes
                                            for mode in MODES)] for key in keys])


def bandwidth_table(results: list[dict], shapes, dtype: str, peak: float | None) -> str:
    """Markdown: achieved GB/s of forward+backward (and % of the device's peak), per shape."""
    found = _indexed(results)
    keys = dict.fromkeys((r["normalizer"], r["backend"], r["provider"]) for r in results if r["dtype"] == dtype)
    header = ["normalizer", "backend", "provider", *(f"{rows}x{length} fwd+bwd GB/s" for rows, length in shapes)]

    def cell(key, rows, length) -> str:
        row = found.get((*key, dtype, rows, length, "forward+backward", "bandwidth"))
        if row is None:
            return "error"
        return f"{row['median']:.0f}" + (f" ({100 * row['median'] * 1e9 / peak:.0f}%)" if peak else "")

    return markdown_table(header, [[*key, *(cell(key, rows, length) for rows, length in shapes)] for key in keys])


def error_lines(results: list[dict], shapes) -> list[str]:
    """One line per provider, dtype and error message, naming where it happened."""
    where: dict[tuple, list[str]] = {}
    for r in results:
        if r["metric"] == "error":
            key = (r["normalizer"], r["backend"], r["provider"], r["dtype"], r["error"])
            where.setdefault(key, []).append(f"{r['rows']}x{r['L']} {SHORT_MODE[r['mode']]}")
    return [f"{' / '.join(key[:3])} ({key[3]}, "
            f"{'every shape and mode' if len(places) == len(shapes) * len(MODES) else ', '.join(places)}): {key[4]}"
            for key, places in where.items()]


def plot(results: list[dict], dtypes: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(len(dtypes), len(MODES), figsize=(6 * len(MODES), 5 * len(dtypes)), sharey=True,
                                squeeze=False)
    key_of = lambda row: (row["normalizer"], row["backend"], row["provider"])
    for axes_row, dtype in zip(axes, dtypes, strict=True):
        ratios = [r for r in results if r["metric"] == "time_ratio_vs_softmax" and r["dtype"] == dtype]
        for axis, mode in zip(axes_row, MODES, strict=True):
            for key in dict.fromkeys(key_of(r) for r in ratios):
                points = sorted((r["L"], r["median"]) for r in ratios if r["mode"] == mode and key_of(r) == key)
                style = "-o" if key[2] == "attnorm" else "--s"
                axis.plot([p[0] for p in points], [p[1] for p in points], style, label=" / ".join(key), markersize=4)
            axis.set(xscale="log", yscale="log", title=f"{mode}, {dtype}", xlabel="L (rows x L fixed per shape)")
            axis.grid(True, which="both", alpha=0.3)
        axes_row[0].set_ylabel("median time / torch.softmax")
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def one_time_note(one_time: dict[str, object]) -> str:
    if not one_time["available"]:
        return f"Native kernels unavailable ({one_time['reason']})."
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
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", nargs="+", choices=("float32", "float16", "bfloat16", "float64"),
                        help="default: float32 on CPU, float32 and bfloat16 on CUDA")
    parser.add_argument("--backends", nargs="+", help="attnorm backends (default: native on CPU, "
                                                      "reference triton on CUDA)")
    parser.add_argument("--repeats", type=int, default=15, help="CPU: timed rounds per case (slow cases get fewer)")
    parser.add_argument("--budget", type=float, default=6.0, help="CPU: seconds of timed rounds per slow case and mode")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument("--graphs", action="store_true",
                        help="CUDA: time each call captured in a CUDA graph and replayed (the kernels alone, no host "
                             "time), written as bench_normalizers_graphs.*")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args()
    if args.graphs and args.device != "cuda":
        parser.error("--graphs needs --device cuda (CUDA graphs)")
    global CUDA_GRAPHS
    CUDA_GRAPHS = args.graphs
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = args.shapes or (QUICK_SHAPES if args.quick else FULL_SHAPES)
    repeats, budget = (3, 0.5) if args.quick else (args.repeats, args.budget)
    dtypes = args.dtype or list(DTYPES[args.device])
    backends = args.backends or BACKENDS[args.device]
    cases = baseline_cases(args.device) + [case for backend in backends for case in attnorm_cases(backend)]
    stamp = versions(args.device)
    one_time = native_one_time_cost() if args.device == "cpu" and "native" in backends else None
    method = ("triton.testing.do_bench (L2 flushed per call); ratio of medians" if args.device == "cuda" else
              f"<= {repeats} interleaved rounds (>= 3); ratio = median of within-round ratios")
    if args.graphs:
        method = ("triton.testing.do_bench_cudagraph (calls captured in a CUDA graph and replayed: the GPU's time "
                  "alone, no host time, no L2 flush); ratio of medians")
    print(f"shapes (rows x L): {', '.join(f'{r}x{n}' for r, n in shapes)}; dtypes {', '.join(dtypes)}; "
          f"device {args.device}; attnorm backends {', '.join(backends)}")
    print(f"versions: {stamp}; attnorm from {Path(attnorm.__file__).parent}")
    print(f"top-k k = {TOPK}; general alpha = {GENERAL_ALPHA}; timing: {method}")
    if one_time is not None:
        print(one_time_note(one_time))
    results = []
    with tqdm(total=len(cases) * len(shapes) * len(MODES) * len(dtypes), desc="bench", unit="case") as progress:
        for dtype in dtypes:
            results += benchmark(cases, shapes, getattr(torch, dtype), args.device, repeats, budget, progress)
    if one_time is not None and one_time["available"]:
        for metric in ("build_s", "load_s"):
            seconds = one_time[metric]
            results.append({"normalizer": "native kernels", "backend": "native", "provider": "attnorm",
                            "mode": "one-time", "metric": metric.removesuffix("_s"), "unit": "s", "L": "-",
                            "rows": "-", "dtype": "-", "device": "cpu", "median": seconds, "p20": seconds,
                            "p80": seconds})
    for row in results:
        row["versions"] = stamp
    stem = args.out / ("bench_normalizers_graphs" if args.graphs else "bench_normalizers")
    write_csv(stem.with_suffix(".csv"), results, COLUMNS)

    sections = []
    peak = device_bandwidth() if args.device == "cuda" else None
    for dtype in dtypes:
        table = ratio_table(results, shapes, dtype)
        sections.append(f"### {dtype}, {args.device}: time / torch.softmax time\n\n{table}")
        if args.device == "cuda":
            peak_text = f"peak {peak / 1e9:.0f} GB/s" if peak else "peak unknown"
            sections.append(f"### {dtype}, {args.device}: achieved bandwidth ({peak_text})\n\n"
                            f"{bandwidth_table(results, shapes, dtype, peak)}")
    note = (f"Timing: {method}; the softmax row holds its own median time.  "
            f"Versions: {stamp.replace(';', ', ')}.")
    if one_time is not None:
        note += "  " + one_time_note(one_time)
    errors = error_lines(results, shapes)
    if errors:
        note += "\n\nErrors (the run went on without these):\n\n" + "\n".join(f"- {line}" for line in errors)
    report = "\n\n".join(sections) + f"\n\n{note}\n"
    stem.with_suffix(".md").write_text(report)
    print(report)
    plot(results, dtypes, stem.with_suffix(".png"))
    print(f"wrote {stem}.csv, .md, .png")
    if not math.isfinite(sum(r["median"] for r in results if r["metric"] == "time")):
        raise SystemExit("some measurements are not finite")


if __name__ == "__main__":
    main()
