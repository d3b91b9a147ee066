"""Jacobians and finite-difference sensitivity against closed forms and central differences."""

from __future__ import annotations

import math

import entmax
import pytest
import torch

import attnorm
from attnorm.diagnostics import finite_difference_sensitivity, jacobian, jacobian_norms


def softmax_jacobian(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Closed form (diag(a) - a a^T) / T."""
    a = torch.softmax(logits.double() / temperature, dim=-1)
    return (torch.diag_embed(a) - a.unsqueeze(-1) * a.unsqueeze(-2)) / temperature


def central_differences(function, logits: torch.Tensor, step: float = 1e-6) -> torch.Tensor:
    """J[..., i, k] by (f(l + h e_k) - f(l - h e_k)) / 2h, one column at a time."""
    columns = []
    for k in range(logits.shape[-1]):
        offset = torch.zeros_like(logits)
        offset[..., k] = step
        columns.append((function(logits + offset) - function(logits - offset)) / (2 * step))
    return torch.stack(columns, dim=-1)


def test_softmax_jacobian_closed_form():
    logits = torch.randn(3, 2, 6, dtype=torch.float64)
    assert torch.allclose(jacobian(attnorm.Softmax(temperature=0.5), logits), softmax_jacobian(logits, 0.5), atol=1e-12)


def test_entmax_jacobian_against_central_differences():
    logits = torch.randn(4, 7, dtype=torch.float64)
    expected = central_differences(lambda x: entmax.entmax15(x, dim=-1), logits)
    assert torch.allclose(jacobian("entmax:alpha=1.5", logits), expected, atol=1e-5)


def test_sparsemax_jacobian_closed_form():
    logits = torch.tensor([[1.0, 0.8, -2.0, 0.1]], dtype=torch.float64)
    support = (entmax.sparsemax(logits, dim=-1) > 0).double()
    expected = torch.diag_embed(support) - support.unsqueeze(-1) * support.unsqueeze(-2) / support.sum()
    assert torch.allclose(jacobian(attnorm.Sparsemax(), logits), expected)


def test_hand_norms():
    # Uniform logits, L = 4: J = I/4 - 1/16; eigenvalues 1/4 (x3) and 0; largest entry 3/16.
    spectral, max_entry = jacobian_norms("softmax", torch.zeros(1, 4))
    assert spectral.item() == pytest.approx(0.25)
    assert max_entry.item() == pytest.approx(3 / 16)


@pytest.mark.parametrize("temperature", [1.0, 0.1, 0.01])
def test_tied_top_pair_norm_grows_like_one_over_temperature(temperature):
    # a -> (1/2, 1/2, 0, ...): J -> [[1/4, -1/4], [-1/4, 1/4]] / T, spectral norm 1 / (2T).
    logits = torch.tensor([[1.0, 1.0, -1.0, -1.5]], dtype=torch.float64)
    spectral, _ = jacobian_norms(attnorm.Softmax(temperature=temperature), logits)
    expected = torch.linalg.matrix_norm(softmax_jacobian(logits, temperature), ord=2)
    assert spectral.item() == pytest.approx(expected.item(), rel=1e-9)
    if temperature <= 0.1:
        assert spectral.item() == pytest.approx(1 / (2 * temperature), rel=1e-3)


def test_masked_positions_have_zero_jacobian():
    logits = torch.randn(2, 5, dtype=torch.float64)
    mask = torch.tensor([True, True, False, True, False])
    matrix = jacobian(attnorm.Softmax(), logits, mask)
    assert (matrix[..., ~mask, :] == 0).all() and (matrix[..., :, ~mask] == 0).all()
    allowed = logits[:, mask]
    assert torch.allclose(matrix[:, mask][:, :, mask], softmax_jacobian(allowed))


def test_finite_difference_small_eps_matches_jacobian():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 8, generator=generator, dtype=torch.float64)
    direction = torch.randn(5, 8, generator=generator, dtype=torch.float64)
    unit = direction / direction.norm(dim=-1, keepdim=True)
    temperature = 0.3
    expected = (softmax_jacobian(logits, temperature) @ unit.unsqueeze(-1)).squeeze(-1).norm(dim=-1)
    got = finite_difference_sensitivity("softmax", logits, 1e-7, temperature=temperature, direction=direction)
    # g = ||a((l + eps v)/T) - a(l/T)|| / eps -> ||J_{l/T} v / T|| = ||J_T v||.
    assert torch.allclose(got, expected, rtol=1e-5)


def test_finite_difference_uniform_logits_scale_as_one_over_temperature():
    direction = torch.tensor([[1.0, -2.0, 0.5, 0.0]], dtype=torch.float64)
    unit = direction / direction.norm()
    centred = (unit - unit.mean()).norm().item()
    for temperature in (1.0, 0.1, 0.01):
        got = finite_difference_sensitivity(
            "softmax", torch.zeros(1, 4), 1e-8, temperature=temperature, direction=direction
        )
        assert got.item() == pytest.approx(centred / (4 * temperature), rel=1e-4)


def test_finite_difference_large_eps_is_bounded():
    # ||a - b||_2 <= sqrt(2) for two probability vectors.
    logits = torch.randn(50, 16, dtype=torch.float64)
    generator = torch.Generator().manual_seed(1)
    got = finite_difference_sensitivity("softmax", logits, 10.0, temperature=1e-3, generator=generator)
    assert (got <= math.sqrt(2) / 10 + 1e-12).all()


def test_argument_errors():
    with pytest.raises(ValueError, match="eps"):
        finite_difference_sensitivity("softmax", torch.zeros(1, 3), 0.0)
    with pytest.raises(ValueError, match="temperature"):
        finite_difference_sensitivity("softmax", torch.zeros(1, 3), 1.0, temperature=-1.0)
    with pytest.raises(ValueError, match="dim=-1"):
        jacobian(attnorm.Softmax(dim=0), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="mask"):
        jacobian(lambda x: x, torch.zeros(2, 3), torch.ones(3, dtype=torch.bool))
