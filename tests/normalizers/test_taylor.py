"""Taylor-softmax (Mongaras & Larson, arXiv 2507.23632) and its linear-time causal form, against float64 formulas."""

from __future__ import annotations

import math

import pytest
import torch
from torch.autograd import gradcheck

import attnorm
from attnorm import functional as F
from attnorm.kernels.reference.taylor import taylor_linear_causal
from normalizers.references import taylor_reference


def taylor_attention_reference(q, k, v, scale, order=2, allowed=None):
    """``sum_j T_n(s_ij) v_j / sum_j T_n(s_ij)`` over allowed keys, float64 (rows with no key: 0)."""
    q, k, v = q.double(), k.double(), v.double()
    scores = scale * q @ k.transpose(-2, -1)
    weights = sum(scores**m / math.factorial(m) for m in range(order + 1))
    if allowed is not None:
        weights = torch.where(allowed, weights, 0.0)
    total = weights.sum(-1, keepdim=True)
    return (weights / torch.where(total > 0, total, 1.0)) @ v


@pytest.mark.parametrize("n", [0, 2, 4, 6])
def test_matches_the_truncated_exponential_ratio_with_scores_as_given(n):
    x = 3 * torch.randn(4, 6, 11, dtype=torch.float64)
    x[0, 0] -= 1000.0  # no max subtraction: far-negative scores get large weights, as T_n says
    torch.testing.assert_close(attnorm.make(f"taylor:n={n}")(x), taylor_reference(x, n), rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(F.taylor_softmax(x, n), taylor_reference(x, n), rtol=1e-12, atol=1e-15)


def test_odd_or_negative_order_and_linear_above_two_are_clear_errors():
    with pytest.raises(ValueError, match="n .the Taylor order. must be even, got 3"):
        attnorm.make("taylor:n=3")
    with pytest.raises(ValueError, match="must be an int >= 0"):
        attnorm.TaylorSoftmax(-2)
    with pytest.raises(ValueError, match="linear-time form exists for n <= 2"):
        attnorm.TaylorSoftmax(4, linear=True)
    module = attnorm.TaylorSoftmax(2)
    with pytest.raises(ValueError, match="must be even"):
        module.n = 5
    assert module.n == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_extreme_scores_stay_finite_and_exact(dtype):
    big = 1e30 if dtype != torch.float16 else 3e4
    x = torch.tensor([[big, -big / 2, 0.0], [-big, -big, -big]], dtype=dtype, requires_grad=True)
    out = attnorm.make("taylor")(x)
    # T_2(x) ~ x^2 / 2 for |x| large: the ratio of squares, 0 for the score 0.
    expected = torch.tensor([[0.8, 0.2, 0.0], [1 / 3, 1 / 3, 1 / 3]], dtype=torch.float64)
    torch.testing.assert_close(out.double(), expected, rtol=1e-2, atol=1e-3)
    (grad,) = torch.autograd.grad(out, x, torch.randn(2, 3, dtype=dtype))
    assert out.dtype == dtype and not grad.isnan().any()


def test_additive_mask_excludes_very_negative_entries_and_adds_the_rest():
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 6, 4, dtype=torch.float64, generator=generator) for _ in range(3))
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    bias = torch.randn(6, 6, dtype=torch.float64, generator=generator)
    expected = taylor_attention_reference(q, k, v, 0.5, allowed=causal)
    for lowest in (-math.inf, torch.finfo(torch.float64).min):
        additive = torch.zeros(6, 6, dtype=torch.float64).masked_fill(~causal, lowest)
        torch.testing.assert_close(attnorm.attention(q, k, v, "taylor", attn_mask=additive), expected)
        biased = (additive + bias).masked_fill(~causal, lowest)
        scores = 0.5 * q @ k.transpose(-2, -1) + bias
        weights = torch.where(causal, 1 + scores + scores**2 / 2, 0.0)
        torch.testing.assert_close(attnorm.attention(q, k, v, "taylor", attn_mask=biased),
                                   weights / weights.sum(-1, keepdim=True) @ v)


@pytest.mark.parametrize(("length", "chunk"), [(1, 64), (100, 64), (2048, 64), (333, 128)])
def test_linear_causal_form_equals_the_quadratic_formula(length, chunk):
    generator = torch.Generator().manual_seed(length)
    q, k, v = (torch.randn(1, 2, length, 16, generator=generator) for _ in range(3))
    expected = taylor_attention_reference(q, k, v, 0.25, allowed=torch.ones(length, length, dtype=torch.bool).tril())
    out = taylor_linear_causal(q, k, v, 0.25, chunk=chunk)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=2e-6)


def test_linear_form_through_attention_with_gqa_and_half_precision():
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 300, 8, generator=generator)
    k, v = (torch.randn(2, 2, 300, 8, generator=generator) for _ in range(2))
    module = attnorm.TaylorSoftmax(linear=True, chunk=32)
    allowed = torch.ones(300, 300, dtype=torch.bool).tril()
    expected = taylor_attention_reference(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), 8**-0.5,
                                          allowed=allowed)
    torch.testing.assert_close(attnorm.attention(q, k, v, module, is_causal=True).double(), expected,
                               rtol=1e-5, atol=2e-6)
    half = attnorm.attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), module, is_causal=True)
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.double(), expected, rtol=2e-2, atol=2e-2)
    # Any other mask goes to the quadratic route and still gives Taylor attention.
    window = allowed & ~torch.ones(300, 300, dtype=torch.bool).tril(-5)
    expected = taylor_attention_reference(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), 8**-0.5,
                                          allowed=window)
    torch.testing.assert_close(attnorm.attention(q, k, v, module, attn_mask=window).double(), expected,
                               rtol=1e-5, atol=2e-6)


def test_linear_form_gradients_match_the_quadratic_form():
    generator = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 1, 12, 3, dtype=torch.float64, generator=generator, requires_grad=True)
               for _ in range(3))
    assert gradcheck(lambda *qkv: taylor_linear_causal(*qkv, 0.5, chunk=5), (q, k, v))
    linear = torch.autograd.grad(taylor_linear_causal(q, k, v, 0.5, chunk=5).sum(), (q, k, v))
    quadratic = torch.autograd.grad(attnorm.attention(q, k, v, "taylor", is_causal=True, scale=0.5).sum(), (q, k, v))
    for left, right in zip(linear, quadratic, strict=True):
        torch.testing.assert_close(left, right)
