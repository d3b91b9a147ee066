"""Diagnostics edges found by an independent fuzz (2026-11-27): precision of the selection distances,
-inf logits in the finite-difference sensitivity, and bad input named in the error."""

from __future__ import annotations

import math

import pytest
import torch

import attnorm.diagnostics as dg


def test_weighted_distances_are_exact_where_the_expansion_cancels():
    weights = torch.tensor([[0.999999, 1e-6, 0.0]], dtype=torch.float64)
    vectors = torch.tensor([[100.0, 0.0], [0.0, 100.0], [1.0, 1.0]], dtype=torch.float64)
    selected = torch.tensor([[True, False, False]])
    context = weights[0, 0] * vectors[0]
    expected = torch.stack([torch.linalg.vector_norm(context - weights[0, j] * vectors[j]) for j in range(3)])
    got = dg.weighted_distances(weights, vectors, selected)[0]
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=0)


def test_separable_fraction_on_nearly_tied_tokens():
    """Two tokens along one direction, weights 0.5 +- delta: d_0 = 0 < r = 2 delta, so the top-1 set separates."""
    vectors = torch.tensor([[1.0, 0.0], [1.0, 0.0]], dtype=torch.float64)
    for delta in (1e-12, 1e-9, 1e-6):
        weights = torch.tensor([[0.5 + delta, 0.5 - delta]], dtype=torch.float64)
        assert dg.separable_fraction(weights, vectors, 1).item() == 1.0


def test_a_minus_inf_logit_counts_as_masked_in_the_sensitivity():
    logits = torch.tensor([[0.0, 1.0, -math.inf]], dtype=torch.float64)
    direction = torch.tensor([[1.0, -1.0, 5.0]], dtype=torch.float64)
    masked = torch.tensor([[True, True, False]])
    with_inf = dg.finite_difference_sensitivity("softmax", logits, 1e-6, direction=direction)
    explicit = dg.finite_difference_sensitivity("softmax", logits.masked_fill(~masked, 0.0), 1e-6,
                                                mask=masked, direction=direction)
    torch.testing.assert_close(with_inf, explicit)


@pytest.mark.parametrize("call, word", [
    (lambda w, v: dg.entropy(w, torch.ones(4, dtype=torch.bool)), "mask"),
    (lambda w, v: dg.entropy(w, torch.ones(7, 2, 3, 5, dtype=torch.bool)), "mask"),
    (lambda w, v: dg.entropy(torch.ones(2, 5, dtype=torch.long)), "weights"),
    (lambda w, v: dg.entropy([[0.5, 0.5]]), "weights"),
    (lambda w, v: dg.support_size(w, eps=float("nan")), "eps"),
    (lambda w, v: dg.selection_distance(w, torch.randn(3, 5, 4, dtype=torch.float64), 1), "vectors"),
    (lambda w, v: dg.random_selection(torch.ones(3, 5), 1), "allowed"),
    (lambda w, v: dg.jacobian("softmax", w, torch.ones(4, dtype=torch.bool)), "mask"),
    (lambda w, v: dg.finite_difference_sensitivity("softmax", w, 1e-3, temperature=math.inf), "temperature"),
    (lambda w, v: dg.finite_difference_sensitivity("softmax", w, math.inf), "eps"),
    (lambda w, v: dg.finite_difference_sensitivity("softmax", w, 1e-3, direction=torch.randn(4)), "direction"),
    (lambda w, v: dg.loglog_slope([1, 2, 3], [1, 2]), "x and y"),
], ids=["mask-shape", "mask-dims", "int-weights", "list-weights", "nan-eps", "vector-batch", "float-allowed",
        "jacobian-mask", "inf-temperature", "inf-eps", "direction-shape", "loglog-lengths"])
def test_bad_input_is_named(call, word):
    weights = torch.softmax(torch.randn(2, 3, 5, dtype=torch.float64), -1)
    vectors = torch.randn(2, 5, 4, dtype=torch.float64)
    with pytest.raises((ValueError, TypeError), match=word):
        call(weights, vectors)
