"""The reproductions of the reliability issue, through the public API, on every backend and dtype.

Each case once gave a silent wrong answer, NaN from finite input, a crash or a
corrupted module; expected values come from float64 math written here or from mpmath.
"""

from __future__ import annotations

import importlib.util
import math

import mpmath
import pytest
import torch

import attnorm
from attnorm import functional as F

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ["reference", *(["native"] if DEVICE == "cpu" else [])]
BACKENDS += ["triton"] if importlib.util.find_spec("triton") else []
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def run(fn, values, dtype=torch.float32, **kwargs):
    x = torch.tensor(values, dtype=torch.float64).to(DEVICE, dtype)
    return fn(x, **kwargs).double().cpu()


def entmax_exact(scores: list[float], alpha: float, digits: int = 60) -> list[float]:
    """alpha-entmax by bisection on the threshold in ``digits``-digit arithmetic."""
    with mpmath.workdps(digits):
        z = [mpmath.mpf(s) * (alpha - 1) for s in scores]
        power = 1 / mpmath.mpf(alpha - 1)
        low, high = max(z) - 1, max(z)
        for _ in range(4 * digits):
            tau = (low + high) / 2
            mass = sum(max(v - tau, 0) ** power for v in z)
            low, high = (tau, high) if mass >= 1 else (low, tau)
        return [float(max(v - low, 0) ** power) for v in z]


# ---- silent wrong answers -------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_sparsemax_near_two_to_the_24_sums_to_one(backend):
    out = run(F.sparsemax, [[2e7, 2e7 - 4, 0.0]], backend=backend)
    torch.testing.assert_close(out, torch.tensor([[1.0, 0.0, 0.0]], dtype=torch.float64))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("alpha", [1.05, 1.3, 2.0, 3.0])
