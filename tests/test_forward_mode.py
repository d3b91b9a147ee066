"""Forward-mode derivatives of attention (``torch.func.jvp``, ``torch.autograd.forward_ad``).

The fused, split-K and blocked-recompute kernels have no JVP: while a forward-mode derivative
may be taken, :func:`attnorm.attention` takes the row routes (differentiated on the reference)
and SDPA's math kernel.  Tangents are checked against central differences in float64, never
against attnorm itself.
"""

from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as forward_ad

import attnorm
from attnorm.routes import decoding, fused
from tests.conftest import DEVICE, central_difference

NAMES = ["softmax", "softmax:temperature=0.7", "ssmax", "ssmax:learnable=true,num_heads=2", "sparsemax", "entmax",
         "entmax:alpha=1.3", "topk:k=3", "sa_softmax", "sa_softmax:normalized=false", "relu", "softmax1",
         "taylor:n=2", "sigmoid", "l2norm"]


def _inputs(lq: int, lk: int, seed: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 2, lq, 8, generator=generator, dtype=torch.float64)
    k, v = torch.randn(2, 1, 2, lk, 8, generator=generator, dtype=torch.float64).unbind(0)
    return q, k, v


def _tangents(f, primals, tangents):
    through_func = torch.func.jvp(f, primals, tangents)[1]
    with forward_ad.dual_level():
        out = f(*(forward_ad.make_dual(p, t) for p, t in zip(primals, tangents, strict=True)))
        through_dual = forward_ad.unpack_dual(out).tangent
    return through_func, through_dual


@pytest.mark.parametrize("route", ["materialised", "blocked"])
@pytest.mark.parametrize("name", NAMES)
def test_attention_tangents_equal_central_differences(name, route, request):
    """Every normalizer, causal with Lq < Lk (bottom-right), on the default backend: SDPA's fused CPU kernel has
    no forward AD (softmax, Scalable-Softmax and L2-norm raised); the blocked route's Function had no JVP."""
    if route == "blocked":
        request.getfixturevalue("force_blocked")
    normalizer = attnorm.make(name).double()
    primals, tangents = _inputs(5, 7, 0), _inputs(5, 7, 1)

    def f(q, k, v):
        return attnorm.attention(q, k, v, normalizer, is_causal=True)

    central = central_difference(f, primals, tangents)
    for tangent in _tangents(f, primals, tangents):
        assert tangent is not None
        torch.testing.assert_close(tangent, central, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("lq", [1, 20], ids=["decoding", "prefill"])
@pytest.mark.parametrize("name", ["sparsemax", "entmax:alpha=1.3", "topk:k=3", "sa_softmax"])
def test_where_the_kernels_would_run_forward_mode_takes_the_reference(name, lq, monkeypatch):
    """As on CUDA with backend="auto" (Triton said to run): before, the fused route raised torch's "implement
    the jvp" error, and the split-K decoding kernel (Self-Adjusted) returned no tangent at all."""
    def runs_triton(normalizer, q):
        return normalizer.backend != "reference"

    monkeypatch.setattr(fused, "_runs_triton", runs_triton)
    monkeypatch.setattr(decoding, "_runs_triton", runs_triton)
    normalizer, oracle = attnorm.make(name).double(), attnorm.make(name).double()
    oracle.backend = "reference"
    primals, tangents = _inputs(lq, 20, 2), _inputs(lq, 20, 3)

    def f(q, k, v):
        return attnorm.attention(q, k, v, normalizer)

    central = central_difference(lambda q, k, v: attnorm.attention(q, k, v, oracle), primals, tangents)
    for tangent in _tangents(f, primals, tangents):
        assert tangent is not None
        torch.testing.assert_close(tangent, central, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("lq", [1, 20], ids=["decoding", "prefill"])
@pytest.mark.parametrize("name", ["sparsemax", "sa_softmax"])
def test_forward_mode_with_triton_asked_for_by_name_is_a_clear_error(name, lq):
    normalizer = attnorm.make(name)
    normalizer.backend = "triton"
    primals = tuple(t.to(DEVICE, torch.float32) for t in _inputs(lq, 20, 4))
    tangents = tuple(t.to(DEVICE, torch.float32) for t in _inputs(lq, 20, 5))

    def f(q, k, v):
        return attnorm.attention(q, k, v, normalizer)

    with pytest.raises(NotImplementedError, match="backend='triton'"):
        torch.func.jvp(f, primals, tangents)
    with pytest.raises(NotImplementedError, match="backend='triton'"), forward_ad.dual_level():
        f(*(forward_ad.make_dual(p, t) for p, t in zip(primals, tangents, strict=True)))
