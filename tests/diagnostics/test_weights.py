"""Entropy, support, effective tokens and top-N mass against hand values and float64 loops."""

from __future__ import annotations

import math

import pytest
import scipy.stats
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnorm import causal_mask
from attnorm.diagnostics import (
    effective_tokens,
    entropy,
    normalized_entropy,
    support_size,
    top_n_mass,
)


def loop_rows(weights: torch.Tensor, mask: torch.Tensor):
    """Yield (row index, allowed weights as python floats) for every row."""
    flat_w = weights.reshape(-1, weights.shape[-1]).tolist()
    flat_m = mask.expand(weights.shape).reshape(-1, weights.shape[-1]).tolist()
    for index, (row, allowed) in enumerate(zip(flat_w, flat_m, strict=True)):
        yield index, [value for value, keep in zip(row, allowed, strict=True) if keep]


def random_case(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randn(2, 3, 5, 6, generator=generator, dtype=torch.float64)
    mask = torch.rand(2, 1, 5, 6, generator=generator) > 0.3
    weights = torch.softmax(scores.masked_fill(~mask, -math.inf), dim=-1).nan_to_num(0.0)
    return weights, mask


def test_hand_values():
    weights = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25], [1.0, 0.0, 0.0, 0.0]])
    assert torch.allclose(entropy(weights), torch.tensor([math.log(2), math.log(4), 0.0], dtype=torch.float64))
    assert torch.allclose(normalized_entropy(weights), torch.tensor([0.5, 1.0, 0.0], dtype=torch.float64))
    assert support_size(weights).tolist() == [2, 4, 1]
    assert torch.allclose(effective_tokens(weights), torch.tensor([2.0, 4.0, 1.0], dtype=torch.float64))
    assert torch.allclose(effective_tokens(weights, order=2), torch.tensor([2.0, 4.0, 1.0], dtype=torch.float64))
    assert torch.allclose(top_n_mass(weights, 1), torch.tensor([0.5, 0.25, 1.0], dtype=torch.float64))


def test_masked_row_hand_values():
    weights = torch.tensor([[0.5, 0.5, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False, True]])
    # n = 3 allowed positions: normalized entropy log 2 / log 3.
    assert normalized_entropy(weights, mask).item() == pytest.approx(math.log(2) / math.log(3))
    assert support_size(weights, mask, eps=0.4).item() == 2


def test_against_loops_and_scipy():
    weights, mask = random_case()
    got_entropy = entropy(weights, mask).flatten()
    got_normalized = normalized_entropy(weights, mask).flatten()
    got_support = support_size(weights, mask, eps=0.1).flatten()
    got_perplexity = effective_tokens(weights, mask).flatten()
    got_participation = effective_tokens(weights, mask, order=2).flatten()
    got_mass = top_n_mass(weights, 2, mask).flatten()
    for index, row in loop_rows(weights, mask):
        total = sum(row)
        probabilities = [value / total for value in row] if total > 0 else row
        expected = float(scipy.stats.entropy(probabilities)) if total > 0 else 0.0
        assert got_entropy[index].item() == pytest.approx(expected, abs=1e-12)
        expected_normalized = expected / math.log(len(row)) if len(row) > 1 else 0.0
        assert got_normalized[index].item() == pytest.approx(expected_normalized, abs=1e-12)
        assert got_support[index].item() == sum(value > 0.1 for value in row)
        assert got_perplexity[index].item() == pytest.approx(math.exp(expected) if total > 0 else 0.0)
        squares = sum(p * p for p in probabilities)
        assert got_participation[index].item() == pytest.approx(1 / squares if total > 0 else 0.0)
        assert got_mass[index].item() == pytest.approx(sum(sorted(row, reverse=True)[:2]), abs=1e-12)


def test_fully_masked_row_gives_zeros_not_nan():
    weights = torch.zeros(1, 4)
    mask = torch.zeros(1, 4, dtype=torch.bool)
    for value in (entropy(weights, mask), normalized_entropy(weights, mask), effective_tokens(weights, mask)):
        assert value.item() == 0.0
    assert top_n_mass(weights, 3, mask).item() == 0.0


def test_structured_mask_equals_bool_mask():
    scores = torch.randn(2, 2, 5, 5, dtype=torch.float64)
    bool_mask = torch.ones(5, 5, dtype=torch.bool).tril()
    weights = torch.softmax(scores.masked_fill(~bool_mask, -math.inf), dim=-1)
    assert torch.equal(normalized_entropy(weights, causal_mask()), normalized_entropy(weights, bool_mask))
    assert torch.equal(support_size(weights, causal_mask()), support_size(weights, bool_mask))


def test_top_n_mass_ignores_masked_even_with_negative_weights():
    weights = torch.tensor([[-0.2, 0.1, 0.9]])
    mask = torch.tensor([[True, True, False]])
    assert top_n_mass(weights, 2, mask).item() == pytest.approx(-0.1)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(-5, 5), min_size=1, max_size=12))
def test_effective_tokens_ordering(values):
    weights = torch.softmax(torch.tensor(values, dtype=torch.float64), dim=-1)
    perplexity = effective_tokens(weights).item()
    participation = effective_tokens(weights, order=2).item()
    assert 1 - 1e-9 <= participation <= perplexity + 1e-9
    assert perplexity <= len(values) + 1e-9
    assert -1e-12 <= normalized_entropy(weights).item() <= 1 + 1e-12


def test_bad_arguments():
    weights = torch.full((1, 3), 1 / 3)
    with pytest.raises(ValueError, match="order"):
        effective_tokens(weights, order=3)
    with pytest.raises(ValueError, match="eps"):
        support_size(weights, eps=-1.0)
    with pytest.raises(ValueError, match="n must be"):
        top_n_mass(weights, 0)
    with pytest.raises(TypeError, match="mask"):
        entropy(weights, torch.ones(1, 3))
