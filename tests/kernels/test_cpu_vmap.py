"""Vectorised Jacobians (torch.func.vmap over the backward) work on the fast CPU path."""

import pytest
import torch
from torch.autograd.functional import jacobian

from attnorm import functional as F

SPARSE = {
    "sparsemax": F.sparsemax,
    "entmax15": F.entmax,
    "entmax1.3": lambda x: F.entmax(x, 1.3),
    "topk": lambda x: F.topk_softmax(x, 5),
}


@pytest.mark.parametrize("name", SPARSE)
@pytest.mark.parametrize("length", [7, 300])
def test_vectorized_jacobian_equals_row_by_row_jacobian(name, length):
    scores = torch.randn(2, length, dtype=torch.float64, generator=torch.Generator().manual_seed(length)) * 0.3
    vectorized = jacobian(SPARSE[name], scores, vectorize=True)
    looped = jacobian(SPARSE[name], scores)
    assert looped.abs().sum() > 0
    torch.testing.assert_close(vectorized, looped, rtol=0, atol=1e-12)
