"""Sparsemax against the entmax package, and the entmax test-suite properties."""

from __future__ import annotations

import entmax
import pytest
import torch
from torch.autograd import gradcheck, gradgradcheck

import attnorm
from attnorm import functional as F


@pytest.mark.parametrize("dim", [0, 1, 2, -1])
@pytest.mark.parametrize("coef", [1e-5, 0.5, 1e4])
def test_matches_entmax_sparsemax_and_its_partial_sort(dim, coef):
    # entmax's `k` computes the threshold from a partial sort and must give the same map.
    x = coef * torch.randn(3, 4, 5, dtype=torch.float64)
    out = attnorm.Sparsemax(dim=dim)(x)
    torch.testing.assert_close(out, entmax.sparsemax(x, dim=dim))
    torch.testing.assert_close(out, entmax.sparsemax(x, dim=dim, k=2))
    torch.testing.assert_close(out, entmax.sparsemax_bisect(x, dim=dim, n_iter=100), rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_masked_keys_as_in_entmax_test_mask(dtype):
    x = torch.randn(2, 6, dtype=dtype)
    x[:, 3:] = -float("inf")
    out = F.sparsemax(x, dim=1)
    torch.testing.assert_close(out[:, :3], F.sparsemax(x[:, :3], dim=1))
    assert (out[:, 3:] == 0).all()


def test_is_the_projection_onto_the_simplex():
    x = torch.randn(8, 12, dtype=torch.float64)
    out = F.sparsemax(x)
    torch.testing.assert_close(out.sum(-1), torch.ones(8, dtype=torch.float64))
    # KKT: p_i = x_i - tau on the support, x_i <= tau off it, one tau per row.
    tau = (x - out).masked_fill(out == 0, float("nan")).nanmean(-1, keepdim=True)
    torch.testing.assert_close((x - out)[out > 0], tau.expand_as(x)[out > 0])
    assert (x[out == 0] <= tau.expand_as(x)[out == 0]).all()


def test_entmax_alpha_two_is_sparsemax():
    x = torch.randn(4, 3, 2, 9, dtype=torch.float64)  # (B, H, Lq, Lk)
    torch.testing.assert_close(attnorm.Entmax(alpha=2.0)(x), attnorm.Sparsemax()(x))
    per_head = torch.full((3, 1, 1), 2.0, dtype=torch.float64)  # the tensor path solves by bisection
    torch.testing.assert_close(F.entmax(x, alpha=per_head), attnorm.Sparsemax()(x), rtol=1e-9, atol=1e-12)


def test_max_weight_at_least_one_over_support_size():
    out = F.sparsemax(torch.randn(20, 300))
    support = (out > 0).sum(-1)
    assert (out.amax(-1) * support >= 1 - 1e-6).all()


@pytest.mark.parametrize("dim", [0, 1, 2])
def test_gradcheck_and_gradgradcheck_over_dims(dim):
    # Kinks are where a score crosses the threshold; this seed keeps every score > 1e-3 away
    # (gradcheck's finite differences step 1e-6).
    x = torch.randn(3, 4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    out = F.sparsemax(x, dim=dim)
    tau = (x - out).masked_fill(out == 0, float("nan")).nanmean(dim, keepdim=True)
    assert ((x - tau).abs() > 1e-3).all()
    fn = lambda scores: F.sparsemax(scores, dim=dim)
    assert gradcheck(fn, (x.requires_grad_(True),))
    # Sparsemax is piecewise linear: the second derivative is 0 away from kinks.
    assert gradgradcheck(fn, (x,))


def test_backward_matches_entmax_package():
    x = torch.randn(5, 11, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(5, 11, dtype=torch.float64)
    (grad,) = torch.autograd.grad(F.sparsemax(x), x, upstream)
    (expected,) = torch.autograd.grad(entmax.sparsemax(x), x, upstream)
    torch.testing.assert_close(grad, expected)
