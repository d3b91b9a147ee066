"""Scalable-Softmax: softmax((s log n + bias) x) with n the allowed positions of each row."""

from __future__ import annotations

import math

import pytest
import torch
from torch.autograd import gradcheck, gradgradcheck
from torch.func import functional_call

import attnorm
from attnorm import functional as F


def ssmax_row(values: torch.Tensor, s: float, bias: float) -> torch.Tensor:
    """One row in float64: n is the row's length."""
    return torch.softmax((s * math.log(values.numel()) + bias) * values.double(), dim=-1)


@pytest.mark.parametrize(("s", "bias"), [(0.43, 0.0), (1.0, 0.5), (0.2, -0.3)])
def test_multiplier_uses_the_row_length(s, bias):
    x = torch.randn(3, 17, dtype=torch.float64)
    out = attnorm.ScalableSoftmax(s=s, bias=bias)(x)
    torch.testing.assert_close(out, torch.stack([ssmax_row(row, s, bias) for row in x]))


@pytest.mark.parametrize("diagonal_offset", [0, 3])
def test_causal_query_i_uses_n_equal_to_its_visible_keys(diagonal_offset):
    queries, s, bias = 6, 0.8, 0.1
    keys = queries + diagonal_offset
    x = torch.randn(2, queries, keys, dtype=torch.float64)
    out = F.scalable_softmax(x, s=s, bias=bias, mask=attnorm.causal_mask(diagonal_offset))
    for query in range(queries):
        visible = query + 1 + diagonal_offset  # n = i + 1 for the top-left aligned causal mask
        for batch in range(2):
            torch.testing.assert_close(out[batch, query, :visible], ssmax_row(x[batch, query, :visible], s, bias))
            assert (out[batch, query, visible:] == 0).all()


def test_first_causal_query_gets_weight_one():
    out = attnorm.ScalableSoftmax(s=0.5, bias=2.0)(torch.randn(1, 4, 4), mask=attnorm.causal_mask())
    torch.testing.assert_close(out[0, 0], torch.tensor([1.0, 0.0, 0.0, 0.0]))


def test_padded_keys_do_not_count():
    lengths = torch.tensor([3, 8])
    x = torch.randn(2, 4, 8, dtype=torch.float64)
    out = attnorm.ScalableSoftmax(s=0.6)(x, mask=attnorm.key_padding_mask(lengths))
    for batch, length in enumerate(lengths.tolist()):
        expected = torch.stack([ssmax_row(row[:length], 0.6, 0.0) for row in x[batch]])
        torch.testing.assert_close(out[batch, :, :length], expected)
        assert (out[batch, :, length:] == 0).all()


def test_per_head_parameters_broadcast_over_batch_heads_queries_keys():
    heads = 4
    module = attnorm.ScalableSoftmax(num_heads=heads, learnable=True).double()
    s_values, bias_values = [0.1, 0.4, 0.9, 1.5], [0.0, -0.2, 0.3, 1.0]
    with torch.no_grad():
        module.s.copy_(torch.tensor(s_values).reshape(heads, 1, 1))
        module.bias.copy_(torch.tensor(bias_values).reshape(heads, 1, 1))
    x = torch.randn(2, heads, 3, 7, dtype=torch.float64)
    out = module(x)
    for head in range(heads):
        expected = torch.stack([ssmax_row(row, s_values[head], bias_values[head]) for row in x[:, head].reshape(-1, 7)])
        torch.testing.assert_close(out[:, head].reshape(-1, 7), expected)


@pytest.mark.parametrize("num_heads", [None, 3])
def test_gradcheck_over_scores_s_and_bias(num_heads):
    module = attnorm.ScalableSoftmax(s=0.5, bias=0.2, learnable=True, num_heads=num_heads).double()
    x = torch.randn(2, 3, 4, 5, dtype=torch.float64, requires_grad=True)
    s = module.s.detach().clone().requires_grad_(True)
    bias = module.bias.detach().clone().requires_grad_(True)
    # Under a causal mask n varies per query row, so d/ds carries log(i + 1).
    fn = lambda scores, s_, bias_: functional_call(
        module, {"s": s_, "bias": bias_}, (scores,), {"mask": attnorm.causal_mask(1)}
    )
    assert gradcheck(fn, (x, s, bias))
    assert gradgradcheck(fn, (x, s, bias))


def test_learnable_parameters_receive_gradients_per_head():
    module = attnorm.ScalableSoftmax(learnable=True, num_heads=2)
    x = torch.randn(1, 2, 3, 5)
    (module(x) * torch.randn(1, 2, 3, 5)).sum().backward()
    assert module.s.grad.shape == (2, 1, 1) and module.bias.grad.shape == (2, 1, 1)
    assert (module.s.grad != 0).all() and (module.bias.grad != 0).all()


def test_s_zero_and_bias_one_is_plain_softmax():
    x = torch.randn(4, 9, dtype=torch.float64)
    torch.testing.assert_close(F.scalable_softmax(x, s=0.0, bias=1.0), torch.softmax(x, dim=-1))


def test_learnable_gradients_are_finite_with_fully_masked_rows():
    module = attnorm.ScalableSoftmax(learnable=True, num_heads=2)
    x = torch.randn(1, 2, 3, 4, requires_grad=True)
    out = module(x, mask=attnorm.causal_mask(-1))  # query 0 sees no key
    assert (out[:, :, 0] == 0).all()
    out.sum().backward()
    assert torch.isfinite(module.s.grad).all() and torch.isfinite(module.bias.grad).all()
    assert (x.grad[:, :, 0] == 0).all()
