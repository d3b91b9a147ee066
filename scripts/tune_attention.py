"""Time the fused attention kernels' launch settings on a GPU: block size, warps, stages, registers, skipping.

``attention_launch.CUDA_OPTIONS`` and ``BLOCK_CUDA`` were chosen from register spills in an
offline compile (no GPU was lent then).  This script times them.  For each normalizer spec
and each setting ``BLOCKxWARPSxSTAGES`` it times ``attnorm.attention`` forward and
forward + backward with ``triton.testing.do_bench`` beside SDPA on the same inputs, and
prints one Markdown table (milliseconds and the ratio to SDPA).  Settings are compiled
first by worker processes in parallel (Triton's on-disk cache is shared), so the timed pass
in this process mostly hits the cache.  ``--profile`` adds, at the first setting, CUDA time
per kernel from ``torch.profiler`` (which kernel of a family dominates).

Usage (on a machine with CUDA)::

    PYTHONPATH=. python scripts/tune_attention.py --specs sparsemax topk:k=64 \\
        --settings 64x8x2 64x4x3 128x8x2 --length 16384 --out /tmp/tune

Writes ``tune_attention.md`` and ``.csv`` into ``--out``.  A setting that fails to compile
or launch gets an error row; the run goes on.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

SPECS = ("sparsemax", "entmax:alpha=1.5", "topk:k=64", "sa_softmax", "sa_softmax:normalized=false")
SETTINGS = ("64x4x3", "64x4x3+hist", "64x4x3+skip", "64x4x3r168", "64x4x3r128", "64x4x2", "128x8x2", "128x4x2")


def launch_options(text: str) -> dict[str, int]:
    """``WARPSxSTAGES[rREGS]`` -> Triton launch options (``rREGS``: ``maxnreg``, a cap on registers per thread).

    ``scripts/compile_check.py --options`` reads the same grammar.

    Raises:
        ValueError: text not of that form.
    """
    core, _, regs = text.partition("r")
    warps, stages = (int(part) for part in core.split("x"))
    return {"num_warps": warps, "num_stages": stages, **({"maxnreg": int(regs)} if regs else {})}


def parse_setting(setting: str) -> tuple[int, dict[str, int], bool, bool]:
    """``BLOCKxWARPSxSTAGES[rREGS][+skip][+hist]`` -> (block, launch options, skip empty tiles, histogram).

    ``rREGS`` caps the registers per thread (Triton's ``maxnreg``: 168 lets three 4-warp programs
    share an SM's 64K registers, 128 four, against two at the 255 the kernels take today);
    ``+skip`` sets ``attention_launch.SKIP_EMPTY_TILES``; ``+hist`` sets
    ``attention_entmax.HISTOGRAM_FLOOR`` (the entmax forward's first-pass histogram; off by default).
    """
    core, *flags = setting.split("+")
    unknown = set(flags) - {"skip", "hist"}
    if unknown:
        raise ValueError(f"unknown setting flag {sorted(unknown)[0]!r} in {setting!r} (only +skip, +hist)")
    block, _, options = core.partition("x")
    return int(block), launch_options(options), "skip" in flags, "hist" in flags


def apply(setting: str) -> None:
    """Patch the fused kernels' block size, launch options and tile skipping to ``setting`` (:func:`parse_setting`).

    Forgets the replayed launch plans (:func:`attnorm.kernels.triton.replay.clear`): a plan recorded at
    the last setting keeps its kernels and arguments (module-level settings are not in its key), so
    without this every setting after the first timed the first one's kernels again.
    """
    from attnorm.kernels.triton import attention_entmax, attention_launch, replay

    block, options, skip, histogram = parse_setting(setting)
    attention_launch.BLOCK_CUDA = block
    attention_launch.CUDA_OPTIONS = options
    attention_launch.SKIP_EMPTY_TILES = skip
    attention_entmax.HISTOGRAM_FLOOR = histogram
    replay.clear()


def inputs(args, requires_grad: bool = True):
    import torch

    generator = torch.Generator(device="cuda").manual_seed(0)
    shape = (args.batch, args.heads, args.length, args.head_dim)
    qkv = [torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=generator).requires_grad_(requires_grad)
           for _ in range(3)]
    return qkv, torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=generator)


def attend(spec: str | None):
    import torch.nn.functional as F

    import attnorm

    if spec is None:
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    normalizer = attnorm.make(spec).to("cuda")
    return lambda q, k, v: attnorm.attention(q, k, v, normalizer=normalizer, is_causal=True)


def compile_one(spec: str, setting: str, args) -> tuple[str, str, float, str]:
    """Worker: one forward + backward at ``setting`` (fills Triton's cache); returns the error, if any."""
    start = time.perf_counter()
    try:
        apply(setting)
        small = argparse.Namespace(**{**vars(args), "length": 1024, "batch": 1})
        qkv, grad = inputs(small)
        attend(spec)(*qkv).backward(grad)
        import torch

        torch.cuda.synchronize()
        error = ""
    except Exception as exc:  # noqa: BLE001 - reported as the setting's error row
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
    return spec, setting, time.perf_counter() - start, error


def measure(spec: str | None, args) -> tuple[float, float]:
    """Median milliseconds of forward, and of forward + backward."""
    qkv, grad = inputs(args)
    fn = attend(spec)

    def forward():
        fn(*qkv)

    def both():
        fn(*qkv).backward(grad)

    from triton.testing import do_bench

    both()  # compile (cache hit) outside the timing
    return (do_bench(forward, grad_to_none=qkv, rep=args.rep), do_bench(both, grad_to_none=qkv, rep=args.rep))


def profile(spec: str, args) -> list[tuple[str, float, int]]:
    """CUDA milliseconds per kernel name over one forward + backward."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    qkv, grad = inputs(args)
    fn = attend(spec)
    fn(*qkv).backward(grad)
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(*qkv).backward(grad)
        torch.cuda.synchronize()
    rows = {}
    for event in prof.key_averages():
        cuda_us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if cuda_us > 0 and event.count:
            rows[event.key] = (cuda_us / 1e3, event.count)
    return sorted(((name, ms, count) for name, (ms, count) in rows.items()), key=lambda row: -row[1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--specs", nargs="+", default=list(SPECS))
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS),
                        help="BLOCKxWARPSxSTAGES[rREGS][+skip][+hist]")
    parser.add_argument("--length", type=int, default=16384)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    parser.add_argument("--rep", type=int, default=100, help="do_bench's rep (ms)")
    parser.add_argument("--profile", action="store_true", help="CUDA time per kernel at the first setting")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    import torch
    import triton

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}", flush=True)
    errors: dict[tuple[str, str], str] = {}
    start = time.perf_counter()
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(args.workers, mp_context=context) as pool:
        jobs = [pool.submit(compile_one, spec, setting, args) for spec in args.specs for setting in args.settings]
        for job in as_completed(jobs):
            spec, setting, seconds, error = job.result()
            print(f"compiled {spec} {setting} in {seconds:.0f}s {error}", flush=True)
            if error:
                errors[spec, setting] = error
    print(f"compile phase {time.perf_counter() - start:.0f}s", flush=True)

    base_fwd, base_both = measure(None, args)
    rows = [dict(spec="sdpa", setting="", fwd_ms=base_fwd, both_ms=base_both, fwd_ratio=1.0, both_ratio=1.0,
                 error="")]
    print(f"sdpa fwd {base_fwd:.3f} ms fwd+bwd {base_both:.3f} ms", flush=True)
    for spec in args.specs:
        for setting in args.settings:
            row = dict(spec=spec, setting=setting, fwd_ms="", both_ms="", fwd_ratio="", both_ratio="",
                       error=errors.get((spec, setting), ""))
            if not row["error"]:
                try:
                    apply(setting)
                    fwd, both = measure(spec, args)
                    row.update(fwd_ms=fwd, both_ms=both, fwd_ratio=fwd / base_fwd, both_ratio=both / base_both)
                except Exception as exc:  # noqa: BLE001
                    row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
                torch.cuda.empty_cache()
            rows.append(row)
            print(row, flush=True)
    title = (f"### fused attention settings: bf16, causal, B={args.batch}, H={args.heads}, L={args.length}, "
             f"D={args.head_dim}; {torch.cuda.get_device_name()}, torch {torch.__version__}, "
             f"triton {triton.__version__}")
    lines = [title, "", "| spec | setting | fwd ms | fwd / SDPA | fwd+bwd ms | fwd+bwd / SDPA | error |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        cells = [row["spec"], row["setting"]]
        for key in ("fwd_ms", "fwd_ratio", "both_ms", "both_ratio"):
            cells.append(f"{row[key]:.3f}" if isinstance(row[key], float) else "")
        cells.append(row["error"])
        lines.append("| " + " | ".join(cells) + " |")
    if args.profile:
        apply(args.settings[0])
        for spec in args.specs:
            lines += ["", f"#### {spec} at {args.settings[0]}: CUDA ms per kernel (one forward + backward)", ""]
            try:
                for name, ms, count in profile(spec, args)[:8]:
                    lines.append(f"- {ms:.3f} ms x{count} {name[:100]}")
            except Exception as exc:  # noqa: BLE001
                lines.append(f"- error: {type(exc).__name__}: {exc}")
    text = "\n".join(lines) + "\n"
    print(text)
    (out / "tune_attention.md").write_text(text)
    with open(out / "tune_attention.csv", "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
