"""The paper's experiments: attention statistics, distance, separability on a model; Algorithm 5 on logits.

Model experiments cut the text into windows of L tokens, run the model once per
window with the normalizer patched in (:func:`~attnorm.diagnostics.capture`), and
average each measure per (layer, head) over windows and queries.  The mixed vectors
are each head's value vectors.  Queries: for causal models (GPT-2) the last query of
each window, the only one that sees all L tokens; for bidirectional encoders (BERT)
up to ``queries`` evenly spaced queries, each of which sees all L tokens.

Every experiment returns a list of flat dict rows (one CSV line each).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from attnorm.diagnostics.capture import capture
from attnorm.diagnostics.models import is_causal_model, token_windows
from attnorm.diagnostics.selection import random_selection_distance, selection_distance, separable_fraction
from attnorm.diagnostics.sensitivity import finite_difference_sensitivity, jacobian_norms
from attnorm.diagnostics.stats import critical_top_n, ks_two_sample, loglog_slope
from attnorm.diagnostics.weights import effective_tokens, entropy, normalized_entropy, support_size, top_n_mass
from attnorm.normalizers.registry import make

__all__ = [
    "ModelRun",
    "distance_experiment",
    "gradient_experiment",
    "gradient_slopes",
    "head_measures",
    "separability_experiment",
    "summary_experiment",
]

Measure = Callable[[Tensor, Tensor], Tensor]  # (weights (B,H,q,L), values (B,H,L,D)) -> (B,H,q)


@dataclass
class ModelRun:
    """A model, its tokenizer and the text the model experiments read.

    Attributes:
        model: a Hugging Face model supported by :mod:`attnorm.integrations.transformers`.
        tokenizer: its tokenizer.
        text: the input text.
        windows: windows of L tokens averaged per length.
        queries: queries per window for bidirectional models (None = all).
        seed: seed of the random top-N sets.
        progress: show tqdm progress bars.
    """

    model: nn.Module
    tokenizer: object
    text: str
    windows: int = 4
    queries: int | None = 64
    seed: int = 0
    progress: bool = True


def _query_positions(length: int, causal: bool, queries: int | None) -> Tensor:
    if causal:
        return torch.tensor([length - 1])
    if queries is None or queries >= length:
        return torch.arange(length)
    return torch.linspace(0, length - 1, queries).round().long().unique()


def head_measures(run: ModelRun, normalizer: str, length: int, measures: dict[str, Measure], bar=None) -> dict:
    """Per (layer, head) means of every measure over the windows and queries of ``run``.

    Args:
        run: model, tokenizer, text and sampling settings.
        normalizer: spec string of the patched-in normalizer.
        length: tokens per window.
        measures: name -> function of (weights ``(B, H, q, L)``, values ``(B, H, L, D)``) giving ``(B, H, q)``.
        bar: a tqdm bar advanced once per window, or None.

    Returns:
        name -> float64 array ``(layers, heads)``.
    """
    windows = token_windows(run.tokenizer, run.text, length, run.windows)
    positions = _query_positions(length, is_causal_model(run.model), run.queries)
    totals: dict[str, list[Tensor]] = {}
    for window in windows:
        for record in capture(run.model, window[None], normalizer):
            weights = record.weights[..., positions, :]
            for name, measure in measures.items():
                per_head = torch.nanmean(measure(weights, record.value).to(torch.float64), dim=(0, 2))
                layers = totals.setdefault(name, [])
                if record.layer < len(layers):
                    layers[record.layer] = layers[record.layer] + per_head
                else:
                    layers.append(per_head)
        if bar is not None:
            bar.update(1)
    return {name: torch.stack(layers).numpy() / len(windows) for name, layers in totals.items()}


def _bar(run: ModelRun, total: int, description: str):
    return tqdm(total=total, desc=description, disable=not run.progress, leave=False)


def summary_experiment(run: ModelRun, normalizers: Sequence[str], lengths: Sequence[int], top_n: int) -> list[dict]:
    """Entropy, support, effective tokens, top-N mass and max weight per (normalizer, L, layer, head).

    Lemma 1 (softmax weights vanish like 1/L) shows as ``max_weight`` falling with L.
    """
    measures: dict[str, Measure] = {
        "entropy": lambda w, v: entropy(w),
        "normalized_entropy": lambda w, v: normalized_entropy(w),
        "support": lambda w, v: support_size(w).double(),
        "support_above_1e-3": lambda w, v: support_size(w, eps=1e-3).double(),
        "effective_tokens_exp_entropy": lambda w, v: effective_tokens(w, order=1),
        "effective_tokens_inverse_simpson": lambda w, v: effective_tokens(w, order=2),
        f"top_{top_n}_mass": lambda w, v: top_n_mass(w, top_n),
        "max_weight": lambda w, v: w.amax(-1),
    }
    rows = []
    with _bar(run, len(normalizers) * len(lengths) * run.windows, "summary") as bar:
        for normalizer in normalizers:
            for length in lengths:
                values = head_measures(run, normalizer, length, measures, bar)
                layers, heads = next(iter(values.values())).shape
                for layer in range(layers):
                    for head in range(heads):
                        row = {"normalizer": normalizer, "length": length, "layer": layer, "head": head}
                        row.update({name: float(array[layer, head]) for name, array in values.items()})
                        rows.append(row)
    return rows


def _distance_row(normalizer: str, sweep: str, length: int, n: int, true: np.ndarray, rand: np.ndarray, alpha: float):
    test = ks_two_sample(true.ravel(), rand.ravel())
    return {
        "normalizer": normalizer,
        "sweep": sweep,
        "length": length,
        "top_n": n,
        "n_over_length": n / length,
        "true_distance": float(np.nanmean(true)),
        "random_distance": float(np.nanmean(rand)),
        "ratio": float(np.nanmean(true) / np.nanmean(rand)),
        "ks_statistic": test.statistic,
        "ks_pvalue": test.pvalue,
        "distinguishable": test.pvalue <= alpha,
    }


def _distance_measures(ns: Sequence[int], samples: int, generator: torch.Generator) -> dict[str, Measure]:
    measures: dict[str, Measure] = {}
    for n in ns:
        measures[f"true_{n}"] = lambda w, v, n=n: selection_distance(w, v, n)
        measures[f"random_{n}"] = lambda w, v, n=n: random_selection_distance(
            w, v, n, samples=samples, generator=generator
        )
    return measures


def distance_experiment(
    run: ModelRun,
    normalizers: Sequence[str],
    lengths: Sequence[int],
    top_ns: Sequence[int],
    fixed_n: int,
    samples: int = 8,
    alpha: float = 0.05,
) -> tuple[list[dict], list[dict]]:
    """Theorem 1: top-N selection distance against random N-sets, vs L at fixed N and vs N at the largest L.

    For each head the mean distance of the top-N set and of ``samples`` random N-sets
    is computed; a KS test compares their distributions across heads (Algorithms 1-3).

    Returns:
        ``(rows, critical)``: one row per (normalizer, sweep, L, N); one row per normalizer
        with the critical N at the largest L (the first N whose KS p-value exceeds ``alpha``).
    """
    fixed_length = max(lengths)
    swept = sorted(n for n in top_ns if n < fixed_length)
    generator = torch.Generator().manual_seed(run.seed)
    rows, critical = [], []
    with _bar(run, len(normalizers) * len(lengths) * run.windows, "distance") as bar:
        for normalizer in normalizers:
            for length in lengths:
                ns = sorted({fixed_n, *swept}) if length == fixed_length else [fixed_n]
                values = head_measures(run, normalizer, length, _distance_measures(ns, samples, generator), bar)
                true = {n: values[f"true_{n}"].ravel() for n in ns}
                rand = {n: values[f"random_{n}"].ravel() for n in ns}
                if fixed_n < length:
                    row = _distance_row(normalizer, "length", length, fixed_n, true[fixed_n], rand[fixed_n], alpha)
                    rows.append(row)
            rows += [_distance_row(normalizer, "top_n", fixed_length, n, true[n], rand[n], alpha) for n in swept]
            result = critical_top_n(swept, [true[n] for n in swept], [rand[n] for n in swept], alpha)
            critical.append(
                {
                    "normalizer": normalizer,
                    "length": fixed_length,
                    "critical_n": result.n,
                    "critical_n_over_length": None if result.n is None else result.n / fixed_length,
                    "alpha": alpha,
                }
            )
    return rows, critical


def separability_experiment(
    run: ModelRun, normalizers: Sequence[str], lengths: Sequence[int], top_ns: Sequence[int]
) -> list[dict]:
    """Theorem 2: separable fraction N_s / N of the top-N set (values on the unit sphere) vs N, per L."""
    rows = []
    with _bar(run, len(normalizers) * len(lengths) * run.windows, "separability") as bar:
        for normalizer in normalizers:
            for length in lengths:
                ns = [n for n in top_ns if n < length]
                measures: dict[str, Measure] = {
                    f"separable_{n}": lambda w, v, n=n: separable_fraction(w, v, n) for n in ns
                }
                values = head_measures(run, normalizer, length, measures, bar)
                for n in ns:
                    fractions = values[f"separable_{n}"]
                    rows.append(
                        {
                            "normalizer": normalizer,
                            "length": length,
                            "top_n": n,
                            "n_over_length": n / length,
                            "separable_fraction": float(np.nanmean(fractions)),
                            "std_over_heads": float(np.nanstd(fractions)),
                            "min_over_heads": float(np.nanmin(fractions)),
                            "max_over_heads": float(np.nanmax(fractions)),
                        }
                    )
    return rows


def gradient_experiment(
    normalizers: Sequence[str],
    temperatures: Sequence[float],
    epsilons: Sequence[float],
    length: int = 128,
    trials: int = 256,
    logit_std: float = 1.0,
    seed: int = 0,
    progress: bool = True,
) -> list[dict]:
    """Algorithm 5: finite-difference sensitivity ``g(T, eps)`` on synthetic logits, and exact Jacobian norms.

    ``trials`` logit rows ``l ~ N(0, logit_std^2 I_L)`` and random unit directions ``v`` are
    drawn once and reused for every T, eps and normalizer, so curves differ only by T.
    The normalizer is applied to ``l / T``.

    Returns:
        One row per (normalizer, T, eps): mean, median and max of ``g`` over the trials,
        and the mean and max spectral norm of the Jacobian of ``l -> F(l / T)``.
    """
    generator = torch.Generator().manual_seed(seed)
    logits = logit_std * torch.randn(trials, length, generator=generator, dtype=torch.float64)
    directions = torch.randn(trials, length, generator=generator, dtype=torch.float64)
    rows = []
    total = len(normalizers) * len(temperatures)
    with tqdm(total=total, desc="gradient", disable=not progress, leave=False) as bar:
        for spec in normalizers:
            normalizer = make(spec)
            for temperature in temperatures:
                spectral, _ = jacobian_norms(lambda x, f=normalizer, t=temperature: f(x / t), logits)
                for eps in epsilons:
                    g = finite_difference_sensitivity(normalizer, logits, eps, temperature, direction=directions)
                    rows.append(
                        {
                            "normalizer": spec,
                            "temperature": float(temperature),
                            "eps": float(eps),
                            "g_mean": float(g.mean()),
                            "g_median": float(g.median()),
                            "g_max": float(g.max()),
                            "jacobian_spectral_mean": float(spectral.mean()),
                            "jacobian_spectral_max": float(spectral.max()),
                        }
                    )
                bar.update(1)
    return rows


def gradient_slopes(rows: list[dict], below: float = 0.1) -> list[dict]:
    """Log-log slope of each sensitivity column against T, over the rows with ``T < below``.

    The paper's Lemma 2 predicts a slope of -1 (sensitivity proportional to 1/T).
    """
    slopes = []
    for spec in dict.fromkeys(row["normalizer"] for row in rows):
        for eps in dict.fromkeys(row["eps"] for row in rows):
            chosen = [
                row for row in rows if (row["normalizer"], row["eps"]) == (spec, eps) and row["temperature"] < below
            ]
            temperatures = [row["temperature"] for row in chosen]
            entry = {"normalizer": spec, "eps": eps, "temperatures_below": below, "points": len(chosen)}
            for column in ("g_mean", "g_median", "g_max", "jacobian_spectral_mean", "jacobian_spectral_max"):
                entry[f"slope_{column}"] = loglog_slope(temperatures, [row[column] for row in chosen])[0]
            slopes.append(entry)
    return slopes