def test_huge_scores_keep_rows_summing_to_one(backend, alpha):
    out = run(F.entmax, [[3e30, 3e30 - 1e24, 0.0, -1e30]], alpha=alpha, backend=backend)
    assert out.sum().item() == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_entmax_with_a_huge_alpha_is_one_hot(backend):
    out = run(F.entmax, [[3.0, 1.0, -2.0]], alpha=1e7, backend=backend)
    torch.testing.assert_close(out, torch.tensor([[1.0, 0.0, 0.0]], dtype=torch.float64), atol=1e-6, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("alpha", [3.0, 10.0])
def test_large_alpha_matches_a_60_digit_bisection(backend, alpha):
    scores = torch.randn(37, generator=torch.Generator().manual_seed(0), dtype=torch.float64).tolist()
    expected = torch.tensor(entmax_exact(scores, alpha), dtype=torch.float64)
    out = run(F.entmax, [scores], dtype=torch.float64, alpha=alpha, backend=backend)[0]
    torch.testing.assert_close(out, expected, atol=1e-9, rtol=0)
    out32 = run(F.entmax, [scores], dtype=torch.float32, alpha=alpha, backend=backend)[0]
    torch.testing.assert_close(out32, expected, atol=2e-6, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_topk_ties_keep_the_lowest_index(backend, dtype):
    row = [1.0, 3.0, 2.0, 3.0, 3.0, 0.0, 3.0]
    out = run(F.topk_softmax, [row], dtype=dtype, k=2, backend=backend)
    torch.testing.assert_close(out, torch.tensor([[0, 0.5, 0, 0.5, 0, 0, 0]], dtype=torch.float64))
    out = run(F.topk_softmax, [row, row[::-1]], dtype=dtype, k=0.4, backend=backend)  # ceil(0.4 * 7) = 3
    assert out[0].nonzero().flatten().tolist() == [1, 3, 4]
    assert out[1].nonzero().flatten().tolist() == [0, 2, 3]


# ---- NaN or inf from finite input ---------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_softmax_temperature_below_one_on_the_largest_floats(backend):
    out = run(F.softmax, [[3e38, 0.0]], temperature=0.5, backend=backend)
    torch.testing.assert_close(out, torch.tensor([[1.0, 0.0]], dtype=torch.float64))


@pytest.mark.parametrize("backend", BACKENDS)
def test_scalable_softmax_on_the_largest_floats_with_either_sign(backend):
    out = run(F.scalable_softmax, [[3e38, 2e38, -3e38]], s=2.0, backend=backend)
    torch.testing.assert_close(out, torch.tensor([[1.0, 0.0, 0.0]], dtype=torch.float64))
    out = run(F.scalable_softmax, [[1e38, 0.0, 0.0, 0.0]], s=-1.0, backend=backend)
    torch.testing.assert_close(out, torch.tensor([[0.0, 1 / 3, 1 / 3, 1 / 3]], dtype=torch.float64))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("normalized", [True, False])
def test_self_adjusted_softmax_on_extreme_and_denormal_scores(backend, normalized):
    out = run(F.self_adjusted_softmax, [[3.06e38, -3.06e38, 0.0]], normalized=normalized, backend=backend)
    assert out.isfinite().all()
    if normalized:
        torch.testing.assert_close(out, torch.tensor([[1.0, 0.0, 0.0]], dtype=torch.float64))
    out = run(F.self_adjusted_softmax, [[1e-40, 3e-40, 0.0, 2e-40]], normalized=normalized, backend=backend)
    assert out.isfinite().all()
    if normalized:  # factors 1/3, 1, 0, 2/3 times a uniform softmax (the scores are ~0)
        expected = torch.tensor([[1 / 3, 1.0, 0.0, 2 / 3]], dtype=torch.float64) / 4
        torch.testing.assert_close(out, expected, atol=1e-6, rtol=0)


def test_a_temperature_whose_reciprocal_overflows_is_rejected():
    with pytest.raises(ValueError, match="temperature"):
        attnorm.Softmax(temperature=1e-39)
    with pytest.raises(ValueError, match="temperature"):
        F.softmax(torch.zeros(2, 3), temperature=1e-39)


# ---- crashes ---------------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::torch.jit.TracerWarning")
@pytest.mark.parametrize("module", [attnorm.Softmax(), attnorm.Sparsemax(), attnorm.Entmax(1.3)], ids=repr)
def test_jit_trace_neither_crashes_nor_hangs(module):
    x = torch.randn(3, 5, device=DEVICE)
    traced = torch.jit.trace(module, x, check_trace=False)
    y = torch.randn(3, 5, device=DEVICE)
    torch.testing.assert_close(traced(y), module(y))


DEVICE_CONTEXT_MODULES = {
    "softmax": lambda backend: attnorm.Softmax(0.7, backend=backend),
    "ssmax": lambda backend: attnorm.ScalableSoftmax(learnable=True, backend=backend),
    "sparsemax": lambda backend: attnorm.Sparsemax(backend=backend),
    "entmax": lambda backend: attnorm.Entmax(1.3, learnable=True, backend=backend),
    "topk": lambda backend: attnorm.TopKSoftmax(k=2, backend=backend),
    "sa": lambda backend: attnorm.SelfAdjustedSoftmax(backend=backend),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", DEVICE_CONTEXT_MODULES)
def test_a_device_context_does_not_move_the_kernels_buffers(name, backend):
    """``with torch.device("meta")`` around a call on real tensors (a model built under a device
    context): the native kernels allocated per-row outputs on the meta device and C wrote
    through their pointers (a segfault); every backend now gives what it gives outside."""
    module = DEVICE_CONTEXT_MODULES[name](backend).to(DEVICE, torch.float64)
    x = torch.randn(3, 6, device=DEVICE, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(3, 6, device=DEVICE, dtype=torch.float64)

    def weights_and_grads():
        y = module(x, attnorm.causal_mask(), sink=0.5)
        return (y, *torch.autograd.grad(y, [x, *module.parameters()], upstream))

    expected = weights_and_grads()
    with torch.device("meta"):
        got = weights_and_grads()
    for value, reference in zip(got, expected, strict=True):
        assert value.device == reference.device
        torch.testing.assert_close(value, reference, rtol=0, atol=0)


# ---- state and validation --------------------------------------------------------------------------


def test_failed_load_state_dict_leaves_the_module_unchanged():
    module = attnorm.ScalableSoftmax(learnable=True, num_heads=2)
    before = {name: value.clone() for name, value in module.state_dict().items()}
    bad = {"s": torch.tensor([[[math.nan]], [[1.0]]]), "bias": torch.zeros(2, 1, 1)}
    with pytest.raises(ValueError, match="s must be finite"):
        module.load_state_dict(bad)
    for name, value in module.state_dict().items():
        assert torch.equal(value, before[name])
    entmax = attnorm.Entmax(alpha=1.5, num_heads=2)
    with pytest.raises(ValueError, match="alpha"):
        entmax.load_state_dict({"fixed_alpha": torch.tensor([[[0.5]], [[1.5]]])})
    assert entmax.fixed_alpha.flatten().tolist() == [1.5, 1.5]


@pytest.mark.parametrize(
    ("module", "name", "value", "message"),
    [
        (attnorm.Softmax(), "temperature", -1.0, "temperature"),
        (attnorm.TopKSoftmax(k=3), "k", 0, "k must be"),
        (attnorm.TopKSoftmax(k=3), "temperature", 0.0, "temperature"),
        (attnorm.ScalableSoftmax(), "s", math.inf, "s must be finite"),
        (attnorm.Entmax(), "alpha", 0.5, "alpha"),
        (attnorm.SelfAdjustedSoftmax(), "normalized", 1, "normalized"),
    ],
    ids=lambda value: value if isinstance(value, str) else None,
)
def test_assignment_is_validated_like_the_constructor(module, name, value, message):
    before = getattr(module, name)
    with pytest.raises((ValueError, TypeError), match=message):
        setattr(module, name, value)
    assert getattr(module, name) == before


def test_a_mask_on_another_device_is_a_clear_error():
    with pytest.raises(ValueError, match="mask is on meta"):
        F.softmax(torch.zeros(2, 3), mask=torch.ones(2, 3, dtype=torch.bool, device="meta"))
