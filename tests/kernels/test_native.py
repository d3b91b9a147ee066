"""The native backend's seven functions (attnorm.kernels.cpu.native), called directly.

Every result is compared with an independent float64 reference: the formulas of
tests/normalizers/references.py (torch.softmax, the entmax package, an explicit sort)
applied row by row to the allowed positions, with the row rules written out here by
hand (fully masked rows give zeros, +inf rows are uniform over their +inf positions,
NaN rows are NaN); mpmath bisection for large alpha; torch.autograd on float64
formulas for the backward passes.  Masks are rebuilt by hand from their definition.
"""

from __future__ import annotations

import math

import entmax
import mpmath
import pytest
import torch
from torch import Tensor

from attnorm.kernels import rules
from attnorm.kernels.cpu import build, native
from tests.normalizers.references import (
    entmax_reference,
    scalable_softmax_reference,
    self_adjusted_reference,
    softmax_reference,
    sparsemax_reference,
    topk_count,
)

pytestmark = pytest.mark.skipif(not build.usable(), reason="native kernels unavailable (no C compiler)")

NO_MASK = rules.RowMask()
DTYPES = [torch.float32, torch.float64]
TOLERANCE = {torch.float32: {"atol": 3e-6, "rtol": 1e-4}, torch.float64: {"atol": 1e-12, "rtol": 1e-9}}
SHAPE = (2, 3, 5, 13)  # (B, H, Lq, Lk)


def close(got: Tensor, expected: Tensor | list, dtype: torch.dtype, **overrides: float) -> None:
    expected = torch.as_tensor(expected, dtype=torch.float64)
    torch.testing.assert_close(got.double(), expected, equal_nan=True, **{**TOLERANCE[dtype], **overrides})


# ---- masks, by hand ------------------------------------------------------------------------


def mask_cases(shape: tuple[int, ...], generator: torch.Generator) -> dict[str, tuple[rules.RowMask, Tensor]]:
    """Each mask kind with the bool tensor of allowed positions it stands for (before -inf scores)."""
    batch, _, queries, keys = shape
    bool_mask = torch.rand(batch, 1, queries, keys, generator=generator) > 0.3
    bool_mask[0, 0, 2] = False  # a fully masked row
    query, key = torch.arange(queries)[:, None], torch.arange(keys)
    lengths = torch.tensor([keys, 4])[:batch]
    return {
        "none": (NO_MASK, torch.ones(shape, dtype=torch.bool)),
        "bool": (rules.RowMask(tensor=bool_mask), bool_mask.expand(shape)),
        "causal": (rules.RowMask(diagonal=1), (key <= query + 1).expand(shape)),
        "key_lengths": (rules.RowMask(key_lengths=lengths), (key < lengths.reshape(-1, 1, 1, 1)).expand(shape)),
        "causal_and_lengths": (
            rules.RowMask(diagonal=-1, key_lengths=lengths),
            ((key <= query - 1) & (key < lengths.reshape(-1, 1, 1, 1))).expand(shape),
        ),
    }


def scores_with_special_rows(shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator) -> Tensor:
    x = torch.randn(shape, generator=generator, dtype=torch.float64) * 2
    x[0, 0, 0] = -math.inf  # no allowed score
    x[0, 1, 3, [1, 6]] = math.inf  # two +inf
    x[1, 0, 4, [0, 2, 3, 9]] = math.inf  # four +inf: top-k keeps the first k
    x[1, 2, 3, 5] = math.nan
    x[1, 1, 1, ::2] = -math.inf  # -inf scores are masked
    return x.to(dtype)


def expected_rows(x: Tensor, allowed: Tensor, formula, posinf_keep=None, posinf_value=None) -> Tensor:
    """``formula`` (float64, 1-D) on each row's allowed scores, with the row rules applied by hand."""
    length = x.shape[-1]
    rows = x.double().reshape(-1, length)
    keep = (allowed.expand(x.shape).reshape(-1, length)) & (rows != -math.inf)
    out = torch.zeros_like(rows)
    for index, (row, ok) in enumerate(zip(rows, keep, strict=True)):
        if not ok.any():
            continue
        if row[ok].isnan().any():
            out[index] = math.nan
            continue
        infinite = (ok & (row == math.inf)).nonzero().flatten()
        if len(infinite):
            count = len(infinite) if posinf_keep is None else min(len(infinite), posinf_keep(int(ok.sum())))
            out[index, infinite[:count]] = 1 / count if posinf_value is None else posinf_value
            continue
        out[index, ok] = formula(row[ok])
    return out.reshape(x.shape)


def topk_formula(k: float, temperature: float):
    def formula(values: Tensor) -> Tensor:
        kept = topk_count(k, len(values))
        order = sorted(range(len(values)), key=lambda i: (-values[i].item(), i))[:kept]  # ties: lowest index first
        out = torch.zeros_like(values)
        out[order] = torch.softmax(values[order] / temperature, dim=-1)
        return out

    return formula


