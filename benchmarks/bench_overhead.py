"""Per-call overhead of every attnorm normalizer module on a tiny tensor, against a bare custom op.

On a 4x16 tensor the arithmetic is nothing, so the time of one eager forward call is
the Python and dispatcher overhead the module adds: argument checks, backend choice,
the ``torch.library`` op and its autograd node.  The yardstick is ``bench::bare``, a
``torch.library.custom_op`` defined here that returns ``torch.softmax(x, -1)`` and has a
fake kernel and an autograd formula: what any custom op costs.  A module whose parameters
are tensors that require grad is measured against ``bench::bare_scaled`` instead: the same
kind of bare op taking the same tensors (scores, ``s``, ``bias``) and computing the same
formula, ``softmax((s log n + bias) x)``, with gradients for all three (the issue's "bare
op with the same inputs": each tensor that requires grad costs the op's autograd wrapper
some microseconds).  ``torch.softmax`` itself is shown too.  The goal the project
tracks: every module within 1.5x its bare op.

Each module runs its forward only, once on an input that does not require grad and
once on one that does (the call then records an autograd node).  The per-head
Scalable-Softmax (learnable, ``num_heads`` = rows) sees the same 4x16 values laid out
as ``(heads, 1, keys)``.  Timings are interleaved: every round times one block of
calls of each implementation in a shuffled order, so a busy machine slows all alike;
a sample is the mean call time of one block, the reported time is the median sample
(p20-p80 beside it), and the ratio to the bare op is the median over rounds of the
ratio within a round.  On CUDA the device is synchronised before and after each timed
block.  ``--clock cpu`` (CPU only) times with the thread's CPU clock instead of the
wall clock: on a machine shared with other work a block that is descheduled for a time
slice (4 ms) would otherwise swamp a 15 µs call.  The first call (which may build or
compile kernels) is not timed with the rest; its time is reported apart.  The module rows
take attnorm's default launch (:mod:`attnorm.kernels.fast_launch`: Triton's per-call binding
skipped once a kernel variant is compiled, on CUDA).  ``--triton-launch`` adds a row per
module, ``<module> [Triton launch]``, timed with that switch off for its calls (Triton's own
launch every time; CUDA only, elsewhere the same as the plain row).

Usage::

    python benchmarks/bench_overhead.py                      # CPU, under a minute
    python benchmarks/bench_overhead.py --device cuda
    python benchmarks/bench_overhead.py --backend reference  # a named attnorm backend
    python benchmarks/bench_overhead.py --check              # exit 1 when a module misses the goal
    python benchmarks/bench_overhead.py --clock cpu          # a busy machine: time on-CPU only
    python benchmarks/bench_overhead.py --device cuda --triton-launch   # also each module with Triton's launch

Writes ``bench_overhead_<device>.csv`` and ``.md`` into ``--out`` (default ``benchmarks/results/``).
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from reporting import error_text, markdown_table, percentiles, versions, write_csv

import attnorm

ROWS, LENGTH = 4, 16
GOAL = 1.5  # each module's per-call time / the bare custom op's
BARE = "bench::bare"
BARE_SCALED = "bench::bare_scaled"
SCALED = (f"ScalableSoftmax(learnable, num_heads={ROWS})",)  # measured against BARE_SCALED
INPUTS = ("no grad", "requires grad")
COLUMNS = ("normalizer", "input", "device", "dtype", "shape", "backend", "median_us", "p20_us", "p80_us",
           "ratio_vs_bare", "goal", "meets_goal", "first_call_ms", "samples", "calls_per_sample", "clock", "error",
           "versions")
CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}


@torch.library.custom_op(BARE, mutates_args=())
def bare(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x, -1)


@bare.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _save_output(ctx, inputs: tuple, output: torch.Tensor) -> None:
    ctx.save_for_backward(output)


def _softmax_backward(ctx, grad: torch.Tensor) -> torch.Tensor:
    (weights,) = ctx.saved_tensors
    return weights * (grad - (grad * weights).sum(-1, keepdim=True))


bare.register_autograd(_softmax_backward, setup_context=_save_output)


@torch.library.custom_op(BARE_SCALED, mutates_args=())
def bare_scaled(x: torch.Tensor, s: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return torch.softmax((s * math.log(x.shape[-1]) + bias) * x, -1)


@bare_scaled.register_fake
def _(x: torch.Tensor, s: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _save_scaled(ctx, inputs: tuple, output: torch.Tensor) -> None:
    x, s, bias = inputs
    ctx.save_for_backward(output, x, s, bias)


def _scaled_backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    weights, x, s, bias = ctx.saved_tensors
    log_n = math.log(x.shape[-1])
    d_logits = weights * (grad - (grad * weights).sum(-1, keepdim=True))
    d_multiplier = (d_logits * x).sum(-1, keepdim=True)
    d_bias = d_multiplier.sum_to_size(bias.shape)
    return d_logits * (s * log_n + bias), d_bias * log_n, d_bias


bare_scaled.register_autograd(_scaled_backward, setup_context=_save_scaled)


def modules(backend: str | None) -> dict[str, tuple[Callable[[], torch.nn.Module], tuple[int, ...]]]:
    """name -> (module factory, the shape it sees the 4x16 scores in).

    Modules whose names are in :data:`SCALED` are measured against ``bench::bare_scaled``.
    """
    flat, per_head = (ROWS, LENGTH), (ROWS, 1, LENGTH)
    return {
        "Softmax": (lambda: attnorm.Softmax(backend=backend), flat),
        "Softmax(temperature=0.5)": (lambda: attnorm.Softmax(temperature=0.5, backend=backend), flat),
        "ScalableSoftmax": (lambda: attnorm.ScalableSoftmax(backend=backend), flat),
        f"ScalableSoftmax(learnable, num_heads={ROWS})": (
            lambda: attnorm.ScalableSoftmax(learnable=True, num_heads=ROWS, backend=backend), per_head),
        "SelfAdjustedSoftmax": (lambda: attnorm.SelfAdjustedSoftmax(backend=backend), flat),
        "Sparsemax": (lambda: attnorm.Sparsemax(backend=backend), flat),
        "Entmax(1.5)": (lambda: attnorm.Entmax(1.5, backend=backend), flat),
        "Entmax(1.3)": (lambda: attnorm.Entmax(1.3, backend=backend), flat),
        "TopKSoftmax(k=4)": (lambda: attnorm.TopKSoftmax(k=4, backend=backend), flat),
    }


TRITON_LAUNCH = " [Triton launch]"
"""Suffix of the rows timed with attnorm.kernels.fast_launch off (``--triton-launch``)."""


def with_triton_launch(call: Callable[[], object]) -> Callable[[], object]:
    """``call`` with :mod:`attnorm.kernels.fast_launch` switched off while it runs (then as it was)."""
    from attnorm.kernels import fast_launch

    def triton_launch() -> object:
        previous = fast_launch.enabled()
        fast_launch.set_enabled(False)
        try:
            return call()
        finally:
            fast_launch.set_enabled(previous)

    return triton_launch


def calls(backend: str | None, device: str, dtype: torch.dtype, triton_launch: bool = False) -> tuple[dict, dict]:
    """(key -> zero-argument call, key -> error) for every (implementation, input) pair."""
    values = torch.randn(ROWS, LENGTH, generator=torch.Generator().manual_seed(0)).to(device, dtype)
    found, errors = {}, {}
    for requires_grad, input_name in zip((False, True), INPUTS, strict=True):
        x = values.clone().requires_grad_(requires_grad)
        found[(BARE, input_name)] = lambda x=x: bare(x)
        found[("torch.softmax", input_name)] = lambda x=x: torch.softmax(x, -1)
        for name, (factory, shape) in modules(backend).items():
            try:
                module, scores = factory().to(device), x.view(shape)
                found[(name, input_name)] = lambda module=module, scores=scores: module(scores)
                if triton_launch:
                    found[(name + TRITON_LAUNCH, input_name)] = with_triton_launch(found[(name, input_name)])
                if name in SCALED:
                    found[(BARE_SCALED, input_name)] = (
                        lambda module=module, scores=scores: bare_scaled(scores, module.s, module.bias))
            except Exception as error:  # a module that cannot be built is a row, not the end of the run
                errors[(name, input_name)] = error_text(error)
    return found, errors


def first_calls(functions: dict, errors: dict, device: str) -> dict:
    """Seconds of each call's first run (kernel builds, compiles); failing calls move to ``errors``."""
    seconds = {}
    for key, fn in list(functions.items()):
        start = time.perf_counter()
        try:
            fn()
            synchronize(device)
        except Exception as error:  # keep the other implementations running
            errors[key] = error_text(error)
            del functions[key]
            continue
        seconds[key] = time.perf_counter() - start
    return seconds


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def block_seconds(fn: Callable, count: int, device: str, clock: Callable[[], float]) -> float:
    """Mean seconds per call over ``count`` back-to-back calls."""
    synchronize(device)
    start = clock()
    for _ in range(count):
        fn()
    synchronize(device)
    return (clock() - start) / count


