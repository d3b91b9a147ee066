"""Where an eager call's time goes: cProfile of many tiny forward calls of attnorm modules.

``benchmarks/bench_overhead.py`` says how long a call on a 4x16 tensor takes; this says
why.  For each module it profiles ``--calls`` forward calls (after a warm-up) and prints
the functions with the most own time and the most cumulative time, per call in
microseconds.  Run it on the device in question (CUDA when present)::

    PYTHONPATH=. python scripts/profile_overhead.py --device cuda --out /tmp/profile

Writes ``profile_overhead_<device>.txt`` into ``--out`` when given.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
from pathlib import Path

import torch

import attnorm

MODULES = {
    "Softmax": lambda: attnorm.Softmax(),
    "Sparsemax": lambda: attnorm.Sparsemax(),
    "Entmax(1.5)": lambda: attnorm.Entmax(1.5),
    "TopKSoftmax(k=4)": lambda: attnorm.TopKSoftmax(4),
    "SelfAdjustedSoftmax": lambda: attnorm.SelfAdjustedSoftmax(),
    "ScalableSoftmax": lambda: attnorm.ScalableSoftmax(),
}


def profile_module(name: str, device: str, calls: int, requires_grad: bool, top: int) -> str:
    module = MODULES[name]().to(device)
    x = torch.randn(4, 16, device=device, requires_grad=requires_grad)
    for _ in range(50):
        module(x)
    if device == "cuda":
        torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        module(x)
    if device == "cuda":
        torch.cuda.synchronize()
    profiler.disable()
    lines = [f"## {name} on {device}, input requires grad: {requires_grad} ({calls} calls)"]
    for key in ("tottime", "cumulative"):
        stream = io.StringIO()
        stats = pstats.Stats(profiler, stream=stream)
        total = stats.total_tt / calls * 1e6
        stats.sort_stats(key).print_stats(top)
        lines.append(f"### by {key} (profiled total {total:.1f} µs per call; cProfile inflates it)")
        body = stream.getvalue()
        lines.append(body[body.find("ncalls"):] if "ncalls" in body else body)
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--modules", nargs="+", default=list(MODULES), choices=list(MODULES))
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    sections = [profile_module(name, args.device, args.calls, grad, args.top)
                for name in args.modules for grad in (False, True)]
    text = "\n\n".join(sections) + "\n"
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"profile_overhead_{args.device}.txt").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
