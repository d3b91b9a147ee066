"""``sink=``: every kernel-backed normalizer with a virtual key per row, on every backend, against float64 formulas.

The reference appends the sink's score to each row's allowed scores and applies the
normalizer's independent float64 reference (:mod:`tests.normalizers.references`,
which never calls attnorm) to that extended row, then drops the sink's weight.  Two
rules make it more than "one more key": Scalable-Softmax's ``n`` and top-k's
fraction count the real allowed keys only, and an integer ``k`` counts slots over the
real keys and the sink.  Gradients (scores, sink, learnable parameters) are compared
with autograd through the same float64 formulas.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

import attnorm
from attnorm import functional as F
from tests.conftest import DEVICE, slow_under_interpreter
from tests.normalizers.references import CASES, Case, topk_count

TRITON = importlib.util.find_spec("triton") is not None
BACKENDS = ["reference"] + ["native"] * (DEVICE == "cpu") + ["triton"] * TRITON

KERNEL_CASES = [case for case in CASES if case.build().kernel]
SHAPE = (2, 3, 4, 6)  # (B, H, Lq, Lk): a sink per head, broadcast over batch and queries


def _sink_reference(case: Case, values: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """The case's float64 formula on one row's allowed ``values`` and the sink, the sink's weight dropped."""
    n = values.shape[-1]
    extended = torch.cat([values, sink.reshape(1)])
    if case.name.startswith("ssmax"):  # n counts the real keys only
        multiplier = 0.6 * math.log(max(n, 1)) + 0.1
        return torch.softmax(multiplier * extended, -1)[:-1]
    if case.name.startswith("topk"):
        k, temperature = (3, 1.0) if case.name == "topk3" else (0.4, 2.0)
        slots = min(k, n + 1) if isinstance(k, int) else max(1, topk_count(k, n))
        order = torch.argsort(extended.detach(), descending=True, stable=True)  # the sink is last: loses ties
        kept = torch.argsort(order) < slots
        return torch.softmax(torch.where(kept, extended / temperature, -math.inf), -1)[:-1]
    return case.reference(extended)[:-1]


def reference_with_sink(case: Case, x: torch.Tensor, allowed: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """Row by row: the allowed scores and the sink through :func:`_sink_reference`, zeros elsewhere."""
    rows = x.double().reshape(-1, x.shape[-1])
    keep = allowed.expand(x.shape).reshape(-1, x.shape[-1])
    sinks = sink.double().expand(*x.shape[:-1], 1).reshape(-1)
    out = []
    for values, row_allowed, row_sink in zip(rows, keep, sinks, strict=True):
        row = torch.zeros_like(values)
        out.append(row.index_put((row_allowed.nonzero()[:, 0],), _sink_reference(case, values[row_allowed], row_sink)))
    return torch.stack(out).reshape(x.shape)


MASKS = {
    "none": lambda: (None, torch.ones(SHAPE[-2:], dtype=torch.bool)),
    "bool": lambda: (_random_mask(), _random_mask()),
    "causal": lambda: (attnorm.causal_mask(), torch.ones(SHAPE[-2:], dtype=torch.bool).tril()),
}


def _random_mask() -> torch.Tensor:
    mask = torch.rand(SHAPE[-2:], generator=torch.Generator().manual_seed(3)) > 0.4
    mask[1] = False  # a row with no real key: the sink takes everything
    return mask


def _inputs(seed: int = 0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(SHAPE, generator=gen, dtype=torch.float64) * 2).to(DEVICE, dtype).requires_grad_()
    sink = torch.tensor([0.4, -1.3, 2.1], dtype=torch.float64).reshape(1, 3, 1, 1).to(DEVICE, dtype)
    return x, sink.requires_grad_()


# Under the interpreter the Triton modules run under a causal mask; the kernel-level grid
# (tests/kernels/test_triton_sinks.py) covers the other masks, -m slow runs them here.
EXTENDED_ROW_CASES = [
    pytest.param(case, backend, mask_kind, id=f"{case!r}-{backend}-{mask_kind}",
                 marks=slow_under_interpreter(backend != "triton" or mask_kind == "causal"))
    for case in KERNEL_CASES for backend in BACKENDS for mask_kind in MASKS
]


@pytest.mark.parametrize(("case", "backend", "mask_kind"), EXTENDED_ROW_CASES)
def test_sink_matches_the_extended_row_formula(case, backend, mask_kind):
    x, sink = _inputs()
    mask, allowed = MASKS[mask_kind]()
    mask = mask.to(DEVICE) if isinstance(mask, torch.Tensor) else mask
    out = case.functional(x, mask=mask, backend=backend, sink=sink)
    expected = reference_with_sink(case, x.cpu(), allowed, sink.cpu())
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-9, atol=1e-11)
    cotangent = torch.randn(SHAPE, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    got = torch.autograd.grad(out, (x, sink), cotangent.to(DEVICE))
    wanted = torch.autograd.grad(expected, (x, sink), cotangent)
    for name, actual, reference in zip(("dx", "dsink"), got, wanted, strict=True):
        torch.testing.assert_close(actual.cpu(), reference, rtol=1e-7, atol=1e-9, msg=name)


LOW_PRECISION_CASES = [  # the Triton modules in bfloat16 by default (float32 with -m slow)
    pytest.param(case, backend, dtype, id=f"{case!r}-{backend}-{str(dtype).removeprefix('torch.')}",
                 marks=slow_under_interpreter(backend != "triton" or dtype == torch.bfloat16))
    for case in KERNEL_CASES for backend in BACKENDS for dtype in (torch.float32, torch.bfloat16)
]


@pytest.mark.parametrize(("case", "backend", "dtype"), LOW_PRECISION_CASES)
def test_sink_in_low_precision_is_close_to_float64(case, backend, dtype):
    x, sink = _inputs(seed=1, dtype=dtype)
    out = case.functional(x, backend=backend, sink=sink)
    assert out.dtype == dtype
    expected = reference_with_sink(case, x.detach().cpu(), torch.ones(SHAPE[-2:], dtype=torch.bool), sink.cpu())
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.detach().cpu().double(), expected.detach(), rtol=tolerance, atol=tolerance)
    dx, dsink = torch.autograd.grad(out.sum(), (x, sink))
    assert dx.dtype == dtype and dsink.dtype == dtype
    assert torch.isfinite(dx).all() and torch.isfinite(dsink).all()


