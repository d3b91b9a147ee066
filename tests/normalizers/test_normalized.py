"""F / sum F normalizers (relu, relu2, softplus, any Normalized(f)), softmax_1 and sigmoid attention.

References are float64 formulas written from the definitions (``references.py`` and mpmath
here); the shared rules (masks, +inf, NaN, dims, dtypes, gradcheck) run over the same
normalizers through ``CASES`` in ``tests/test_rules.py``.
"""

from __future__ import annotations

import math

import mpmath
import pytest
import torch
from torch.autograd import gradcheck, gradgradcheck

import attnorm
from attnorm import functional as F
from normalizers.references import (
    ratio_reference,
    relu_reference,
    sigmoid_reference,
    softmax1_reference,
    softplus_reference,
    square_plus_one,
)

NAMED = {
    "relu": relu_reference,
    "relu2": lambda x: relu_reference(x, 2.0),
    "softplus": softplus_reference,
    "softmax1": softmax1_reference,
    "sigmoid": sigmoid_reference,
}


@pytest.mark.parametrize("name", NAMED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_named_maps_match_their_formulas(name, dtype):
    x = (3 * torch.randn(4, 5, 9, dtype=torch.float64, generator=torch.Generator().manual_seed(0))).to(dtype)
    out = attnorm.make(name)(x)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), NAMED[name](x.double()), rtol=1e-5 if dtype == torch.float32 else 1e-12,
                               atol=1e-7 if dtype == torch.float32 else 1e-14)


def test_relu_row_with_no_positive_score_gives_zeros_and_zero_gradient():
    x = torch.tensor([[-1.0, 0.0, -3.0], [2.0, -1.0, 0.0]], dtype=torch.float64, requires_grad=True)
    out = attnorm.make("relu")(x)
    torch.testing.assert_close(out, torch.tensor([[0.0, 0.0, 0.0], [1.0, 0.0, 0.0]], dtype=torch.float64))
    (grad,) = torch.autograd.grad(out, x, torch.randn(2, 3, dtype=torch.float64))
    assert torch.equal(grad[0], torch.zeros(3, dtype=torch.float64))
    assert not grad.isnan().any()