def measure(functions: dict, device: str, rounds: int, calls_per_sample: int,
            clock: Callable[[], float]) -> dict[tuple, list[float]]:
    """Interleaved samples: per round, one block of each call, in a shuffled order."""
    for fn in functions.values():
        block_seconds(fn, calls_per_sample, device, clock)  # warm-up
    samples = {key: [] for key in functions}
    order = list(functions)
    shuffle = random.Random(0).shuffle
    for _ in range(rounds):
        shuffle(order)
        for key in order:
            samples[key].append(block_seconds(functions[key], calls_per_sample, device, clock))
    return samples


def result_rows(samples: dict, first: dict, errors: dict, names: list[str], common: dict) -> list[dict]:
    rows = []
    for name in names:
        for input_name in INPUTS:
            key = (name, input_name)
            row = {"normalizer": name, "input": input_name, **common}
            if key in errors:
                rows.append({**row, "error": errors[key]})
                continue
            median, p20, p80 = percentiles(samples[key])
            base_samples = samples[(BARE_SCALED if name.removesuffix(TRITON_LAUNCH) in SCALED else BARE, input_name)]
            ratio = statistics.median(t / base for t, base in zip(samples[key], base_samples, strict=True))
            rows.append({**row, "median_us": median * 1e6, "p20_us": p20 * 1e6, "p80_us": p80 * 1e6,
                         "ratio_vs_bare": ratio, "first_call_ms": first[key] * 1e3, "samples": len(samples[key])})
    for row in rows:
        if row["normalizer"] not in (BARE, BARE_SCALED, "torch.softmax"):
            row["goal"] = f"<= {GOAL}x"
            row["meets_goal"] = "error" if "error" in row else "yes" if row["ratio_vs_bare"] <= GOAL else "no"
    return rows


