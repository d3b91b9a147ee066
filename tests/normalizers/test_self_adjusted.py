"""SA-Softmax: x * softmax(x), or its min-max normalised factor; rows need not sum to 1."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import attnorm
from attnorm import functional as F


def test_plain_variant_is_x_times_softmax():
    x = torch.randn(3, 4, 8, dtype=torch.float64)
    out = attnorm.SelfAdjustedSoftmax(normalized=False)(x)
    torch.testing.assert_close(out, x * torch.softmax(x, dim=-1))


def test_plain_variant_can_be_negative_and_rows_do_not_sum_to_one():
    out = F.self_adjusted_softmax(torch.tensor([-1.0, 0.0, 2.0]), normalized=False)
    assert out[0] < 0
    assert not torch.isclose(out.sum(), torch.tensor(1.0))
    assert not attnorm.SelfAdjustedSoftmax.sums_to_one


def test_normalized_factor_is_min_max_with_zero_included():
    x = torch.tensor([[2.0, -1.0, 0.5], [3.0, 1.0, 2.0], [-3.0, -1.0, -2.0]], dtype=torch.float64)
    softmax = torch.softmax(x, dim=-1)
    # low = min(x_min, 0), high = max(x_max, 0)
    factors = torch.tensor([[1.0, 0.0, 0.5], [1.0, 1 / 3, 2 / 3], [0.0, 2 / 3, 1 / 3]], dtype=torch.float64)
    torch.testing.assert_close(attnorm.SelfAdjustedSoftmax()(x), factors * softmax)


def test_normalized_weights_lie_in_unit_interval():
    x = 5 * torch.randn(50, 20, dtype=torch.float64)
    out = attnorm.SelfAdjustedSoftmax()(x)
    assert (out >= 0).all() and (out <= 1).all()


def test_zero_row_gives_zeros():
    out = attnorm.SelfAdjustedSoftmax()(torch.zeros(2, 5))
    assert (out == 0).all()


def test_min_and_max_are_taken_over_allowed_positions_only():
    x = torch.tensor([2.0, -100.0, 1.0], dtype=torch.float64)
    mask = torch.tensor([True, False, True])
    out = attnorm.SelfAdjustedSoftmax()(x, mask=mask)
    softmax = torch.softmax(torch.tensor([2.0, 1.0], dtype=torch.float64), dim=-1)
    torch.testing.assert_close(out, torch.stack([softmax[0], torch.tensor(0.0).double(), 0.5 * softmax[1]]))


def test_length_one_row_keeps_positive_scores_and_zeroes_the_rest():
    x = torch.tensor([[2.5], [-1.0], [0.0]])
    torch.testing.assert_close(attnorm.SelfAdjustedSoftmax()(x), torch.tensor([[1.0], [0.0], [0.0]]))
    torch.testing.assert_close(attnorm.SelfAdjustedSoftmax(normalized=False)(x), x)


_ROW_BACKENDS = ["reference", "native", *(["triton"] if importlib.util.find_spec("triton") else [])]


@pytest.mark.parametrize("backend", _ROW_BACKENDS)
def test_gradient_at_a_row_min_or_max_of_exactly_zero(backend):
    """``low = min(min x, 0)`` has a kink where ``min x = 0``: every backend counts the path
    through it there, as autograd of ``clamp`` does (and likewise for ``high`` at ``max x = 0``)."""
    from tests.conftest import DEVICE

    if backend == "native" and DEVICE != "cpu":
        pytest.skip("the native kernels take CPU tensors")
    x = torch.tensor([[0.0, 1.0, 2.0, 0.0], [0.0, -1.0, -2.0, 0.0], [0.0, 2.0, 4.0, 1.0]], dtype=torch.float64)
    grad = torch.randn(3, 4, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    expected_x = x.clone().requires_grad_()
    low = expected_x.amin(-1, keepdim=True).clamp(max=0)
    high = expected_x.amax(-1, keepdim=True).clamp(min=0)
    ((expected_x - low) / (high - low) * torch.softmax(expected_x, -1) * grad).sum().backward()
    got_x = x.to(DEVICE).requires_grad_()
    (F.self_adjusted_softmax(got_x, backend=backend) * grad.to(DEVICE)).sum().backward()
    torch.testing.assert_close(got_x.grad.cpu(), expected_x.grad)


@pytest.mark.parametrize("backend", _ROW_BACKENDS)
@pytest.mark.parametrize("score", [1e200, -1e300, 3.0])
def test_plain_gradient_of_a_single_huge_score_is_one(backend, score):
    """``y = x`` in a row of one key, so ``dy/dx = 1`` whatever ``x``: the reference wrote the gradient as
    ``g (1 + x) - sum(g x w)``, which lost ``g`` to rounding at ``x = 1e200`` (0 instead of 1); its JVP too."""
    from tests.conftest import DEVICE

    if backend == "native" and DEVICE != "cpu":
        pytest.skip("the native kernels take CPU tensors")
    x = torch.tensor([[score], [2.0]], dtype=torch.float64, device=DEVICE, requires_grad=True)
    grad = torch.tensor([[0.75], [-1.5]], dtype=torch.float64, device=DEVICE)
    y = F.self_adjusted_softmax(x, normalized=False, backend=backend)
    (y * grad).sum().backward()
    torch.testing.assert_close(y.detach(), x.detach(), rtol=0, atol=0)
    torch.testing.assert_close(x.grad, grad, rtol=0, atol=0)
    if backend == "reference":
        tangent = torch.func.jvp(lambda s: F.self_adjusted_softmax(s, normalized=False, backend="reference"),
                                 (x.detach(),), (grad,))[1]
        torch.testing.assert_close(tangent, grad, rtol=0, atol=0)