# Under the interpreter the second top-k and entmax cases add 12 s and no kernel path: -m slow.
SINK_SPECIAL_VALUE_CASES = [
    pytest.param(case, backend, id=f"{case!r}-{backend}",
                 marks=slow_under_interpreter(backend != "triton" or repr(case) not in ("topk0.4_T2", "entmax1.3")))
    for case in KERNEL_CASES for backend in BACKENDS
]


@pytest.mark.parametrize(("case", "backend"), SINK_SPECIAL_VALUE_CASES)
def test_a_minus_inf_sink_is_no_sink_and_a_nan_sink_makes_the_row_nan(case, backend):
    x, _ = _inputs(seed=2)
    x = x.detach()
    no_sink = case.functional(x, backend=backend)
    sink = torch.full((1, 3, 1, 1), -math.inf, dtype=x.dtype, device=DEVICE)
    torch.testing.assert_close(case.functional(x, backend=backend, sink=sink), no_sink, rtol=0, atol=0)
    sink[0, 1] = math.nan
    out = case.functional(x, backend=backend, sink=sink)
    assert out[:, 1].isnan().all()
    torch.testing.assert_close(out[:, [0, 2]], no_sink[:, [0, 2]], rtol=0, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_topk_sink_loses_ties_and_takes_a_slot_when_larger(backend):
    x = torch.tensor([[3.0, 1.0, 2.0, 2.0]], dtype=torch.float64, device=DEVICE)
    tied = F.topk_softmax(x, 3, backend=backend, sink=2.0)  # slots: 3.0, then the two 2.0 keys; the sink loses
    expected = torch.softmax(torch.tensor([3.0, 2.0, 2.0], dtype=torch.float64), -1)
    torch.testing.assert_close(tied.cpu(), torch.stack([expected[0], x.new_zeros(()).cpu(), *expected[1:]])[None])
    larger = F.topk_softmax(x, 2, backend=backend, sink=2.5)  # keeps 3.0 and the sink
    weights = torch.softmax(torch.tensor([3.0, 2.5], dtype=torch.float64), -1)
    torch.testing.assert_close(larger.cpu(), torch.tensor([[weights[0], 0.0, 0.0, 0.0]], dtype=torch.float64))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_zero_sink_with_softmax_is_softmax_one(backend):
    x, _ = _inputs(seed=4)
    exps = torch.exp(x.detach().cpu())
    expected = exps / (1 + exps.sum(-1, keepdim=True))
    torch.testing.assert_close(F.softmax(x, backend=backend, sink=0.0).detach().cpu(), expected)


@pytest.mark.parametrize("backend", BACKENDS)
def test_learnable_parameters_get_their_sink_terms(backend):
    x, sink = _inputs(seed=6)
    s = torch.tensor([0.5, 0.7, 0.9], dtype=torch.float64, device=DEVICE).reshape(1, 3, 1, 1).requires_grad_()
    temperature = torch.tensor([0.6, 1.0, 1.7], dtype=torch.float64, device=DEVICE).reshape(1, 3, 1, 1)
    temperature.requires_grad_()
    out = F.scalable_softmax(x, s=s, bias=0.1, backend=backend, sink=sink) + F.softmax(
        x, temperature=temperature, backend=backend, sink=sink)
    n = SHAPE[-1]
    extended = torch.cat([x, sink.expand(*SHAPE[:-1], 1)], -1)
    expected = (torch.softmax((s * math.log(n) + 0.1) * extended, -1)
                + torch.softmax(extended / temperature, -1))[..., :-1]
    torch.testing.assert_close(out, expected)
    got = torch.autograd.grad(out.sum(), (s, temperature, sink))
    wanted = torch.autograd.grad(expected.sum(), (s, temperature, sink))
    for name, actual, reference in zip(("ds", "dT", "dsink"), got, wanted, strict=True):
        torch.testing.assert_close(actual, reference, msg=name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_learnable_alpha_gets_its_sink_term(backend):
    x, sink = _inputs(seed=7)
    alpha = torch.tensor([1.3, 1.5, 1.8], dtype=torch.float64, device=DEVICE).reshape(1, 3, 1, 1).requires_grad_()
    out = F.entmax(x, alpha=alpha, backend=backend, sink=sink)
    # Independent: the reference backend's entmax on the extended row (autograd through its closed forms).
    extended = torch.cat([x, sink.expand(*SHAPE[:-1], 1)], -1)
    expected = F.entmax(extended, alpha=alpha, backend="reference")[..., :-1]
    torch.testing.assert_close(out, expected)
    got = torch.autograd.grad(out.sum() + (out * out).sum(), (x, alpha, sink))
    wanted = torch.autograd.grad(expected.sum() + (expected * expected).sum(), (x, alpha, sink))
    for name, actual, reference in zip(("dx", "dalpha", "dsink"), got, wanted, strict=True):
        torch.testing.assert_close(actual, reference, msg=name)


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "reference"])
@pytest.mark.parametrize("name", ["softmax_T0.7", "ssmax_s0.6_b0.1", "entmax1.5"])
def test_double_backward_through_the_sink(name, backend):
    case = next(case for case in KERNEL_CASES if case.name == name)
    x = torch.randn(2, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    sink = torch.tensor([[0.3], [-0.8]], dtype=torch.float64, device=DEVICE)
    x.requires_grad_()
    sink.requires_grad_()
    assert torch.autograd.gradgradcheck(lambda x, sink: case.functional(x, backend=backend, sink=sink), (x, sink))


def test_module_forward_takes_a_sink_and_compiles_without_graph_breaks():
    module = attnorm.Entmax(alpha=1.5)
    x, sink = _inputs(seed=9)

    def run(x, sink):
        return module(x, attnorm.causal_mask(), sink=sink)

    assert torch._dynamo.explain(run)(x, sink).graph_break_count == 0
    torch._dynamo.reset()
    compiled = torch.compile(run, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x, sink), run(x, sink))


