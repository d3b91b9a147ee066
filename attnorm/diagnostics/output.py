"""Results of the diagnostics experiments as CSV files, printed tables and PNG plots."""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

__all__ = [
    "format_table",
    "plot_distance",
    "plot_gradient",
    "plot_separability",
    "plot_summary",
    "write_csv",
]


def write_csv(path: Path, rows: Sequence[dict]) -> Path:
    """Write ``rows`` (dicts sharing their keys) to ``path`` with a header line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def _cell(value) -> str:
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.4g}"
    return str(value)


def format_table(rows: Sequence[dict], columns: Sequence[str]) -> str:
    """A fixed-width text table of ``columns`` (floats to 4 significant digits)."""
    cells = [[_cell(row[column]) for column in columns] for row in rows]
    widths = [max(len(column), *(len(line[i]) for line in cells)) for i, column in enumerate(columns)]
    lines = ["  ".join(column.rjust(width) for column, width in zip(columns, widths, strict=True))]
    lines += ["  ".join(cell.rjust(width) for cell, width in zip(line, widths, strict=True)) for line in cells]
    return "\n".join(lines)


def _figure(panels: int):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 3.8), squeeze=False)
    return plt, figure, axes[0]


def _save(plt, figure, path: Path) -> Path:
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=90)
    plt.close(figure)
    return path


def _log_ticks(axis, values: Sequence[float], which: str = "x") -> None:
    """Log axis with exactly ``values`` as plain tick labels (matplotlib's minor labels overlap)."""
    from matplotlib.ticker import NullLocator

    values = sorted(set(values))
    target = axis.xaxis if which == "x" else axis.yaxis
    getattr(axis, f"set_{which}scale")("log")
    getattr(axis, f"set_{which}ticks")(values, [f"{value:g}" for value in values])
    target.set_minor_locator(NullLocator())


def _by_normalizer(rows: Sequence[dict]) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(row["normalizer"], []).append(row)
    return groups


def _mean_by_length(rows: Sequence[dict], column: str) -> tuple[list[int], list[float]]:
    lengths = sorted({row["length"] for row in rows})
    return lengths, [float(np.mean([row[column] for row in rows if row["length"] == length])) for length in lengths]


def plot_summary(rows: Sequence[dict], path: Path) -> Path:
    """Normalized entropy and mean max weight (log-log, with a 1/L guide) against L, per normalizer."""
    plt, figure, (left, right) = _figure(2)
    for normalizer, group in _by_normalizer(rows).items():
        lengths, entropies = _mean_by_length(group, "normalized_entropy")
        left.plot(lengths, entropies, marker="o", label=normalizer)
        lengths, maxima = _mean_by_length(group, "max_weight")
        right.plot(lengths, maxima, marker="o", label=normalizer)
    lengths = sorted({row["length"] for row in rows})
    start = max(row["max_weight"] for row in rows if row["length"] == lengths[0])
    right.plot(lengths, [start * lengths[0] / length for length in lengths], "k:", label="slope -1 (1/L)")
    left.set(xlabel="L (tokens)", ylabel="normalized entropy H / log L", title="Attention entropy")
    right.set(yscale="log", xlabel="L (tokens)", ylabel="mean max weight", title="Lemma 1: max weight")
    _log_ticks(left, lengths)
    _log_ticks(right, lengths)
    left.legend(fontsize=7)
    right.legend(fontsize=7)
    return _save(plt, figure, path)


def plot_distance(rows: Sequence[dict], critical: Sequence[dict], path: Path) -> Path:
    """Distance vs L at fixed N, and vs N/L at the largest L (top-N solid, random dashed)."""
    plt, figure, (left, right) = _figure(2)
    critical_by_normalizer = {entry["normalizer"]: entry for entry in critical}
    for index, (normalizer, group) in enumerate(_by_normalizer(rows).items()):
        color = f"C{index}"
        by_length = [row for row in group if row["sweep"] == "length"]
        by_n = [row for row in group if row["sweep"] == "top_n"]
        if by_length:
            lengths = [row["length"] for row in by_length]
            left.plot(lengths, [row["true_distance"] for row in by_length], "o-", color=color, label=normalizer)
            left.plot(lengths, [row["random_distance"] for row in by_length], "x--", color=color)
        if by_n:
            ratios = [row["n_over_length"] for row in by_n]
            right.plot(ratios, [row["true_distance"] for row in by_n], "o-", color=color, label=normalizer)
            right.plot(ratios, [row["random_distance"] for row in by_n], "x--", color=color)
            found = critical_by_normalizer.get(normalizer, {}).get("critical_n_over_length")
            if found is not None:
                right.axvline(found, color=color, linestyle=":", linewidth=1)
    fixed_n = next((row["top_n"] for row in rows if row["sweep"] == "length"), None)
    fixed_length = next((row["length"] for row in rows if row["sweep"] == "top_n"), None)
    left.set(yscale="log", xlabel="L (tokens)", ylabel="mean ||s - a_j x_j||",
             title=f"Distance vs L, N = {fixed_n} (dashed: random N-set)")
    _log_ticks(left, [row["length"] for row in rows if row["sweep"] == "length"] or [1])
    right.set(xscale="log", yscale="log", xlabel="N / L", ylabel="mean ||s - a_j x_j||",
              title=f"Distance vs N, L = {fixed_length} (dotted: critical N)")
    left.legend(fontsize=7)
    right.legend(fontsize=7)
    return _save(plt, figure, path)


def plot_separability(rows: Sequence[dict], path: Path) -> Path:
    """Separable fraction N_s / N against N, one line per (normalizer, L)."""
    plt, figure, (axis,) = _figure(1)
    lengths = sorted({row["length"] for row in rows})
    styles = ["o-", "s--", "^:", "d-."]
    for index, (normalizer, group) in enumerate(_by_normalizer(rows).items()):
        for position, length in enumerate(lengths):
            chosen = [row for row in group if row["length"] == length]
            label = normalizer if len(lengths) == 1 else f"{normalizer}, L={length}"
            axis.plot([row["top_n"] for row in chosen], [row["separable_fraction"] for row in chosen],
                      styles[position % len(styles)], color=f"C{index}", label=label, markersize=4)
    axis.axhspan(0.70, 0.85, color="grey", alpha=0.15, label="paper (GPT-2): 0.70-0.85")
    axis.set(ylim=(0, 1.05), xlabel="N (top-N set size)", ylabel="N_s / N", title="Theorem 2: separable fraction")
    _log_ticks(axis, [row["top_n"] for row in rows])
    axis.legend(fontsize=6)
    return _save(plt, figure, path)


def plot_gradient(rows: Sequence[dict], path: Path) -> Path:
    """g(T, eps) (mean over trials) and the Jacobian spectral norm against T, log-log.

    The guide ``1 / (2T)`` is the largest spectral norm softmax's Jacobian can reach
    (two tied top logits), so it bounds every softmax curve for small eps.
    """
    plt, figure, (left, right) = _figure(2)
    styles = ["o-", "s--", "^:", "d-."]
    for index, (normalizer, group) in enumerate(_by_normalizer(rows).items()):
        epsilons = sorted({row["eps"] for row in group})
        for position, eps in enumerate(epsilons):
            chosen = [row for row in group if row["eps"] == eps]
            left.plot([row["temperature"] for row in chosen], [row["g_mean"] for row in chosen],
                      styles[position % len(styles)], color=f"C{index}", label=f"{normalizer}, eps={eps:g}",
                      markersize=3)
        chosen = [row for row in group if row["eps"] == epsilons[0]]
        temperatures = [row["temperature"] for row in chosen]
        right.plot(temperatures, [row["jacobian_spectral_max"] for row in chosen], "o-", color=f"C{index}",
                   label=f"{normalizer}, max", markersize=3)
        right.plot(temperatures, [row["jacobian_spectral_mean"] for row in chosen], "x--", color=f"C{index}",
                   label=f"{normalizer}, mean", markersize=3)
    temperatures = sorted({row["temperature"] for row in rows})
    for axis in (left, right):
        axis.plot(temperatures, [0.5 / t for t in temperatures], "k:", label="1/(2T), softmax's sup")
        axis.set(xscale="log", yscale="log", xlabel="temperature T")
        axis.legend(fontsize=6)
    left.set(ylabel="g(T, eps), mean over trials", title="Algorithm 5: finite-difference sensitivity")
    right.set(ylabel="||J||_2 over trials", title="Exact Jacobian spectral norm")
    return _save(plt, figure, path)
