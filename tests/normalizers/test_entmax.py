"""alpha-entmax against the entmax package; alpha = 1 is softmax, alpha = 2 sparsemax; learnable alpha."""

from __future__ import annotations

import entmax
import pytest
import torch
from torch.autograd import gradcheck, gradgradcheck
from torch.func import functional_call

import attnorm
from attnorm import functional as F
from normalizers.references import entmax_reference


@pytest.mark.parametrize("alpha", [1.1, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_matches_entmax_package(alpha, dtype):
    x = 2 * torch.randn(3, 5, 40, dtype=dtype)
    out = attnorm.Entmax(alpha=alpha)(x)
    assert out.dtype == dtype
    tolerance = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-9, "atol": 1e-12}
    if alpha > 2 and dtype == torch.float32:
        # out = [(alpha - 1) x - tau]^(1 / (alpha - 1)) has infinite slope at the support's edge:
        # a float32 rounding of tau (~1e-7) moves a weight there by up to ~sqrt(1e-7).
        tolerance = {"rtol": 1e-5, "atol": 1e-3}
    torch.testing.assert_close(out.double(), entmax_reference(x, alpha), **tolerance)
    torch.testing.assert_close(out.double().sum(-1), torch.ones(3, 5, dtype=torch.float64), rtol=0, atol=1e-5)


@pytest.mark.parametrize("dim", [0, 1, 2])
@pytest.mark.parametrize("coef", [1e-5, 0.5, 1e4])
def test_entmax15_matches_the_partial_sort_of_the_entmax_package(dim, coef):
    x = coef * torch.randn(3, 4, 5, dtype=torch.float64)
    out = F.entmax(x, alpha=1.5, dim=dim)
    torch.testing.assert_close(out, entmax.entmax15(x, dim=dim))
    torch.testing.assert_close(out, entmax.entmax15(x, dim=dim, k=2))


@pytest.mark.parametrize("alpha", [1.25, 1.5, 1.75, 2.25])
def test_masked_keys_as_in_entmax_test_mask_alphas(alpha):
    x = torch.randn(2, 6)
    x[:, 3:] = -float("inf")
    out = F.entmax(x, alpha=alpha)
    torch.testing.assert_close(out[:, :3], F.entmax(x[:, :3], alpha=alpha))
    assert (out[:, 3:] == 0).all()


def test_alpha_one_is_softmax_and_alpha_near_one_approaches_it():
    x = torch.randn(4, 12, dtype=torch.float64)
    torch.testing.assert_close(attnorm.Entmax(alpha=1.0)(x), torch.softmax(x, dim=-1))
    torch.testing.assert_close(F.entmax(x, alpha=1.001), torch.softmax(x, dim=-1), rtol=0, atol=5e-3)


def test_per_head_alpha_broadcasts_and_a_head_with_alpha_one_is_softmax():
    alphas = [1.0, 1.3, 1.5, 2.0]
    x = torch.randn(2, 4, 3, 8, dtype=torch.float64)  # (B, H, Lq, Lk)
    module = attnorm.Entmax(alpha=1.5, num_heads=4).double()
    module.fixed_alpha.copy_(torch.tensor(alphas, dtype=torch.float64).reshape(4, 1, 1))
    out = module(x)
    for head, alpha in enumerate(alphas):
        torch.testing.assert_close(out[:, head], entmax_reference(x[:, head], alpha), rtol=1e-9, atol=1e-12)


def test_per_head_alpha_gradient_matches_entmax_bisect():
    x = torch.randn(2, 3, 4, 7, dtype=torch.float64, requires_grad=True)
    alpha = torch.tensor([1.2, 1.5, 1.8], dtype=torch.float64).reshape(3, 1, 1).requires_grad_(True)
    upstream = torch.randn(2, 3, 4, 7, dtype=torch.float64)
    grads = torch.autograd.grad(F.entmax(x, alpha=alpha), (x, alpha), upstream)
    expected = torch.autograd.grad(entmax.entmax_bisect(x, alpha, n_iter=100), (x, alpha), upstream)
    torch.testing.assert_close(grads[0], expected[0], rtol=1e-7, atol=1e-10)
    torch.testing.assert_close(grads[1], expected[1], rtol=1e-7, atol=1e-10)


def away_from_kinks(alpha: torch.Tensor | float, x: torch.Tensor, margin: float = 1e-3) -> bool:
    """Every score is ``margin`` away from the threshold: (alpha - 1) x_i - tau vs 0."""
    out = entmax.entmax_bisect(x, alpha, n_iter=100)
    alpha = torch.as_tensor(alpha, dtype=x.dtype)
    gap_on_support = out.pow(alpha - 1)  # = (alpha - 1) x_i - tau where out_i > 0
    tau = ((alpha - 1) * x - gap_on_support).masked_fill(out == 0, float("nan")).nanmean(-1, keepdim=True)
    return bool((((alpha - 1) * x - tau).abs() > margin).all())


@pytest.mark.parametrize("alpha", [1.3, 1.5, 2.5])
@pytest.mark.parametrize("dim", [0, 1, 2])
def test_gradcheck_and_gradgradcheck_over_dims(alpha, dim):
    x = torch.randn(3, 4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    assert away_from_kinks(alpha, x.movedim(dim, -1))
    fn = lambda scores: F.entmax(scores, alpha=alpha, dim=dim)
    assert gradcheck(fn, (x.requires_grad_(True),))
    assert gradgradcheck(fn, (x,))


@pytest.mark.parametrize("num_heads", [None, 3])
def test_learnable_alpha_gradcheck_and_gradgradcheck(num_heads):
    module = attnorm.Entmax(alpha=1.4, learnable=True, num_heads=num_heads).double()
    x = torch.randn(2, 3, 2, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    assert away_from_kinks(module.alpha.detach(), x)
    logit = module.alpha_logit.detach().clone().requires_grad_(True)
    fn = lambda scores, alpha_logit: functional_call(module, {"alpha_logit": alpha_logit}, (scores,))
    assert gradcheck(fn, (x.requires_grad_(True), logit))
    assert gradgradcheck(fn, (x, logit))


def test_learnable_alpha_stays_between_one_and_two():
    module = attnorm.Entmax(alpha=1.7, learnable=True, num_heads=4)
    torch.testing.assert_close(module.alpha, torch.full((4, 1, 1), 1.7))
    with torch.no_grad():
        module.alpha_logit.copy_(torch.tensor([-50.0, -2.0, 3.0, 50.0]).reshape(4, 1, 1))
    assert ((module.alpha >= 1) & (module.alpha <= 2)).all()
    out = module(torch.randn(2, 4, 3, 6))
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.sum(-1), torch.ones(2, 4, 3))


def test_learnable_alpha_receives_a_gradient_per_head():
    module = attnorm.Entmax(alpha=1.5, learnable=True, num_heads=2)
    (module(torch.randn(3, 2, 4, 6)) * torch.randn(3, 2, 4, 6)).sum().backward()
    assert module.alpha_logit.grad.shape == (2, 1, 1)
    assert (module.alpha_logit.grad != 0).all()


def test_learnable_alpha_gradients_under_masks_with_fully_masked_rows():
    module = attnorm.Entmax(alpha=1.6, learnable=True, num_heads=2).double()
    x = torch.randn(2, 2, 3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    mask = attnorm.causal_mask(-1) & attnorm.key_padding_mask(torch.tensor([5, 3]))  # query 0 sees nothing
    allowed = mask.materialize(x.shape)
    assert away_from_kinks(module.alpha.detach(), x.masked_fill(~allowed, -1e9))
    logit = module.alpha_logit.detach().clone().requires_grad_(True)
    fn = lambda scores, alpha_logit: functional_call(module, {"alpha_logit": alpha_logit}, (scores,), {"mask": mask})
    assert gradcheck(fn, (x.requires_grad_(True), logit))
    x_grad, logit_grad = torch.autograd.grad(fn(x, logit), (x, logit), torch.randn(2, 2, 3, 5, dtype=torch.float64))
    assert (x_grad[~allowed.expand(x.shape)] == 0).all() and torch.isfinite(logit_grad).all()
