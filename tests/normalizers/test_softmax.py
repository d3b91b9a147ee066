"""Softmax with temperature against torch.softmax(x / T)."""

from __future__ import annotations

import pytest
import torch
from torch.autograd import gradcheck, gradgradcheck

import attnorm
from attnorm import functional as F


@pytest.mark.parametrize("temperature", [0.05, 0.5, 1.0, 3.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_matches_torch_softmax_of_scaled_scores(temperature, dtype):
    x = torch.randn(2, 4, 6, 9, dtype=dtype)
    expected = torch.softmax(x.double() / temperature, dim=-1).to(dtype)
    torch.testing.assert_close(attnorm.Softmax(temperature)(x), expected)
    torch.testing.assert_close(F.softmax(x, temperature=temperature), expected)


def test_default_is_plain_softmax_on_every_dim():
    x = torch.randn(3, 5, 7, dtype=torch.float64)
    for dim in range(3):
        torch.testing.assert_close(attnorm.Softmax(dim=dim)(x), torch.softmax(x, dim=dim))


def test_per_head_temperature_tensor():
    heads = 3
    x = torch.randn(2, heads, 4, 6, dtype=torch.float64)
    temperature = torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64).reshape(heads, 1, 1)
    out = F.softmax(x, temperature=temperature)
    for head in range(heads):
        torch.testing.assert_close(out[:, head], torch.softmax(x[:, head] / temperature[head], dim=-1))


def test_gradients_in_scores_and_temperature():
    x = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    temperature = torch.tensor([0.7, 1.3], dtype=torch.float64).reshape(2, 1, 1).requires_grad_(True)
    fn = lambda scores, temp: F.softmax(scores, temperature=temp)
    assert gradcheck(fn, (x, temperature))
    assert gradgradcheck(fn, (x, temperature))