def test_sigmoid_uses_the_allowed_count_of_each_row():
    x = torch.randn(6, 6, dtype=torch.float64)
    out = attnorm.make("sigmoid")(x, mask=attnorm.causal_mask())
    n = torch.arange(1, 7, dtype=torch.float64)[:, None]
    expected = torch.where(torch.ones(6, 6, dtype=torch.bool).tril(), 1 / (1 + torch.exp(-(x - torch.log(n)))), 0.0)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=0)
    fixed = F.sigmoid_attention(x, bias=0.5)
    torch.testing.assert_close(fixed, sigmoid_reference(x, 0.5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_extreme_scores_give_exact_ratios_without_overflow(dtype):
    big = 1e30 if dtype != torch.float16 else 6e4
    x = torch.tensor([big, 2 * big / 3, -big], dtype=dtype)
    torch.testing.assert_close(attnorm.make("relu")(x).double(), torch.tensor([0.6, 0.4, 0.0], dtype=torch.float64),
                               rtol=1e-2, atol=1e-3)
    torch.testing.assert_close(attnorm.make("relu2")(x).double(),
                               torch.tensor([9 / 13, 4 / 13, 0.0], dtype=torch.float64), rtol=1e-2, atol=1e-3)
    torch.testing.assert_close(attnorm.make("softplus")(x).double(),
                               torch.tensor([0.6, 0.4, 0.0], dtype=torch.float64), rtol=1e-2, atol=1e-3)
    torch.testing.assert_close(attnorm.make("softmax1")(x).double(), torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64))


def test_softplus_of_very_negative_scores_is_softmax_like_not_zero():
    # softplus(x) = e^x (1 - e^x / 2 + ...) underflows in float32 below about -104; the ratio does not.
    x = torch.tensor([-300.0, -301.0, -302.5], dtype=torch.float32)
    exact = [mpmath.log1p(mpmath.exp(mpmath.mpf(value))) for value in x.tolist()]
    expected = torch.tensor([float(value / sum(exact)) for value in exact], dtype=torch.float64)
    torch.testing.assert_close(attnorm.make("softplus")(x).double(), expected, rtol=1e-6, atol=0)


def test_softmax1_matches_mpmath_for_large_scores():
    x = torch.tensor([[700.0, 699.0, -5.0], [-40.0, -41.0, -45.0]], dtype=torch.float64)
    for row, out_row in zip(x.tolist(), attnorm.make("softmax1")(x), strict=True):
        exps = [mpmath.exp(mpmath.mpf(value)) for value in row]
        expected = torch.tensor([float(value / (1 + sum(exps))) for value in exps], dtype=torch.float64)
        torch.testing.assert_close(out_row, expected, rtol=1e-13, atol=1e-300)
    assert float(attnorm.make("softmax1")(x[1]).sum()) < 1e-17  # a row may attend (almost) nowhere


def test_normalized_with_autograd_and_with_supplied_derivative_give_the_papers_jacobian():
    x = torch.randn(5, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    grad_out = torch.randn(5, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    values, derivative = x**2 + 1, 2 * x
    total = values.sum(-1, keepdim=True)
    weights = values / total
    # J = (diag(F') - a F'^T) / sum F, so J^T g = F' (g - sum(a g)) / sum F.
    expected = derivative * (grad_out - (weights * grad_out).sum(-1, keepdim=True)) / total
    for module in (attnorm.Normalized(square_plus_one), attnorm.Normalized(square_plus_one, lambda t: 2 * t)):
        leaf = x.clone().requires_grad_(True)
        out = module(leaf)
        torch.testing.assert_close(out, weights, rtol=1e-13, atol=0)
        (grad,) = torch.autograd.grad(out, leaf, grad_out)
        torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-14)
    supplied = attnorm.Normalized(square_plus_one, lambda t: 2 * t)
    assert gradgradcheck(supplied, (x[:2].clone().requires_grad_(True),))


def test_normalized_masks_dims_and_fully_masked_rows():
    x = torch.randn(3, 4, 6, dtype=torch.float64)
    mask = torch.rand(3, 4, 6) < 0.6
    mask[0, 0] = False
    out = attnorm.Normalized(torch.exp, dim=1)(x.transpose(1, 2), mask=mask.transpose(1, 2)).transpose(1, 2)
    expected = torch.softmax(x.masked_fill(~mask, -math.inf), -1).nan_to_num(0.0)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-15)
    assert torch.equal(out[0, 0], torch.zeros(6, dtype=torch.float64))


def test_user_function_and_derivative_must_be_callable():
    with pytest.raises(TypeError, match="f must be a callable"):
        attnorm.Normalized(3.0)
    with pytest.raises(TypeError, match="derivative must be a callable"):
        attnorm.Normalized(torch.exp, derivative="exp")
    with pytest.raises(ValueError, match="power must be a number > 0"):
        attnorm.ReLUNormalized(power=-1.0)
    assert "x2" in repr(attnorm.Normalized(torch.exp, name="x2"))


@pytest.mark.parametrize("name", NAMED)
def test_gradcheck_with_a_causal_mask(name):
    x = torch.linspace(-2, 2, 30, dtype=torch.float64).reshape(5, 6)[:, torch.randperm(6)].requires_grad_(True)
    module = attnorm.make(name)
    assert gradcheck(lambda scores: module(scores, mask=attnorm.causal_mask()), (x,))


@pytest.mark.parametrize("name", NAMED)
def test_compiles_with_no_graph_break(name):
    module = attnorm.make(name)
    x = torch.randn(2, 5, 7)
    compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x, mask=attnorm.causal_mask()), module(x, mask=attnorm.causal_mask()))


@pytest.mark.parametrize("name", NAMED)
def test_through_attention_equals_the_formula(name):
    generator = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 3, 5, 4, dtype=torch.float64, generator=generator) for _ in range(3))
    out = attnorm.attention(q, k, v, name, is_causal=True)
    scores = q @ k.transpose(-2, -1) / 2
    weights = torch.zeros_like(scores)
    for row in range(5):
        weights[..., row, : row + 1] = NAMED[name](scores[..., row, : row + 1])
    torch.testing.assert_close(out, weights @ v, rtol=1e-10, atol=1e-12)


def test_a_user_function_overflowing_at_finite_scores_gives_the_infinite_limit_not_nan():
    """F(x) = x^2 + 1 overflows float32 at |x| > 1.8e19: those positions share the row (as +inf scores do)."""
    x = torch.tensor([[3e20, -4e20, 1.0], [2.0, 1.0, 0.0]], requires_grad=True)
    weights = attnorm.Normalized(square_plus_one)(x)
    torch.testing.assert_close(weights[0], torch.tensor([0.5, 0.5, 0.0]))
    torch.testing.assert_close(weights[1].double(), ratio_reference(x[1].detach().double() ** 2 + 1))
    (grad,) = torch.autograd.grad(weights.sum(), x)
    assert torch.isfinite(grad).all()
