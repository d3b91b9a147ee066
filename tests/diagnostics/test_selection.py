"""Selection distance (Theorem 1) and separable fraction (Theorem 2) against hand cases and loops."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from attnorm.diagnostics import (
    random_selection,
    random_selection_distance,
    selection_distance,
    separable_fraction,
    top_n_selection,
)


def brute_force_row(alpha: np.ndarray, x: np.ndarray, chosen: tuple[int, ...], allowed: list[int]):
    """All distances ||s - alpha_j x_j|| for one row and one selected set, with explicit loops."""
    context = np.zeros(x.shape[1])
    for i in chosen:
        context += alpha[i] * x[i]
    return {j: float(np.sqrt(np.sum((context - alpha[j] * x[j]) ** 2))) for j in allowed}


def top_indices(alpha: np.ndarray, allowed: list[int], n: int) -> tuple[int, ...]:
    return tuple(sorted(allowed, key=lambda j: -alpha[j])[:n])


def random_case(seed: int = 1, lq: int = 4, lk: int = 7, dim: int = 3):
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randn(2, 3, lq, lk, generator=generator, dtype=torch.float64) * 2
    mask = torch.rand(2, 1, lq, lk, generator=generator) > 0.25
    weights = torch.softmax(scores.masked_fill(~mask, -math.inf), dim=-1).nan_to_num(0.0)
    vectors = torch.randn(2, 3, lk, dim, generator=generator, dtype=torch.float64)
    return weights, vectors, mask


def iterate_rows(weights, vectors, mask):
    expanded = mask.expand(weights.shape)
    for b, h, q in itertools.product(*(range(size) for size in weights.shape[:-1])):
        allowed = [j for j in range(weights.shape[-1]) if expanded[b, h, q, j]]
        yield (b, h, q), weights[b, h, q].numpy(), vectors[b, h].numpy(), allowed


def test_hand_case():
    # alpha = (0.5, 0.3, 0.2), x = e1, e2, e1; top-1 set {0}: s = (0.5, 0)
    weights = torch.tensor([[0.5, 0.3, 0.2]], dtype=torch.float64)
    vectors = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]], dtype=torch.float64)
    # d_1 = ||(0.5, -0.3)|| = sqrt(0.34), d_2 = ||(0.3, 0)|| = 0.3
    expected = (math.sqrt(0.34) + 0.3) / 2
    assert selection_distance(weights, vectors, 1).item() == pytest.approx(expected)
    # Unit vectors already; r = 0.3, and ||s - alpha_0 x_0|| = 0 < r: the top-1 token is separable.
    assert separable_fraction(weights, vectors, 1).item() == 1.0
    # Top-2 set {0, 1}: s = (0.5, 0.3); d_0 = 0.3, d_1 = 0.5, r = d_2 = ||(0.3, 0.3)|| = 0.424: N_s / N = 1 / 2.
    assert separable_fraction(weights, vectors, 2).item() == pytest.approx(0.5)


def test_selection_distance_against_loops():
    weights, vectors, mask = random_case()
    got = selection_distance(weights, vectors, 2, mask)
    for index, alpha, x, allowed in iterate_rows(weights, vectors, mask):
        chosen = top_indices(alpha, allowed, 2)
        others = [j for j in allowed if j not in chosen]
        if not others:
            assert math.isnan(got[index].item())
            continue
        distances = brute_force_row(alpha, x, chosen, others)
        assert got[index].item() == pytest.approx(np.mean(list(distances.values())), abs=1e-12)


def test_separable_fraction_against_loops():
    weights, vectors, mask = random_case(seed=2, lk=9)
    for n in (1, 3, 5):
        got = separable_fraction(weights, vectors, n, mask)
        for index, alpha, x, allowed in iterate_rows(weights, vectors, mask):
            unit = x / np.linalg.norm(x, axis=1, keepdims=True)
            chosen = top_indices(alpha, allowed, n)
            others = [j for j in allowed if j not in chosen]
            if not others:
                assert math.isnan(got[index].item())
                continue
            distances = brute_force_row(alpha, unit, chosen, allowed)
            radius = min(distances[j] for j in others)
            expected = sum(distances[i] < radius for i in chosen) / len(chosen)
            assert got[index].item() == pytest.approx(expected)


def test_random_selection_distance_matches_exact_expectation():
    weights, vectors, mask = random_case(seed=3, lq=2, lk=6)
    mask = torch.ones_like(mask)
    got = random_selection_distance(weights, vectors, 2, mask, samples=4000, generator=torch.Generator().manual_seed(0))
    for index, alpha, x, allowed in iterate_rows(weights, vectors, mask):
        means = []
        for chosen in itertools.combinations(allowed, 2):
            others = [j for j in allowed if j not in chosen]
            means.append(np.mean(list(brute_force_row(alpha, x, chosen, others).values())))
        assert got[index].item() == pytest.approx(np.mean(means), rel=0.02)


def test_random_selection_is_uniform_over_allowed_subsets():
    allowed = torch.tensor([True, False, True, True, True]).expand(6000, 5)
    chosen = random_selection(allowed, 2, torch.Generator().manual_seed(0))
    assert not chosen[:, 1].any()
    assert (chosen.sum(-1) == 2).all()
    counts = {}
    for row in chosen.tolist():
        key = tuple(i for i, keep in enumerate(row) if keep)
        counts[key] = counts.get(key, 0) + 1
    assert len(counts) == math.comb(4, 2)
    assert all(abs(count / 6000 - 1 / 6) < 0.025 for count in counts.values())


def test_top_n_selection_caps_at_allowed_count():
    weights = torch.tensor([[0.1, 0.6, 0.3, 0.0]])
    mask = torch.tensor([[True, True, False, False]])
    assert top_n_selection(weights, 3, mask).tolist() == [[True, True, False, False]]
    assert top_n_selection(weights, 1).tolist() == [[False, True, False, False]]


def test_distances_shrink_with_uniform_attention_over_longer_rows():
    # Lemma 1 / Theorem 1: uniform weights 1/L make every weighted vector, and s, shrink like 1/L.
    generator = torch.Generator().manual_seed(0)
    distances = []
    for length in (16, 64, 256):
        weights = torch.full((1, length), 1 / length, dtype=torch.float64)
        vectors = torch.randn(length, 8, generator=generator, dtype=torch.float64)
        vectors = vectors / vectors.norm(dim=-1, keepdim=True)
        distances.append(selection_distance(weights, vectors, 4).item())
    assert distances[0] > distances[1] > distances[2]
    assert distances[0] / distances[2] == pytest.approx(16, rel=0.2)


def test_shape_errors():
    with pytest.raises(ValueError, match="agree on Lk"):
        selection_distance(torch.ones(2, 3), torch.ones(4, 2), 1)
    with pytest.raises(ValueError, match="n must be"):
        separable_fraction(torch.ones(2, 3), torch.ones(3, 2), 0)
    with pytest.raises(ValueError, match="samples"):
        random_selection_distance(torch.ones(2, 3), torch.ones(3, 2), 1, samples=0)
