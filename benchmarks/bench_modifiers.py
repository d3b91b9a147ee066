"""What attention sinks and soft-capping cost: each normalizer with and without them, side by side.

For every normalizer this times ``attnorm.attention`` forward + backward (causal) on the
same ``q, k, v`` four ways: plain, with ``sinks`` (one per head), with ``softcap=30``, and
with both, and reports each modifier's time as a ratio to the plain call measured in
the same round (the median over rounds).  On CPU every call takes the blocked route,
whose row kernels (native C) take the sink and the cap as arguments; on CUDA the fused
kernels do.  The logit scalings are left out: unmodified they take SDPA, which has
neither modifier, so their ratio would compare two routes.

How it is measured: interleaved rounds of ``time.perf_counter`` (CUDA: synchronised),
after one warm-up call per provider.  A provider that fails becomes an error row.

Usage::

    python benchmarks/bench_modifiers.py                    # CPU: (1, 4, 2048, 64) float32
    python benchmarks/bench_modifiers.py --device cuda      # (4, 16, 4096, 64) bfloat16
    python benchmarks/bench_modifiers.py --quick            # seconds

Writes ``bench_modifiers_<device>.csv`` and ``.md`` into ``--out`` (default ``benchmarks/results/``).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
from reporting import interleaved, markdown_table, versions, write_csv

import attnorm

SPECS = ("sparsemax", "entmax:alpha=1.5", "sa_softmax", "topk:k=64")
MODIFIERS = {"sinks": {"sinks": True}, "softcap": {"softcap": 30.0}, "both": {"sinks": True, "softcap": 30.0}}


def step(spec: str, q, k, v, sinks=None, softcap=None) -> None:
    """One forward + backward of causal attention."""
    out = attnorm.attention(q, k, v, spec, is_causal=True, sinks=sinks, softcap=softcap)
    out.backward(torch.ones_like(out))


def measure(spec: str, shape, dtype, device: str, rounds: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(shape, generator=gen).to(device, dtype).requires_grad_() for _ in range(3))
    sinks = torch.zeros(shape[1], device=device, dtype=dtype, requires_grad=True)
    providers = {"plain": lambda: step(spec, q, k, v)}
    for name, modifier in MODIFIERS.items():
        providers[name] = (lambda m=modifier: step(spec, q, k, v, sinks if m.get("sinks") else None,
                                                   m.get("softcap")))
    rows = []
    times, errors = interleaved(providers, device, rounds)
    plain = times.get("plain")
    for name in (*times, *errors):
        row = {"spec": spec, "modifier": name, "error": errors.get(name, "")}
        if name in times:
            row["ms"] = 1e3 * statistics.median(times[name])
            if plain:
                row["ratio_to_plain"] = statistics.median(t / p for t, p in zip(times[name], plain, strict=True))
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="a small shape and 2 rounds")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    if args.device == "cuda":
        shape, dtype = (4, 16, 4096, 64), torch.bfloat16
    else:
        shape, dtype = (1, 4, 2048, 64), torch.float32
    if args.quick:
        shape, rounds = (1, 2, 256, 32), 2
    else:
        rounds = args.rounds
    rows = [row for spec in SPECS for row in measure(spec, shape, dtype, args.device, rounds)]
    stem = args.out / f"bench_modifiers_{args.device}"
    write_csv(stem.with_suffix(".csv"), rows, ("spec", "modifier", "ms", "ratio_to_plain", "error"))
    table = markdown_table(
        ("normalizer", "modifier", "ms (median)", "ratio to plain"),
        [(row["spec"], row["modifier"], f"{row['ms']:.1f}" if "ms" in row else row["error"],
          f"{row['ratio_to_plain']:.3f}" if "ratio_to_plain" in row else "") for row in rows],
    )
    text = (f"causal attention forward + backward, {tuple(shape)} {str(dtype).removeprefix('torch.')} on "
            f"{args.device}, {rounds} interleaved rounds\n\n{versions(args.device)}\n\n{table}\n")
    stem.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
