"""Top-k softmax: softmax over the k largest allowed scores, exact zeros elsewhere."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnorm
from attnorm import functional as F
from normalizers.references import topk_count, topk_softmax_reference


@pytest.mark.parametrize("k", [1, 2, 5, 0.06, 0.1, 0.5, 0.99])
@pytest.mark.parametrize("temperature", [0.5, 1.0])
def test_matches_softmax_over_the_k_largest(k, temperature):
    x = torch.randn(3, 4, 100, dtype=torch.float64)
    out = attnorm.TopKSoftmax(k, temperature=temperature)(x)
    torch.testing.assert_close(out, topk_softmax_reference(x, k, temperature))
    assert ((out > 0).sum(-1) == topk_count(k, 100)).all()


@pytest.mark.parametrize(("k", "n", "kept"), [(0.06, 100, 6), (0.07, 100, 7), (0.1, 25, 3), (0.5, 1, 1), (0.01, 5, 1)])
def test_fraction_keeps_max_one_ceil_k_n(k, n, kept):
    out = F.topk_softmax(torch.randn(n), k)
    assert int((out > 0).sum()) == kept


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 2000), percent=st.integers(1, 99))
def test_fraction_count_for_any_row_length(n, percent):
    k = percent / 100
    out = F.topk_softmax(torch.randn(n, generator=torch.Generator().manual_seed(n)), k)
    assert int((out > 0).sum()) == topk_count(k, n)


def test_fraction_counts_allowed_positions_of_each_row():
    x = torch.randn(4, 20, dtype=torch.float64)
    lengths = torch.tensor([1, 5, 11, 20])
    mask = torch.arange(20) < lengths[:, None]
    out = attnorm.TopKSoftmax(0.3)(x, mask=mask)
    for row, length in enumerate(lengths.tolist()):
        torch.testing.assert_close(out[row, :length], topk_softmax_reference(x[row, :length], 0.3))
        assert int((out[row] > 0).sum()) == topk_count(0.3, length)


@pytest.mark.parametrize("k", [8, 9, 1000])
def test_k_at_least_row_length_is_softmax(k):
    x = torch.randn(5, 8, dtype=torch.float64)
    torch.testing.assert_close(attnorm.TopKSoftmax(k, temperature=0.7)(x), torch.softmax(x / 0.7, dim=-1))


def test_k_one_is_one_hot_at_the_argmax():
    x = torch.randn(6, 10)
    expected = torch.nn.functional.one_hot(x.argmax(-1), 10).float()
    torch.testing.assert_close(attnorm.TopKSoftmax(1)(x), expected)


def test_ties_keep_exactly_k_positions():
    out = attnorm.TopKSoftmax(2)(torch.zeros(3, 6))
    assert ((out > 0).sum(-1) == 2).all()
    torch.testing.assert_close(out.sum(-1), torch.ones(3))
    assert set(out.unique().tolist()) == {0.0, 0.5}


def test_dropped_positions_get_zero_gradient_and_kept_ones_the_softmax_gradient():
    x = torch.randn(4, 10, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(4, 10, dtype=torch.float64)
    (grad,) = torch.autograd.grad(F.topk_softmax(x, 3), x, upstream)
    kept = x.detach() >= x.detach().topk(3, dim=-1).values[..., -1:]
    kept_scores = x.detach().masked_fill(~kept, float("-inf")).requires_grad_(True)
    (expected,) = torch.autograd.grad(torch.softmax(kept_scores, dim=-1), kept_scores, upstream)
    assert (grad[~kept] == 0).all()
    torch.testing.assert_close(grad[kept], expected[kept])
