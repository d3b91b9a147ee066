"""What a mask costs a row normalizer: each module with no mask, a causal mask, a bool mask and causal + padding.

The 30-second example's call, ``normalizer(scores, mask=attnorm.causal_mask())`` on
``(B, H, L, L)`` scores, side by side with the same module unmasked and with what it replaces,
``torch.softmax(scores.masked_fill(~allowed, -inf), -1)``.  Every provider runs forward +
backward (``--modes forward`` for the forward alone) on the same scores; the table gives each
one's median time and, per round, its ratio to the module's unmasked call and to the masked
``torch.softmax`` (medians over interleaved rounds, which tames a shared machine's noise).

On CPU the native kernels take contiguous rows: a mask is applied in torch first
(``rules.masked_scores``: one pass, forbidden scores set to -inf), and the kernel then
finds each row's allowed positions itself.  On CUDA the Triton row kernels read the mask.

Usage::

    python benchmarks/bench_masked_rows.py --threads 1      # CPU: (1, 4, 1024, 1024) float32
    python benchmarks/bench_masked_rows.py --quick          # seconds
    python benchmarks/bench_masked_rows.py --device cuda    # (4, 16, 2048, 2048)

Writes ``bench_masked_rows_<device>.csv`` and ``.md`` into ``--out`` (default ``benchmarks/results/``).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
from reporting import interleaved, markdown_table, versions, write_csv

import attnorm

SPECS = ("softmax", "ssmax", "sa_softmax", "sparsemax", "entmax:alpha=1.5", "entmax:alpha=1.3", "topk:k=32")
MASKS = ("none", "causal", "bool", "causal+padding")


def masks(shape, device) -> dict[str, object]:
    """Each mask kind for scores of ``shape`` ``(B, H, L, L)``, as attnorm takes it and as a bool tensor."""
    batch, length = shape[0], shape[-1]
    lengths = torch.tensor([length - 7 * b for b in range(batch)], device=device).clamp_min(1)
    tril = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    padded = tril & (torch.arange(length, device=device) < lengths[:, None, None, None])
    return {
        "none": (None, None),
        "causal": (attnorm.causal_mask(), tril),
        "bool": (tril, tril),
        "causal+padding": (attnorm.causal_mask() & attnorm.key_padding_mask(lengths), padded),
    }


def call(function, scores: torch.Tensor, backward: bool):
    def run():
        weights = function(scores)
        if backward:
            weights.backward(torch.ones_like(weights))
            scores.grad = None

    return run


def measure(spec: str, shape, dtype, device: str, rounds: int, backward: bool) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(shape, generator=gen).to(device, dtype).requires_grad_(backward)
    module = attnorm.make(spec)
    providers = {}
    for kind, (mask, tensor) in masks(shape, device).items():
        providers[(kind, "attnorm")] = call(lambda x, mask=mask: module(x, mask=mask), scores, backward)
        providers[(kind, "torch")] = call(
            lambda x, tensor=tensor: torch.softmax(x if tensor is None else x.masked_fill(~tensor, -torch.inf), -1),
            scores, backward,
        )
    times, errors = interleaved(providers, device, rounds)
    rows = []
    for kind in MASKS:
        key = (kind, "attnorm")
        row = {"spec": spec, "mask": kind, "error": errors.get(key, "")}
        if key in times:
            row["ms"] = 1e3 * statistics.median(times[key])
            for baseline, column in (((("none", "attnorm")), "x_unmasked"), (((kind, "torch")), "x_torch_softmax")):
                if baseline in times:
                    ratios = (t / b for t, b in zip(times[key], times[baseline], strict=True))
                    row[column] = statistics.median(ratios)
            if (kind, "torch") in times:
                row["torch_softmax_ms"] = 1e3 * statistics.median(times[(kind, "torch")])
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    parser.add_argument("--shape", type=int, nargs=4, metavar=("B", "H", "L", "L_"), help="scores (B, H, L, L)")
    parser.add_argument("--specs", nargs="+", default=list(SPECS), help="attnorm.make specs")
    parser.add_argument("--modes", choices=("forward", "forward+backward"), default="forward+backward")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument("--quick", action="store_true", help="(1, 2, 256, 256), 3 rounds")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    shape = args.shape or ((1, 2, 256, 256) if args.quick else (1, 4, 1024, 1024) if args.device == "cpu"
                           else (4, 16, 2048, 2048))
    if shape[-1] != shape[-2]:
        parser.error("--shape needs square scores (B, H, L, L): the causal mask's diagonal is 0")
    rounds = 3 if args.quick else args.rounds
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    rows = []
    for spec in args.specs:
        rows += measure(spec, shape, dtype, args.device, rounds, args.modes == "forward+backward")
        for row in rows[-len(MASKS):]:
            text = row["error"] or (f"{row['ms']:8.2f} ms  {row.get('x_unmasked', float('nan')):5.2f}x unmasked  "
                                    f"{row.get('x_torch_softmax', float('nan')):5.2f}x torch.softmax")
            print(f"{spec:18} {row['mask']:15} {text}", flush=True)
    stem = args.out / f"bench_masked_rows_{args.device}"
    columns = ("spec", "mask", "ms", "x_unmasked", "torch_softmax_ms", "x_torch_softmax", "error")
    write_csv(stem.with_suffix(".csv"), rows, columns)

    def cell(row: dict, column: str) -> str:
        value = row.get(column, "")
        if isinstance(value, float):
            return f"{value:.2f}x" if column.startswith("x_") else f"{value:.2f}"
        return str(value)

    table = markdown_table(columns, ([cell(row, column) for column in columns] for row in rows))
    stem.with_suffix(".md").write_text(
        f"Masked rows, {args.modes}, scores {tuple(shape)} {str(dtype).removeprefix('torch.')}, {args.device}, "
        f"median of {rounds} interleaved rounds\n\n{versions(args.device)}\n\n{table}\n"
    )
    print(f"wrote {stem}.csv and .md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
