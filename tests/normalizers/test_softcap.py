"""``softcap=``: every kernel-backed normalizer on soft-capped scores, on every backend, against float64 formulas.

The reference caps the scores in float64 (``cap tanh(x / cap)``, -inf kept) and applies the
normalizer's independent reference (:mod:`tests.normalizers.references`; with a sink, the
extended-row formula of :mod:`tests.normalizers.test_sinks`).  Gradients go through the
same float64 formulas with autograd, so the cap's slope ``1 - tanh^2`` is checked too.
"""

from __future__ import annotations

import math

import pytest
import torch

import attnorm
from tests.conftest import DEVICE, slow_under_interpreter
from tests.normalizers.references import reference_masked
from tests.normalizers.test_sinks import BACKENDS, KERNEL_CASES, SHAPE, reference_with_sink

CAP = 2.5


def capped(x: torch.Tensor, cap: float = CAP) -> torch.Tensor:
    return torch.where(x == -math.inf, x, cap * torch.tanh(x / cap))


def _inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(SHAPE, generator=gen, dtype=torch.float64) * 4).to(DEVICE).requires_grad_()
    sink = torch.tensor([0.4, -1.3, 2.1], dtype=torch.float64).reshape(1, 3, 1, 1).to(DEVICE).requires_grad_()
    return x, sink


# Under the interpreter the Triton modules run capped with a sink under a causal mask; the
# kernel-level grid (tests/kernels/test_triton_softcap.py) covers the rest, -m slow runs it here.
SOFTCAP_CASES = [
    pytest.param(case, backend, causal, with_sink,
                 id=f"{case!r}-{backend}-{('all', 'causal')[causal]}-{('plain', 'sink')[with_sink]}",
                 marks=slow_under_interpreter(backend != "triton" or causal and with_sink))
    for case in KERNEL_CASES for backend in BACKENDS for causal in (False, True) for with_sink in (False, True)
]


@pytest.mark.parametrize(("case", "backend", "causal", "with_sink"), SOFTCAP_CASES)
def test_softcap_matches_the_capped_formula(case, backend, causal, with_sink):
    x, sink = _inputs()
    mask = attnorm.causal_mask() if causal else None
    allowed = torch.ones(SHAPE[-2:], dtype=torch.bool)
    allowed = allowed.tril() if causal else allowed
    out = case.functional(x, mask=mask, backend=backend, softcap=CAP, sink=sink if with_sink else None)
    scores = capped(x.cpu())
    if with_sink:
        expected = reference_with_sink(case, scores, allowed, sink.cpu())
    else:
        expected = reference_masked(case, scores, allowed)
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-9, atol=1e-11)
    cotangent = torch.randn(SHAPE, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    inputs = (x, sink) if with_sink else (x,)
    got = torch.autograd.grad(out, inputs, cotangent.to(DEVICE))
    wanted = torch.autograd.grad(expected, inputs, cotangent)
    for name, actual, reference in zip(("dx", "dsink"), got, wanted, strict=False):
        torch.testing.assert_close(actual.cpu(), reference, rtol=1e-7, atol=1e-9, msg=name)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", KERNEL_CASES, ids=repr)
def test_softcap_keeps_minus_inf_masked_and_caps_plus_inf(case, backend):
    x = torch.tensor([[1.0, -math.inf, 3.0, 0.5], [math.inf, 2.0, -1.0, 1e30]], dtype=torch.float64)
    out = case.functional(x.to(DEVICE), backend=backend, softcap=CAP).cpu()
    allowed = x != -math.inf
    torch.testing.assert_close(out, reference_masked(case, capped(x).masked_fill(~allowed, 0.0), allowed))
    assert out[0, 1] == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_softcap_in_low_precision_is_close_to_float64(backend):
    x, _ = _inputs(seed=3)
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        low = x.detach().to(dtype).requires_grad_()
        out = attnorm.functional.entmax(low, alpha=1.5, backend=backend, softcap=CAP)
        expected = attnorm.functional.entmax(capped(low.detach().double()), alpha=1.5, backend="reference")
        assert out.dtype == dtype
        torch.testing.assert_close(out.double(), expected, rtol=tolerance, atol=tolerance)
        (dx,) = torch.autograd.grad(out.sum(), low)
        assert dx.dtype == dtype and torch.isfinite(dx).all()


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "reference"])
@pytest.mark.parametrize("name", ["softmax_T0.7", "ssmax_s0.6_b0.1", "entmax1.5", "sa_softmax"])
def test_double_backward_through_the_cap(name, backend):
    case = next(case for case in KERNEL_CASES if case.name == name)
    x = (torch.randn(2, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(8)) * 3).to(DEVICE)
    x.requires_grad_()
    assert torch.autograd.gradgradcheck(lambda x: case.functional(x, backend=backend, softcap=CAP), (x,))


def test_learnable_scalable_softmax_gets_the_capped_scores_gradient():
    module = attnorm.ScalableSoftmax(s=0.5, bias=0.2, learnable=True, num_heads=3).double()
    x, sink = _inputs(seed=9)
    out = module(x, attnorm.causal_mask(), softcap=CAP, sink=sink)
    s, bias = (p.detach().clone().requires_grad_() for p in (module.s, module.bias))  # (3, 1, 1) each
    n = torch.arange(1, SHAPE[-2] + 1, dtype=torch.float64).reshape(-1, 1)  # causal: query i sees i + 1 keys
    allowed = torch.ones(SHAPE[-2], SHAPE[-1] + 1, dtype=torch.bool).tril()
    allowed[:, -1] = True  # the sink
    extended = torch.cat([capped(x), sink.expand(*SHAPE[:-1], 1)], -1)  # the sink is scaled, not capped
    logits = ((s * torch.log(n) + bias) * extended).masked_fill(~allowed, -math.inf)  # masked after scaling
    expected = torch.softmax(logits, -1)[..., :-1]
    torch.testing.assert_close(out, expected)
    got = torch.autograd.grad(out.sum() + out.square().sum(), (x, sink, module.s, module.bias))
    wanted = torch.autograd.grad(expected.sum() + expected.square().sum(), (x, sink, s, bias))
    for name, actual, reference in zip(("dx", "dsink", "ds", "dbias"), got, wanted, strict=True):
        torch.testing.assert_close(actual, reference, msg=name)


def test_the_blocked_route_caps_inside_the_row_kernels(monkeypatch, force_blocked):
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 5, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    expected = attnorm.attention(q, k, v, "sparsemax", is_causal=True, softcap=1.5)
    scores = 1.5 * torch.tanh(q @ k.transpose(-2, -1) / math.sqrt(8) / 1.5)
    weights = attnorm.functional.sparsemax(scores, mask=attnorm.causal_mask(), backend="reference")
    torch.testing.assert_close(expected, weights @ v)

    def no_torch_tanh(*args, **kwargs):
        raise AssertionError("the cap ran in torch")

    monkeypatch.setattr(torch, "tanh", no_torch_tanh)
    torch.testing.assert_close(attnorm.attention(q, k, v, "sparsemax", is_causal=True, softcap=1.5), expected)


@pytest.mark.parametrize("softcap", [0.0, -1.0, math.inf, math.nan, True, "1"])
def test_a_bad_softcap_names_the_argument(softcap):
    with pytest.raises(ValueError, match="softcap"):
        attnorm.functional.softmax(torch.zeros(2, 3), softcap=softcap)