# name -> (call(x, mask), formula, posinf_keep, posinf_value)
FORWARDS = {
    "softmax_T0.7": (lambda x, m: native.softmax_forward(x, m, 0, 0.7, 0.0)[0], lambda v: softmax_reference(v, 0.7)),
    "ssmax_s0.6_b0.1": (
        lambda x, m: native.softmax_forward(x, m, 1, 0.6, 0.1)[0],
        lambda v: scalable_softmax_reference(v, 0.6, 0.1),
    ),
    "topk3": (lambda x, m: native.topk_forward(x, m, 3, False, 1.0)[0], topk_formula(3, 1.0), lambda n: 3),
    "topk0.4_T2": (
        lambda x, m: native.topk_forward(x, m, 0.4, True, 2.0)[0],
        topk_formula(0.4, 2.0),
        lambda n: topk_count(0.4, n),
    ),
    "sa": (lambda x, m: native.self_adjusted_forward(x, m, True)[0], self_adjusted_reference),
    "sa_plain": (
        lambda x, m: native.self_adjusted_forward(x, m, False)[0],
        lambda v: self_adjusted_reference(v, normalized=False),
        None,
        math.inf,
    ),
    **{
        f"entmax{alpha}": (
            lambda x, m, alpha=alpha: native.entmax_forward(x, m, alpha)[0],
            lambda v, alpha=alpha: entmax_reference(v, alpha),
        )
        for alpha in (1, 1.01, 1.3, 1.5, 2)
    },
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask_kind", ["none", "bool", "causal", "key_lengths", "causal_and_lengths"])
@pytest.mark.parametrize("name", list(FORWARDS))
def test_forward_matches_the_reference_under_every_mask(name, mask_kind, dtype):
    generator = torch.Generator().manual_seed(0)
    x = scores_with_special_rows(SHAPE, dtype, generator)
    mask, allowed = mask_cases(SHAPE, generator)[mask_kind]
    call, formula, *posinf = FORWARDS[name]
    before = x.clone()
    y = call(x, mask)
    assert y.dtype == dtype and y.shape == x.shape
    close(y, expected_rows(x, allowed, formula, *posinf), dtype)
    assert torch.equal(x.nan_to_num(), before.nan_to_num())  # the input is left alone


@pytest.mark.parametrize("dtype", DTYPES)
def test_per_row_outputs(dtype):
    x = torch.tensor([[1.0, 2.0, -math.inf, 0.5], [math.inf, 1.0, 2.0, 3.0], [-math.inf] * 4, [math.nan, 1, 2, 3]],
                     dtype=dtype)
    accumulation = rules.accumulation_dtype(dtype)
    _, multiplier, log_count = native.softmax_forward(x, NO_MASK, 0, 0.5, 0.0)
    assert log_count is None and multiplier.dtype == accumulation and multiplier.shape == (4,)
    assert multiplier.tolist() == [2.0, 0.0, 2.0, 2.0]
    _, multiplier, log_count = native.softmax_forward(x, NO_MASK, 1, 0.5, 0.25)
    counts = torch.tensor([3.0, 4.0, 1.0, 4.0], dtype=torch.float64)  # +inf and NaN count, -inf does not
    close(log_count, counts.log(), dtype)
    close(multiplier, torch.where(torch.tensor([1, 0, 1, 1]).bool(), 0.5 * counts.log() + 0.25, 0.0), dtype)
    _, multiplier = native.topk_forward(x, NO_MASK, 2, False, 4.0)
    assert multiplier.tolist() == [0.25, 0.0, 0.25, 0.25]
    for alpha in (1.0, 1.5, 2.0, 3.0):
        _, gate = native.entmax_forward(x, NO_MASK, alpha)
        assert gate.dtype == accumulation and gate.tolist() == [1.0, 0.0, 1.0, 1.0]
    _, stats = native.self_adjusted_forward(x, NO_MASK, True)
    assert stats.shape == (4, 5) and stats.dtype == accumulation
    assert stats[:, 4].tolist() == [1.0, 0.0, 0.0, 1.0]
    assert stats[3, :4].isnan().all() and (stats[1:3] == 0).all()
    weights = torch.exp((x[0] - stats[0, 0]) - stats[0, 1])
    close(weights, softmax_reference(x[0]), dtype)


def test_scaled_scores_never_overflow():
    cases = [  # (scores, variant, first, second, expected)
        ([3e38, 0.0], 0, 0.5, 0.0, [1.0, 0.0]),
        ([3e38, 2e38, -3e38], 1, 2.0, 0.0, [1.0, 0.0, 0.0]),
        ([1e38, 0.0, 0.0, 0.0], 1, -1.0, 0.0, [0.0, 1 / 3, 1 / 3, 1 / 3]),
        ([-3e38, 3e38], 0, -1.0, 0.0, [1.0, 0.0]),
        ([3e38, -3e38, 1.0], 0, math.inf, 0.0, [1 / 3, 1 / 3, 1 / 3]),  # m = 0: uniform
        ([3e38, -3e38], 0, 1e38, 0.0, [1 / (1 + math.exp(-6)), 1 / (1 + math.exp(6))]),  # difference overflows, m x not
    ]
    for dtype in DTYPES:
        for scores, variant, first, second, expected in cases:
            y, _, _ = native.softmax_forward(torch.tensor([scores], dtype=dtype), NO_MASK, variant, first, second)
            close(y, [expected], dtype, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sparse_maps_at_large_magnitudes_and_huge_alpha(dtype):
    y, _ = native.entmax_forward(torch.tensor([[2e7, 2e7 - 4, 0.0]], dtype=dtype), NO_MASK, 2.0)
    assert y.tolist() == [[1.0, 0.0, 0.0]]
    y, _ = native.entmax_forward(torch.tensor([[2e7, 2e7 - 0.5, 0.0]], dtype=dtype), NO_MASK, 2.0)
    close(y, sparsemax_reference(torch.tensor([2e7, 2e7 - 0.5, 0.0], dtype=dtype))[None], dtype)
    for alpha in (1e7, 1e3, 50.0):
        y, _ = native.entmax_forward(torch.tensor([[3.0, 1.0, -2.0]], dtype=dtype), NO_MASK, alpha)
        assert y.tolist() == [[1.0, 0.0, 0.0]]
    generator = torch.Generator().manual_seed(1)
    x = (torch.randn(64, 50, generator=generator, dtype=torch.float64) * 1e6).to(dtype)
    for alpha in (1.01, 1.3, 1.5, 2.0, 3.0, 10.0):
        y, _ = native.entmax_forward(x, NO_MASK, alpha)
        close(y.sum(-1), torch.ones(64), dtype)


def mpmath_entmax(row: Tensor, alpha: float) -> Tensor:
    """alpha-entmax of one row by 60-digit bisection on the threshold."""
    mpmath.mp.dps = 60
    shrink = mpmath.mpf(alpha) - 1
    z = [shrink * mpmath.mpf(value) for value in row.double().tolist()]
    low, high = max(z) - 1, max(z)
    for _ in range(220):
        middle = (low + high) / 2
        if sum(max(zi - middle, 0) ** (1 / shrink) for zi in z) >= 1:
            low = middle
        else:
            high = middle
    weights = [max(zi - low, 0) ** (1 / shrink) for zi in z]
    total = sum(weights)
    return torch.tensor([float(w / total) for w in weights], dtype=torch.float64)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("alpha", [3.0, 5.0, 10.0, 30.0])
def test_large_alpha_matches_mpmath(alpha, dtype):
    generator = torch.Generator().manual_seed(int(alpha))
    x = torch.randn(2, 37, generator=generator, dtype=torch.float64).to(dtype)
    x[1, 5] = x[1].max() + 1e-3  # a runner-up close to the top
    y, _ = native.entmax_forward(x, NO_MASK, alpha)
    expected = torch.stack([mpmath_entmax(row, alpha) for row in x])
    close(y, expected, dtype, atol=1e-6 if dtype == torch.float32 else 1e-13, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("alpha", [1.001, 1.01, 1.05, 1.2, 2.5, 3.0, 10.0])
@pytest.mark.parametrize("dtype", DTYPES)
def test_entmax_matches_mpmath_on_more_rows(alpha, dtype):
    generator = torch.Generator().manual_seed(3)
    x = (torch.randn(6, 60, generator=generator, dtype=torch.float64) * torch.tensor([0.1, 1, 3, 10, 30, 100])[:, None])
    y, _ = native.entmax_forward(x.to(dtype), NO_MASK, alpha)
    expected = torch.stack([mpmath_entmax(row, alpha) for row in x.to(dtype)])
    close(y, expected, dtype, atol=2e-6 if dtype == torch.float32 else 1e-12, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("length", [13, 300, 9000])
def test_long_rows_use_the_subset_bound_and_still_match(length, dtype):
    generator = torch.Generator().manual_seed(length)
    x = torch.randn(4, length, generator=generator, dtype=torch.float64).to(dtype) * 3
    for alpha in (1.01, 1.3, 1.5, 2.0, 4.0):
        y, _ = native.entmax_forward(x, NO_MASK, alpha)
        reference = torch.stack([mpmath_entmax(row, alpha) for row in x]) if alpha > 2 and length == 13 else None
        if reference is None and alpha <= 2:
            reference = entmax_reference(x, alpha)
        if reference is not None:
            close(y, reference, dtype)
        close(y.sum(-1), torch.ones(4), dtype)
    y, _ = native.topk_forward(x, NO_MASK, 7, False, 1.0)
    close(y, expected_rows(x, torch.ones_like(x, dtype=torch.bool), topk_formula(7, 1.0)), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_per_row_parameters(dtype):
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(2, 3, 11, generator=generator, dtype=torch.float64).to(dtype)
    alpha = torch.tensor([1.0, 1.01, 1.5, 2.0, 3.0, 1.3]).reshape(2, 3, 1)
    y, gate = native.entmax_forward(x, NO_MASK, alpha)
    for index in range(6):
        row, value = x.reshape(6, 11)[index], alpha.flatten()[index].item()
        expected = mpmath_entmax(row, value) if value > 2 else entmax_reference(row, value)
        close(y.reshape(6, 11)[index], expected, dtype)
    assert (gate == 1).all()
    temperature = torch.tensor([0.5, 2.0], dtype=torch.float64).reshape(2, 1, 1)  # broadcast over dim 1
    y, multiplier, _ = native.softmax_forward(x, NO_MASK, 0, temperature, 0.0)
    close(y, softmax_reference(x / temperature), dtype)
    close(multiplier, (1 / temperature).squeeze(-1).expand(2, 3), dtype)
    s, bias = torch.tensor([0.3, 0.6, 0.9]).reshape(1, 3, 1), torch.tensor([[[0.1]], [[-0.2]]])
    y, multiplier, _ = native.softmax_forward(x, NO_MASK, 1, s, bias)
    close(y, torch.softmax((s.double() * math.log(11) + bias.double()) * x.double(), -1), dtype)
    y, _ = native.topk_forward(x, NO_MASK, 4, False, temperature)
    close(y[1], expected_rows(x[1], torch.ones(3, 11, dtype=torch.bool), topk_formula(4, 2.0)), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_topk_ties_keep_the_lowest_index(dtype):
    x = torch.tensor([[1.0, 3.0, 2.0, 3.0, 2.0, 2.0, 0.0, 2.0]] * 3, dtype=dtype)
    for k, kept in ((1, [1]), (2, [1, 3]), (3, [1, 2, 3]), (4, [1, 2, 3, 4])):
        y, _ = native.topk_forward(x, NO_MASK, k, False, 1.0)
        assert (y[0] > 0).nonzero().flatten().tolist() == kept
    wide = torch.zeros(2, 5000, dtype=dtype)  # all tied: the radix select and the group bound
    wide[1, 4000:] = 1.0
    y, _ = native.topk_forward(wide, NO_MASK, 10, False, 1.0)
    assert (y[0] > 0).nonzero().flatten().tolist() == list(range(10))
    assert (y[1] > 0).nonzero().flatten().tolist() == list(range(4000, 4010))
    y, _ = native.topk_forward(torch.tensor([[math.inf, 1, math.inf, math.inf]], dtype=dtype), NO_MASK, 2, False, 1.0)
    assert y.tolist() == [[0.5, 0.0, 0.5, 0.0]]


@pytest.mark.parametrize("dtype", DTYPES)
def test_topk_keeps_the_k_largest_lowest_index_first_on_short_tied_rows(dtype):
    """Rows of 1-40 scores (both sides of the short-row insertion select) drawn from a few values,
    +-0 and -inf among them: for every k, the kept positions are the first k of the allowed ones
    sorted by value, then index (Python's sort, where -0 == +0), and the weights their softmax."""
    generator = torch.Generator().manual_seed(11)
    values = torch.tensor([-math.inf, -2.0, -0.0, 0.0, 0.5, 3.0], dtype=torch.float64)
    for length in (*range(1, 36), 40):
        x = values[torch.randint(0, len(values), (3, length), generator=generator)]
        x[0, 0] = 3.0  # at least one allowed score in some rows
        for k in range(1, length + 1):
            y, _ = native.topk_forward(x.to(dtype), NO_MASK, k, False, 1.0)
            for row, weights in zip(x.tolist(), y.double(), strict=True):
                allowed = [i for i, v in enumerate(row) if v != -math.inf]
                kept = sorted(sorted(allowed, key=lambda i: -row[i])[:k])
                expected = torch.zeros(length, dtype=torch.float64)  # a fully masked row: zeros
                if kept:
                    expected[kept] = torch.softmax(torch.tensor([row[i] for i in kept], dtype=torch.float64), 0)
                assert (weights > 0).nonzero().flatten().tolist() == kept, (row, k)
                close(weights, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_topk_with_negative_or_zero_temperature_inverse(dtype):
    x = torch.tensor([[3e38, -3e38, 1.0, 2.0]], dtype=dtype)
    y, _ = native.topk_forward(x, NO_MASK, 2, False, -1.0)  # keeps the 2 largest, softmax of -x over them
    close(y, [[0.0, 0.0, 0.0, 1.0]], dtype)
    y, _ = native.topk_forward(x, NO_MASK, 3, False, math.inf)
    close(y, [[1 / 3, 0.0, 1 / 3, 1 / 3]], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_self_adjusted_denormal_and_huge_spans(dtype):
    tiny = torch.tensor([[1e-40, 3e-40, 0.0, 2e-40]] if dtype == torch.float32 else [[1e-310, 3e-310, 0.0, 2e-310]],
                        dtype=dtype)
    huge = torch.tensor([[3.06e38, -3.06e38, 0.0, 1.0]], dtype=dtype)
    for x in (tiny, huge):
        for normalized in (True, False):
            y, stats = native.self_adjusted_forward(x, NO_MASK, normalized)
            assert y.isfinite().all() and stats.isfinite().all()
    for normalized in (True, False):  # (the gradient on a denormal span, 1 / span, does overflow)
        _, stats = native.self_adjusted_forward(huge, NO_MASK, normalized)
        assert native.self_adjusted_backward(huge, NO_MASK, torch.ones_like(huge), stats, normalized).isfinite().all()
    y, _ = native.self_adjusted_forward(tiny, NO_MASK, True)
    close(y, [[1 / 12, 1 / 4, 0.0, 1 / 6]], dtype, atol=1e-6)
    y, _ = native.self_adjusted_forward(huge, NO_MASK, True)
    close(y, [[1.0, 0.0, 0.0, 0.0]], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_of_one_position(dtype):
    x = torch.tensor([[2.0], [-math.inf], [math.inf], [math.nan]], dtype=dtype)
    expected = [[1.0], [0.0], [1.0], [math.nan]]
    for y in (
        native.softmax_forward(x, NO_MASK, 1, 0.5, 0.0)[0],
        native.topk_forward(x, NO_MASK, 0.5, True, 1.0)[0],
        native.entmax_forward(x, NO_MASK, 1.7)[0],
        native.entmax_forward(x, NO_MASK, 4.0)[0],
        native.self_adjusted_forward(x, NO_MASK, True)[0],
    ):
        close(y, expected, dtype)


# ---- backward --------------------------------------------------------------------------------


def masked_rows(dtype, generator, rows=6, length=9):
    x = torch.randn(rows, length, generator=generator, dtype=torch.float64).to(dtype)
    allowed = torch.rand(rows, length, generator=generator) > 0.25
    allowed[:, 0] = True
    allowed[1] = False  # fully masked
    return x, allowed


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", [0, 1])
def test_softmax_backward_and_parameter_gradients(variant, dtype):
    generator = torch.Generator().manual_seed(4)
    x, allowed = masked_rows(dtype, generator)
    mask = rules.RowMask(tensor=allowed)
    first = torch.tensor([0.7, 1.5, -0.8, 2.0, 0.3, 1.0]).reshape(6, 1)
    y, multiplier, _ = native.softmax_forward(x, mask, variant, first, 0.2)
    grad = torch.randn(x.shape, generator=generator, dtype=torch.float64).to(dtype)

    # autograd on the float64 formula, the parameter as a leaf
    param = first.double().clone().requires_grad_()
    x64 = torch.where(allowed, x.double(), 0.0).requires_grad_()
    n = allowed.sum(-1, keepdim=True).clamp_min(1).double()
    m = 1 / param if variant == 0 else param * n.log() + 0.2
    expected = torch.where(allowed, torch.softmax(torch.where(allowed, m * x64, -math.inf), -1), 0.0).nan_to_num()
    expected_dx, expected_param = torch.autograd.grad(expected, (x64, param), grad.double())
    scores = rules.masked_scores(x, mask)
    dx, none = native.softmax_backward(y, grad, multiplier, None, 0)
    assert none is None
    close(dx, torch.where(allowed, expected_dx, 0.0), dtype, atol=1e-5 if dtype == torch.float32 else 1e-12)
    dx, temperature_grad = native.softmax_backward(y, grad, multiplier, None, 1)
    dx2, multiplier_grad = native.softmax_backward(y, grad, multiplier, scores, 2)
    assert torch.equal(dx, dx2)
    assert temperature_grad.shape == (6,) and temperature_grad.dtype == rules.accumulation_dtype(dtype)
    atol = 1e-5 if dtype == torch.float32 else 1e-11
    if variant == 0:  # d/dT of sum(g y) for T = first
        close(temperature_grad, expected_param.squeeze(-1), dtype, atol=atol)
    # d/dm of sum(g y): the parameter's gradient divided by dm/dparam
    dm_dparam = -1 / first.double() ** 2 if variant == 0 else n.log()
    usable = dm_dparam.squeeze(-1) != 0
    close(multiplier_grad[usable], (expected_param / dm_dparam).squeeze(-1)[usable], dtype, atol=atol)


def test_softmax_parameter_gradient_is_zero_in_infinite_rows():
    x = torch.tensor([[math.inf, 1.0, 2.0], [1.0, 2.0, 3.0]])
    y, multiplier, _ = native.softmax_forward(x, NO_MASK, 0, 1.0, 0.0)
    dx, per_row = native.softmax_backward(y, torch.tensor([[1.0, 2.0, 3.0]] * 2), multiplier, x, 2)
    assert (dx[0] == 0).all() and per_row[0] == 0 and per_row[1] != 0


def entmax_package(x: Tensor, alpha: float | Tensor) -> Tensor:
    if isinstance(alpha, Tensor):
        return entmax.entmax_bisect(x, alpha, dim=-1, n_iter=100)
    return {1.5: entmax.entmax15, 2.0: entmax.sparsemax}.get(alpha, lambda v, dim: torch.softmax(v, dim))(x, dim=-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("alpha", [1.0, 1.5, 2.0])
def test_entmax_backward_matches_autograd(alpha, dtype):
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(5, 12, generator=generator, dtype=torch.float64)
    x64 = x.clone().requires_grad_()
    grad = torch.randn(5, 12, generator=generator, dtype=torch.float64)
    expected_dx = torch.autograd.grad(entmax_package(x64, alpha), x64, grad)[0]
    y, gate = native.entmax_forward(x.to(dtype), NO_MASK, alpha)
    dx, alpha_grad = native.entmax_backward(y, grad.to(dtype), gate, alpha, alpha == 1.0)
    close(dx, expected_dx, dtype, atol=1e-5 if dtype == torch.float32 else 1e-10)
    if alpha == 1.0:
        assert (alpha_grad == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_entmax_backward_with_per_row_alpha_gradient(dtype):
    generator = torch.Generator().manual_seed(6)
    x = torch.randn(4, 10, generator=generator, dtype=torch.float64)
    alpha = torch.tensor([1.3, 1.7, 2.5, 1.1], dtype=torch.float64).reshape(4, 1)
    x64, alpha64 = x.clone().requires_grad_(), alpha.clone().requires_grad_()
    grad = torch.randn(4, 10, generator=generator, dtype=torch.float64)
    expected_dx, expected_alpha = torch.autograd.grad(entmax_package(x64, alpha64), (x64, alpha64), grad)
    y, gate = native.entmax_forward(x.to(dtype), NO_MASK, alpha.to(dtype))
    dx, alpha_grad = native.entmax_backward(y, grad.to(dtype), gate, alpha, True)
    atol = 1e-4 if dtype == torch.float32 else 1e-7
    close(dx, expected_dx, dtype, atol=atol)
    close(alpha_grad, expected_alpha.squeeze(-1), dtype, atol=atol)


def test_entmax_backward_is_gated_in_infinite_rows():
    x = torch.tensor([[math.inf, 1.0, math.inf], [0.5, 1.0, 0.0]], dtype=torch.float64)
    y, gate = native.entmax_forward(x, NO_MASK, 1.5)
    dx, alpha_grad = native.entmax_backward(y, torch.tensor([[1.0, 2.0, 5.0]] * 2), gate, 1.5, True)
    assert gate.tolist() == [0.0, 1.0] and (dx[0] == 0).all() and alpha_grad[0] == 0 and dx[1].abs().sum() > 0


def self_adjusted_masked(x: Tensor, allowed: Tensor, normalized: bool) -> Tensor:
    """SA-Softmax over the allowed positions, float64 torch written from the definition."""
    weights = torch.softmax(torch.where(allowed, x, -math.inf), -1).nan_to_num()
    scores = torch.where(allowed, x, 0.0)
    if not normalized:
        return scores * weights
    low = torch.where(allowed, x, math.inf).amin(-1, keepdim=True).clamp_max(0)
    high = torch.where(allowed, x, -math.inf).amax(-1, keepdim=True).clamp_min(0)
    span = high - low
    factor = torch.where(span > 0, (scores - low) / torch.where(span > 0, span, 1.0), 0.0)
    return torch.where(allowed, factor * weights, 0.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("normalized", [True, False])
def test_self_adjusted_backward_matches_autograd(normalized, dtype):
    generator = torch.Generator().manual_seed(7)
    x, allowed = masked_rows(dtype, generator)
    x[3] = x[3].abs() + 0.1  # all positive: high is the max, low is 0
    x[4] = -x[4].abs() - 0.1  # all negative
    x[5, 2] = x[5, 0] = x[5].max() + 1  # tied maxima share the gradient through high
    mask = rules.RowMask(tensor=allowed)
    y, stats = native.self_adjusted_forward(x, mask, normalized)
    x64 = torch.where(allowed, x.double(), 0.0).requires_grad_()
    expected = self_adjusted_masked(x64, allowed, normalized)
    close(y, expected.detach(), dtype)
    grad = torch.randn(x.shape, generator=generator, dtype=torch.float64)
    expected_dx = torch.autograd.grad(expected, x64, grad)[0]
    dx = native.self_adjusted_backward(x, mask, grad.to(dtype), stats, normalized)
    close(dx, torch.where(allowed, expected_dx, 0.0), dtype, atol=2e-5 if dtype == torch.float32 else 1e-11)


def test_self_adjusted_backward_special_rows():
    x = torch.tensor([[math.inf, 1.0, 2.0], [-math.inf] * 3, [math.nan, 1.0, 2.0]], dtype=torch.float64)
    for normalized in (True, False):
        _, stats = native.self_adjusted_forward(x, NO_MASK, normalized)
        dx = native.self_adjusted_backward(x, NO_MASK, torch.ones_like(x), stats, normalized)
        assert (dx[:2] == 0).all() and dx[2].isnan().all()


# ---- the calling convention ------------------------------------------------------------------


def all_calls(x: Tensor) -> dict[str, tuple[Tensor, ...]]:
    mask = rules.RowMask(tensor=torch.ones(x.shape[-1], dtype=torch.bool))
    y, multiplier, log_count = native.softmax_forward(x, mask, 1, 0.5, 0.1)
    entmax_y, gate = native.entmax_forward(x, NO_MASK, 1.3)
    sa_y, stats = native.self_adjusted_forward(x, NO_MASK, True)
    grad = torch.ones_like(x).cumsum(-1)
    return {
        "softmax": (y, multiplier, log_count),
        "softmax_backward": native.softmax_backward(y, grad, multiplier, x, 2),
        "topk": native.topk_forward(x, NO_MASK, 0.5, True, 1.0),
        "entmax": (entmax_y, gate),
        "entmax_backward": native.entmax_backward(entmax_y, grad, gate, 1.3, True),
        "self_adjusted": (sa_y, stats),
        "self_adjusted_backward": (native.self_adjusted_backward(x, NO_MASK, grad, stats, True),),
    }


def test_outputs_are_fully_written(monkeypatch):
    """Output buffers poisoned with a marker come back without it."""
    generator = torch.Generator().manual_seed(8)
    x = torch.randn(7, 33, generator=generator)
    x[0] = -math.inf
    x[1, 3] = math.inf
    clean = all_calls(x)
    monkeypatch.setattr(native, "_new", lambda shape, dtype: torch.full(shape, 12345.0, dtype=dtype))
    poisoned = all_calls(x)
    for name, outputs in clean.items():
        for got, expected in zip(poisoned[name], outputs, strict=True):
            assert not (got == 12345.0).any(), name
            torch.testing.assert_close(got, expected, equal_nan=True, rtol=0, atol=0, msg=name)


def test_non_contiguous_and_expanded_inputs():
    generator = torch.Generator().manual_seed(9)
    base = torch.randn(9, 6, generator=generator, dtype=torch.float64)
    transposed = base.t()  # (6, 9), not contiguous
    y, _, _ = native.softmax_forward(transposed, NO_MASK, 0, 1.0, 0.0)
    close(y, softmax_reference(transposed), torch.float64)
    expanded = base[:1].expand(4, 6)
    y, _ = native.entmax_forward(expanded, NO_MASK, 1.5)
    close(y, entmax_reference(expanded, 1.5), torch.float64)
    grad = torch.ones(6, 4, dtype=torch.float64).t()
    dx, _ = native.entmax_backward(y, grad, torch.ones(4, dtype=torch.float64), 1.5, False)
    assert dx.abs().max() < 1e-12  # a constant gradient has no effect


def test_results_do_not_depend_on_the_thread_count():
    generator = torch.Generator().manual_seed(10)
    x = torch.randn(64, 200, generator=generator)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = all_calls(x)
        torch.set_num_threads(2)
        two = all_calls(x)
    finally:
        torch.set_num_threads(threads)
    for name, outputs in one.items():
        for a, b in zip(outputs, two[name], strict=True):
            assert torch.equal(a, b), name


WEIGHTS_ONLY = {  # name -> call(x, sink, softcap, weights_only): the forward's outputs
    "softmax": lambda x, sink, cap, only: native.softmax_forward(x, NO_MASK, 0, 0.7, 0.0, sink, cap, weights_only=only),
    "ssmax": lambda x, sink, cap, only: native.softmax_forward(x, NO_MASK, 1, 0.6, 0.1, sink, cap, weights_only=only),
    "topk": lambda x, sink, cap, only: native.topk_forward(x, NO_MASK, 5, False, 1.5, sink, cap, weights_only=only),
    "entmax1.5": lambda x, sink, cap, only: native.entmax_forward(x, NO_MASK, 1.5, sink, cap, weights_only=only),
    "sparsemax": lambda x, sink, cap, only: native.entmax_forward(x, NO_MASK, 2.0, sink, cap, weights_only=only),
    "sa": lambda x, sink, cap, only: native.self_adjusted_forward(x, NO_MASK, True, sink, cap, weights_only=only),
}


@pytest.mark.parametrize("rows, length", [(3, 7), (16, 600)])  # one thread; a team (rows * length >= 4096)
@pytest.mark.parametrize("modifiers", ["none", "sink and cap"])
@pytest.mark.parametrize("name", list(WEIGHTS_ONLY))
def test_weights_only_skips_the_statistics_and_keeps_the_weights(name, modifiers, rows, length):
    """``weights_only=True`` hands C NULL for what only the backward reads: None comes back in its place,
    and the weights (and a sink's weight) are bit for bit those of the full call."""
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(rows, length, generator=generator, dtype=torch.float64) * 4
    x[0, 2] = math.inf if rows > 1 else x[0, 2]  # a row holding +inf: the statistics differ there
    x[-1] = -math.inf  # a fully masked row
    sink, cap = (torch.randn(rows, 1, generator=generator, dtype=torch.float64), 3.0) if modifiers != "none" \
        else (None, None)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        full = WEIGHTS_ONLY[name](x, sink, cap, False)
        only = WEIGHTS_ONLY[name](x, sink, cap, True)
    finally:
        torch.set_num_threads(threads)
    assert len(only) == len(full)
    assert torch.equal(only[0], full[0])
    assert all(value is None for value in only[1:len(only) - (sink is not None)])
    if sink is not None:
        assert torch.equal(only[-1], full[-1])


@pytest.mark.parametrize(
    "call, error",
    [
        (lambda: native.softmax_forward(torch.ones(2, 3, dtype=torch.float16), NO_MASK, 0, 1.0, 0.0), TypeError),
        (lambda: native.softmax_forward(torch.ones(2, 3, dtype=torch.int64), NO_MASK, 0, 1.0, 0.0), TypeError),
        (lambda: native.softmax_forward(torch.ones(2, 0), NO_MASK, 0, 1.0, 0.0), ValueError),
        (lambda: native.softmax_forward(torch.tensor(1.0), NO_MASK, 0, 1.0, 0.0), ValueError),
        (lambda: native.softmax_forward(torch.ones(2, 3, device="meta"), NO_MASK, 0, 1.0, 0.0), ValueError),
        (lambda: native.softmax_forward(torch.ones(2, 3), NO_MASK, 2, 1.0, 0.0), ValueError),
        (lambda: native.softmax_forward(torch.ones(2, 3), NO_MASK, 0, torch.ones(3, 1), 0.0), ValueError),
        (lambda: native.softmax_backward(torch.ones(2, 3), torch.ones(2, 4), 1.0, None, 0), ValueError),
        (lambda: native.softmax_backward(torch.ones(2, 3), torch.ones(2, 3), 1.0, None, 2), ValueError),
        (lambda: native.entmax_forward(torch.ones(2, 3), NO_MASK, 0.5), ValueError),
        (lambda: native.entmax_backward(torch.ones(2, 3), torch.ones(3, 2), 1.0, 1.5, False), ValueError),
        (lambda: native.self_adjusted_backward(torch.ones(2, 3), NO_MASK, torch.ones(2, 3), torch.ones(2, 4), True),
         ValueError),
    ],
)
def test_bad_calls_raise_clear_errors(call, error):
    with pytest.raises(error):
        call()


def test_empty_batches():
    x = torch.empty(0, 4)
    y, multiplier, _ = native.softmax_forward(x, NO_MASK, 0, 1.0, 0.0)
    assert y.shape == (0, 4) and multiplier.shape == (0,)
    y, gate = native.entmax_forward(x, NO_MASK, 1.5)
    assert y.shape == (0, 4) and gate.shape == (0,)


STRUCTURED_CALLS = {
    "softmax": lambda x, mask, sink, cap: native.softmax_forward(x, mask, 0, 0.7, 0.0, sink, cap),
    "ssmax": lambda x, mask, sink, cap: native.softmax_forward(x, mask, 1, 0.6, 0.1, sink, cap),
    "topk": lambda x, mask, sink, cap: native.topk_forward(x, mask, 3, False, 0.8, sink, cap),
    "topk_fraction": lambda x, mask, sink, cap: native.topk_forward(x, mask, 0.4, True, 1.0, sink, cap),
    "sparsemax": lambda x, mask, sink, cap: native.entmax_forward(x, mask, 2.0, sink, cap),
    "entmax_1.5": lambda x, mask, sink, cap: native.entmax_forward(x, mask, 1.5, sink, cap),
    "entmax_1.3": lambda x, mask, sink, cap: native.entmax_forward(x, mask, 1.3, sink, cap),
    "self_adjusted": lambda x, mask, sink, cap: native.self_adjusted_forward(x, mask, True, sink, cap),
}


def _masks_read_in_c(kind: str, generator: torch.Generator) -> rules.RowMask:
    """Masks of scores ``(3, 2, 6, 9)`` that C reads itself: prefixes, bool masks in their own broadcast shape."""
    structured = rules.RowMask(diagonal=-1, key_lengths=torch.tensor([9, 5, 0]))
    bools = {
        "bool": (3, 2, 6, 9),  # one mask row per scores row
        "bool_broadcast": (2, 1, 9),  # shared across batch and queries: rows share mask rows
        "bool_rows": (3, 1, 6, 1),  # all or nothing per row: read as prefixes
    }
    if kind == "structured":
        return structured
    tensor = torch.rand(bools[kind.removesuffix("_structured")], generator=generator) > 0.3
    return structured._replace(tensor=tensor) if kind.endswith("_structured") else rules.RowMask(tensor=tensor)


@pytest.mark.parametrize("kind", ["structured", "bool", "bool_broadcast", "bool_rows", "bool_structured",
                                  "bool_broadcast_structured"])
@pytest.mark.parametrize("modifiers", ["plain", "sink", "cap"])
@pytest.mark.parametrize("name", list(STRUCTURED_CALLS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_masks_are_read_in_c_bit_for_bit(name, modifiers, dtype, kind, monkeypatch):
    """C reads every mask itself: a causal mask and key lengths as each row's prefix (``stops``), a bool mask
    in its own broadcast shape (``allow``, copied into the row's buffer in cache), never a masked copy of the
    scores.  Every output, per-row statistics and Self-Adjusted's backward equal the unmasked kernels run on
    a masked copy made here (``where``) bit for bit, with -inf/+inf/NaN scores at allowed and masked
    positions, empty rows (query 0 under diagonal -1, a key length of 0, a row the bool mask forbids), NaN
    rows (NaN at masked positions too) and sinks."""
    generator = torch.Generator().manual_seed(3)
    x = (3 * torch.randn(3, 2, 6, 9, generator=generator, dtype=torch.float64)).to(dtype)
    special = torch.rand(x.shape, generator=generator)
    x[special < 0.06] = -math.inf
    x[(special > 0.97)] = math.inf
    x[0, 1, 4, 2] = math.nan  # inside query 4's prefix: a NaN row unless a bool mask forbids it
    x[1, 0, 2, 8] = math.nan  # past every prefix of batch row 1: takes no part
    mask = _masks_read_in_c(kind, generator)
    allowed = rules.mask_allows(x, mask).expand(x.shape)
    masked_copy = torch.where(allowed, x, -math.inf)
    sink = None
    if modifiers == "sink":
        sink = torch.randn(3, 2, 6, 1, generator=generator, dtype=torch.float64).to(dtype)
        sink[2, 1, 3] = math.nan
    cap = 2.5 if modifiers == "cap" else None
    call = STRUCTURED_CALLS[name]
    expected = call(masked_copy, NO_MASK, sink, cap)
    monkeypatch.setattr(rules, "masked_scores", lambda *args: pytest.fail("C's mask made a masked copy"))
    got = call(x, mask, sink, cap)
    for got_part, expected_part in zip(got, expected, strict=True):
        if expected_part is not None:
            torch.testing.assert_close(got_part, expected_part, rtol=0, atol=0, equal_nan=True)
    assert (got[0][~allowed & ~got[0].isnan()] == 0).all()
    if name == "self_adjusted":
        grad = torch.randn(x.shape, generator=generator, dtype=torch.float64).to(dtype)
        backward = native.self_adjusted_backward(masked_copy, NO_MASK, grad, expected[1], True, sink, cap)
        got_backward = native.self_adjusted_backward(x, mask, grad, got[1], True, sink, cap)
        for got_part, expected_part in zip(*(
                (result,) if sink is None else result for result in (got_backward, backward)), strict=True):
            torch.testing.assert_close(got_part, expected_part, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("shape", [(9,), (2, 1, 6, 9, 1), (4, 6, 9)])
def test_a_mask_that_does_not_broadcast_to_the_scores_is_refused(shape):
    with pytest.raises(ValueError, match="mask must broadcast to x's shape"):
        native.softmax_forward(torch.zeros(3, 2, 6, 8), rules.RowMask(tensor=torch.ones(shape, dtype=torch.bool)),
                               0, 1.0, 0.0)


@pytest.mark.parametrize("name", list(STRUCTURED_CALLS))
@pytest.mark.parametrize("shape, mask_shape", [((7,), (7,)), ((7,), (1,)), ((4, 1), (4, 1)), ((4, 1), (1,)),
                                               ((0, 5), (5,)), ((2, 3, 5), (3, 5))])
def test_a_bool_mask_read_in_c_at_edge_shapes(name, shape, mask_shape):
    """One row, rows of one position, no rows and a non-contiguous x: C's bool mask equals the masked copy."""
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(shape[::-1], generator=generator, dtype=torch.float64).mT if len(shape) == 2 else \
        torch.randn(shape, generator=generator, dtype=torch.float64)
    tensor = torch.rand(mask_shape, generator=generator) > 0.4
    expected = STRUCTURED_CALLS[name](torch.where(tensor, x, -math.inf), NO_MASK, None, None)
    got = STRUCTURED_CALLS[name](x, rules.RowMask(tensor=tensor), None, None)
    for got_part, expected_part in zip(got, expected, strict=True):
        if expected_part is not None:
            torch.testing.assert_close(got_part, expected_part, rtol=0, atol=0, equal_nan=True)
