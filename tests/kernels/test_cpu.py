"""The fast CPU path (attnorm.kernels.cpu) against the torch reference (attnorm.kernels.old_reference).

Every row operation, every mask kind, float64 and float32: forward and backward
(including the gradients of tensor parameters) must match the reference within
1e-5 (float32) or 1e-10 (float64), and so must the rows the fast path hands back
to the reference (fully masked, +inf, NaN).  The comparisons run under both
implementations of the row kernels (the ``kernels`` fixture): the native C
kernels and the torch-only ones.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from torch.autograd import gradcheck, gradgradcheck

import attnorm
from attnorm import functional as F
from attnorm.kernels import dispatch, old_reference as reference
from attnorm.kernels import fast_cpu as cpu
from attnorm.kernels.cpu import native

B, H, LQ = 2, 3, 5
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}


def native_available() -> bool:
    return native.usable(torch.zeros(1))


@pytest.fixture(params=["native", "torch-only"])
def kernels(request):
    """Runs a test under each implementation of the row kernels.

    :func:`cpu._kernels` takes the native ones where ``native.usable`` allows (and
    no parameter needs a gradient); inside ``native.disabled()`` it refuses.
    """
    if request.param == "native" and not native_available():
        pytest.skip(f"native kernels unavailable: {native.build_info().get('reason')}")
    with native.disabled() if request.param == "torch-only" else contextlib.nullcontext():
        expected = cpu._NATIVE if request.param == "native" else cpu._TORCH_ONLY
        assert cpu._kernels(torch.zeros(2, 3)) is expected
        yield


def scores(length: int, dtype: torch.dtype, seed: int = 0, scale: float = 2.0, queries: int = LQ) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, queries, length, generator=generator, dtype=torch.float64) * scale).to(dtype)


def per_head(values: list[float], dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype).reshape(H, 1, 1)


# (name, fast op, reference op, params builder(dtype) -> dict)
OPS = [
    ("softmax", cpu.softmax_rows, reference.softmax_rows, lambda d: {}),
    ("softmax-T", cpu.softmax_rows, reference.softmax_rows, lambda d: {"temperature": 0.6}),
    (
        "softmax-T-heads",
        cpu.softmax_rows,
        reference.softmax_rows,
        lambda d: {"temperature": per_head([0.5, 1.0, 2.0], d)},
    ),
    ("ssmax", cpu.scalable_softmax_rows, reference.scalable_softmax_rows, lambda d: {"s": 0.43, "bias": 0.1}),
    (
        "ssmax-heads",
        cpu.scalable_softmax_rows,
        reference.scalable_softmax_rows,
        lambda d: {"s": per_head([0.3, 0.5, -0.2], d), "bias": per_head([0.0, 0.2, 0.1], d)},
    ),
    ("sa", cpu.self_adjusted_softmax_rows, reference.self_adjusted_softmax_rows, lambda d: {"normalized": True}),
    ("sa-plain", cpu.self_adjusted_softmax_rows, reference.self_adjusted_softmax_rows, lambda d: {"normalized": False}),
    ("sparsemax", cpu.sparsemax_rows, reference.sparsemax_row_op, lambda d: {}),
    ("entmax1.5", cpu.entmax_rows, reference.entmax_row_op, lambda d: {"alpha": 1.5}),
    ("entmax1.25", cpu.entmax_rows, reference.entmax_row_op, lambda d: {"alpha": 1.25}),
    ("entmax1.7", cpu.entmax_rows, reference.entmax_row_op, lambda d: {"alpha": 1.7}),
    ("entmax2.5", cpu.entmax_rows, reference.entmax_row_op, lambda d: {"alpha": 2.5}),
    ("entmax-heads", cpu.entmax_rows, reference.entmax_row_op, lambda d: {"alpha": per_head([1.2, 1.5, 1.9], d)}),
    ("topk3", cpu.topk_softmax_rows, reference.topk_softmax_rows, lambda d: {"k": 3, "temperature": 0.8}),
    ("topk0.2", cpu.topk_softmax_rows, reference.topk_softmax_rows, lambda d: {"k": 0.2}),
    (
        "topk-T-heads",
        cpu.topk_softmax_rows,
        reference.topk_softmax_rows,
        lambda d: {"k": 4, "temperature": per_head([0.5, 1.0, 2.0], d)},
    ),
]


def masks(length: int) -> dict[str, object]:
    generator = torch.Generator().manual_seed(1)
    full = torch.rand(B, H, LQ, length, generator=generator) > 0.3
    full[0, 1, 2] = False  # a fully masked row
    keys = torch.rand(B, 1, 1, length, generator=generator) > 0.2
    return {
        "none": None,
        "keys": keys,
        "full": full,
        "causal": attnorm.causal_mask(),
        "causal+padding": attnorm.causal_mask(length - LQ) & attnorm.key_padding_mask(torch.tensor([length, 3])),
    }


def assert_matches(fast_op, reference_op, x, mask, params, tolerance, check_grads=True, trainable=True):
    """Outputs and gradients (scores, and tensor parameters when trainable) of both ops agree."""
    x = x.detach().requires_grad_(True)
    params = {k: v.detach().requires_grad_(trainable) if isinstance(v, torch.Tensor) else v for k, v in params.items()}
    leaves = [x] + [v for v in params.values() if isinstance(v, torch.Tensor) and trainable]
    grad_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64).to(x.dtype)
    results = []
    for op in (fast_op, reference_op):
        out = op(x, mask, **params)
        results.append((out, torch.autograd.grad(out, leaves, grad_out, allow_unused=True)))
    (fast, fast_grads), (expected, expected_grads) = results
    torch.testing.assert_close(fast, expected, atol=tolerance, rtol=tolerance, equal_nan=True)
    if not check_grads:
        return
    for got, want in zip(fast_grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, atol=tolerance, rtol=tolerance, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("mask_kind", ["none", "keys", "full", "causal", "causal+padding"])
@pytest.mark.parametrize("name, fast_op, reference_op, params", OPS, ids=[op[0] for op in OPS])
@pytest.mark.usefixtures("kernels")
def test_matches_reference(name, fast_op, reference_op, params, mask_kind, dtype):
    length = 24
    x, mask = scores(length, dtype), masks(length)[mask_kind]
    assert_matches(fast_op, reference_op, x, mask, params(dtype), TOLERANCE[dtype])


TENSOR_PARAM_OPS = [op for op in OPS if op[0].endswith("-heads")]


@pytest.mark.usefixtures("kernels")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize(
    "name, fast_op, reference_op, params", TENSOR_PARAM_OPS, ids=[op[0] for op in TENSOR_PARAM_OPS]
)
def test_tensor_parameters_without_gradient(name, fast_op, reference_op, params, dtype):
    # Trainable parameters always take the torch-only kernels; these may take the native ones.
    x, mask = scores(300, dtype), masks(300)["causal+padding"]
    assert_matches(fast_op, reference_op, x, mask, params(dtype), TOLERANCE[dtype], trainable=False)


SPARSE_OPS = [op for op in OPS if op[0].startswith(("sparsemax", "entmax", "topk"))]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("length, scale", [(4096, 2.0), (4096, 0.05), (1000, 1.0)])
@pytest.mark.parametrize("name, fast_op, reference_op, params", SPARSE_OPS, ids=[op[0] for op in SPARSE_OPS])
@pytest.mark.usefixtures("kernels")
def test_sparse_candidate_paths(name, fast_op, reference_op, params, length, scale, dtype):
    # Long rows pack few candidate groups; near-uniform rows (scale 0.05) make most
    # groups candidates; 1000 is not a multiple of 16.
    x = scores(length, dtype, seed=3, scale=scale, queries=2)
    mask = attnorm.causal_mask(length - 2) & attnorm.key_padding_mask(torch.tensor([length, length // 2]))
    # For alpha > 2 the Jacobian holds out^(2 - alpha), huge next to the threshold: on
    # near-uniform float32 rows both implementations' gradients are off by ~1e-3 from
    # float64 (the forward still agrees to 1e-5), so only float64 compares them.
    ill_conditioned = name == "entmax2.5" and scale < 1 and dtype == torch.float32
    assert_matches(fast_op, reference_op, x, mask, params(dtype), TOLERANCE[dtype], check_grads=not ill_conditioned)


@pytest.mark.parametrize("name, fast_op, reference_op, params", OPS, ids=[op[0] for op in OPS])
@pytest.mark.usefixtures("kernels")
def test_special_rows_fall_back_to_the_reference(name, fast_op, reference_op, params):
    x = scores(12, torch.float64)
    x[0, 0, 0, 3] = math.inf  # a +inf row
    x[0, 0, 1, 2:4] = math.inf  # two +inf scores share the row
    x[0, 1, 1, 5] = math.nan  # a NaN row
    x[1, 2, 3] = -math.inf  # a row of -inf: fully masked
    x[1, 0, 2, :6] = -math.inf  # -inf scores count as masked
    mask = torch.ones(B, H, LQ, 12, dtype=torch.bool)
    mask[1, 1, 4] = False  # fully masked by the mask
    mask[0, 2, 0, 7] = False
    x[0, 2, 0, 7] = math.nan  # NaN at a masked position does not spread
    assert_matches(fast_op, reference_op, x, mask, params(torch.float64), TOLERANCE[torch.float64])


@pytest.mark.parametrize("name, fast_op, reference_op, params", OPS, ids=[op[0] for op in OPS])
@pytest.mark.usefixtures("kernels")
def test_single_row_and_large_offsets(name, fast_op, reference_op, params):
    row = scores(40, torch.float32)[0, 0, 0]
    assert_matches(fast_op, reference_op, row, None, {k: v.reshape(-1)[:1] if isinstance(v, torch.Tensor) else v
                                                      for k, v in params(torch.float32).items()}, 1e-5)
    if name.startswith(("sparsemax", "entmax", "topk")):
        # Thresholds are found relative to the row maximum: offset float32 scores
        # lose nothing beyond their own rounding.
        shifted = (scores(40, torch.float64, seed=5) + 3e4).float()
        out = fast_op(shifted, None, **params(torch.float32))
        expected = reference_op(shifted.double(), None, **params(torch.float64))
        torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-4)


def test_in_place_softmax_equals_torch_softmax():
    x = scores(300, torch.float32).reshape(-1, 300)
    buffer = x.clone()
    torch.ops.aten._softmax.out(buffer, -1, False, out=buffer)
    torch.testing.assert_close(buffer, torch.softmax(x, -1), atol=0, rtol=0)


def test_native_kernels_run_unless_a_parameter_needs_a_gradient():
    if not native_available():
        pytest.skip(f"native kernels unavailable: {native.build_info().get('reason')}")
    x = torch.randn(2, 8)
    assert cpu._kernels(x) is cpu._NATIVE
    assert cpu._kernels(x, 0.5, 2.0) is cpu._NATIVE
    assert cpu._kernels(x, torch.tensor([[0.5], [2.0]])) is cpu._NATIVE
    assert cpu._kernels(x, 0.5, torch.tensor(0.5, requires_grad=True)) is cpu._TORCH_ONLY
    assert cpu._kernels(x.to(torch.bfloat16)) is cpu._TORCH_ONLY  # the native kernels take float32 and float64


def test_the_torch_backend_runs_the_fast_path_on_cpu():
    x = torch.randn(2, 8)
    for op in ("softmax", "scalable_softmax", "self_adjusted_softmax", "sparsemax", "entmax", "topk_softmax"):
        assert dispatch.resolve(op, x, "torch").__module__ == "attnorm.kernels.fast_cpu"


@pytest.mark.usefixtures("kernels")
def test_public_api_non_last_dim_and_low_precision():
    x = torch.randn(4, 6, 33, dtype=torch.float64)
    out = F.entmax(x.to(torch.bfloat16), alpha=1.5, dim=1)
    expected = reference.entmax_row_op(x.to(torch.bfloat16).float().movedim(1, -1), None, alpha=1.5)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected.movedim(-1, 1).to(torch.bfloat16).float())
    torch.testing.assert_close(F.sparsemax(x, dim=0), reference.sparsemax_row_op(x.movedim(0, -1), None).movedim(-1, 0))


@pytest.mark.usefixtures("kernels")
def test_topk_keeps_exactly_k_of_tied_scores():
    out = F.topk_softmax(torch.zeros(3, 64), 5)
    assert ((out > 0).sum(-1) == 5).all()
    torch.testing.assert_close(out.sum(-1), torch.ones(3))


@pytest.mark.parametrize(
    "fn",
    [
        lambda x, p: F.sparsemax(x),
        lambda x, p: F.entmax(x, alpha=1 + torch.sigmoid(p)),
        lambda x, p: F.scalable_softmax(x, s=p, mask=attnorm.causal_mask()),
        lambda x, p: F.topk_softmax(x, 3, temperature=p.exp()),
    ],
    ids=["sparsemax", "entmax-alpha", "ssmax-s", "topk-temperature"],
)
@pytest.mark.usefixtures("kernels")
def test_gradcheck_and_gradgradcheck(fn):
    x = (torch.randn(1, 3, 2, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(4)) * 2).requires_grad_()
    p = torch.tensor([0.1, 0.4, -0.3], dtype=torch.float64).reshape(3, 1, 1).requires_grad_()
    assert gradcheck(fn, (x, p))
    assert gradgradcheck(fn, (x, p))