def test_vmap_over_a_sink():
    x, _ = _inputs(seed=10)
    sinks = torch.tensor([0.1, 0.9], dtype=torch.float64, device=DEVICE)
    batched = torch.func.vmap(lambda s: F.sparsemax(x.detach(), sink=s.reshape(1, 1, 1, 1)))(sinks)
    for out, s in zip(batched, sinks, strict=True):
        torch.testing.assert_close(out, F.sparsemax(x.detach(), sink=s.reshape(1, 1, 1, 1)))


@pytest.mark.parametrize(
    "sink,error,match",
    [
        (torch.zeros(1, 3, 1, 6, dtype=torch.int64), TypeError, "sink"),
        (torch.zeros(1, 3, 1, 6), ValueError, "sink must be constant along dim"),
        (torch.zeros(5, 1, 1), ValueError, "sink of shape"),
        ("0", TypeError, "sink"),
    ],
)
def test_a_bad_sink_names_the_argument(sink, error, match):
    with pytest.raises(error, match=match):
        F.softmax(torch.zeros(SHAPE), sink=sink)


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "reference"])
def test_double_backward_with_a_per_head_sink_and_learnable_parameters(backend):
    """The recorded backward extends rows by a sink broadcast over batch and queries (a per-head column)."""
    x, sink = _inputs(seed=11)
    grads = {}
    for name in (backend, "reference"):
        module = attnorm.ScalableSoftmax(learnable=True, num_heads=3, backend=name).double().to(DEVICE)
        out = module(x, attnorm.causal_mask(), sink=sink)
        (dx,) = torch.autograd.grad(out.square().sum(), x, create_graph=True)
        grads[name] = torch.autograd.grad(dx.square().sum(), (x, sink, module.s, module.bias))
    for name, actual, reference in zip(("x", "sink", "s", "bias"), grads[backend], grads["reference"], strict=True):
        torch.testing.assert_close(actual, reference, msg=name)