def table(rows: list[dict]) -> str:
    """Markdown: µs per call and ratio to the bare op, per input, with the goal's verdict."""
    by_key = {(row["normalizer"], row["input"]): row for row in rows}
    header = ["normalizer"]
    for input_name in INPUTS:
        header += [f"{input_name}: µs/call", f"{input_name}: x bare"]
    header.append(f"goal <= {GOAL}x")

    def cells(name: str) -> list[str]:
        out = [name]
        for input_name in INPUTS:
            row = by_key[(name, input_name)]
            if "error" in row:
                out += ["error", "-"]
            else:
                out += [f"{row['median_us']:.1f} ({row['p20_us']:.1f}-{row['p80_us']:.1f})",
                        f"{row['ratio_vs_bare']:.2f}x"]
        verdicts = {by_key[(name, input_name)].get("meets_goal", "") for input_name in INPUTS}
        out.append("" if verdicts == {""} else "pass" if verdicts == {"yes"} else
                   "error" if "error" in verdicts else "FAIL")
        return out

    return markdown_table(header, [cells(name) for name in dict.fromkeys(row["normalizer"] for row in rows)])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16", "float64"))
    parser.add_argument("--backend", help="attnorm backend for every module (default: the modules' default)")
    parser.add_argument("--rounds", type=int, default=60, help="interleaved rounds (samples per implementation)")
    parser.add_argument("--calls", type=int, default=100, help="calls per timed block (one sample)")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument("--clock", default="wall", choices=tuple(CLOCKS),
                        help="wall: elapsed time; cpu: this thread's CPU time (CPU only; for a busy machine)")
    parser.add_argument("--triton-launch", action="store_true",
                        help=f"also time every module with attnorm.kernels.fast_launch off ('<module>{TRITON_LAUNCH}')")
    parser.add_argument("--check", action="store_true", help="exit 1 when a module misses the goal or fails")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args()
    if args.clock == "cpu" and args.device != "cpu":
        parser.error("--clock cpu times CPU work only; use the wall clock with --device cuda")
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    stamp = versions(args.device)
    backend_name = args.backend or f"default ({attnorm.get_backend()})"
    print(f"scores {ROWS}x{LENGTH} {args.dtype} on {args.device}; attnorm backend {backend_name}; forward only")
    print(f"versions: {stamp}; attnorm from {Path(attnorm.__file__).parent}")
    print(f"{args.rounds} interleaved rounds x {args.calls} calls per sample, {args.clock} clock; "
          f"ratio to {BARE} within each round")

    functions, errors = calls(args.backend, args.device, dtype, args.triton_launch)
    first = first_calls(functions, errors, args.device)
    samples = measure(functions, args.device, args.rounds, args.calls, CLOCKS[args.clock])
    names = [BARE, BARE_SCALED, "torch.softmax", *modules(args.backend)]
    if args.triton_launch:
        names += [name + TRITON_LAUNCH for name in modules(args.backend)]
    common = {"device": args.device, "dtype": args.dtype, "shape": f"{ROWS}x{LENGTH}", "backend": backend_name,
              "calls_per_sample": args.calls, "clock": args.clock, "versions": stamp}
    rows = result_rows(samples, first, errors, names, common)

    stem = args.out / f"bench_overhead_{args.device}"
    write_csv(stem.with_suffix(".csv"), rows, COLUMNS)
    markdown = table(rows)
    note = (f"Eager forward on {ROWS}x{LENGTH} {args.dtype} scores, {args.device}, attnorm backend {backend_name}: "
            f"median µs per call (p20-p80, {args.clock} clock) over {args.rounds} interleaved samples of "
            f"{args.calls} calls, and the "
            f"median within-round ratio to `{BARE}` (a bare `torch.library.custom_op` around `torch.softmax`, "
            f"with fake kernel and autograd; `{BARE_SCALED}`, the same around Scalable-Softmax's formula "
            f"with `s` and `bias` as inputs, for the learnable module).  Goal: every module <= {GOAL}x.  "
            f"Versions: {stamp.replace(';', ', ')}.")
    failures = [f"{row['normalizer']} ({row['input']}): {row['error']}" for row in rows if "error" in row]
    if failures:
        note += "\n\nErrors:\n\n" + "\n".join(f"- {failure}" for failure in failures)
    stem.with_suffix(".md").write_text(f"{markdown}\n\n{note}\n")
    print(markdown)
    for failure in failures:
        print(f"error: {failure}")
    missed = [row for row in rows if row.get("meets_goal") in ("no", "error")]
    print(f"{len(missed)} of {sum('meets_goal' in row for row in rows)} module rows miss the {GOAL}x goal")
    print(f"wrote {stem}.csv and .md")
    return 1 if args.check and missed else 0


if __name__ == "__main__":
    raise SystemExit(main())
