"""The pure-torch reference (kernels/reference/): forwards, closed-form Jacobians, backend functions.

Checked against independent float64 references (torch formulas, the ``entmax`` package,
mpmath at large alpha), autograd (gradcheck / gradgradcheck, parameters included),
torch.func transforms against loops, and torch.compile(fullgraph=True) without graph breaks.
"""

from __future__ import annotations

import math
from functools import partial

import mpmath
import pytest
import torch
from torch.autograd import gradcheck, gradgradcheck

from attnorm.kernels import reference as R
from attnorm.kernels.reference import jacobians
from attnorm.kernels.rules import RowMask
from tests.normalizers.references import (
    entmax_reference,
    scalable_softmax_reference,
    self_adjusted_reference,
    softmax_reference,
    sparsemax_reference,
    topk_count,
)

NO_MASK = RowMask()
F64 = torch.float64


def scores(*shape: int, seed: int = 0, scale: float = 1.0, dtype: torch.dtype = F64) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64) * scale).to(dtype)


def random_mask(shape: tuple[int, ...], seed: int = 1) -> torch.Tensor:
    keep = torch.rand(shape, generator=torch.Generator().manual_seed(seed)) > 0.35
    keep[..., 0, :] = False  # a fully masked row
    keep[..., 1, :] = False
    keep[..., 1, 2] = True  # a row with a single allowed position
    return keep


def topk_reference(x: torch.Tensor, k: float, temperature: float = 1.0) -> torch.Tensor:
    """Softmax over the k largest of a row (distinct values), written from the definition."""
    kept = topk_count(k, x.shape[-1])
    order = sorted(range(x.shape[-1]), key=lambda i: -float(x[i]))[:kept]
    out = torch.zeros_like(x)
    out[order] = torch.softmax(x[order] / temperature, dim=-1)
    return out


# name -> (reference forward (x, mask), independent float64 reference of one unmasked row, uses n)
CASES = {
    "softmax_T0.7": (lambda x, m: R.softmax(x, m, 0.7), lambda r: softmax_reference(r, 0.7)),
    "ssmax": (lambda x, m: R.scalable_softmax(x, m, 0.6, 0.1), lambda r: scalable_softmax_reference(r, 0.6, 0.1)),
    "ssmax_negative": (
        lambda x, m: R.scalable_softmax(x, m, -0.8, 0.2),
        lambda r: scalable_softmax_reference(r, -0.8, 0.2),
    ),
    "sa": (lambda x, m: R.self_adjusted_softmax(x, m, True), lambda r: self_adjusted_reference(r, True)),
    "sa_plain": (lambda x, m: R.self_adjusted_softmax(x, m, False), lambda r: self_adjusted_reference(r, False)),
    "sparsemax": (lambda x, m: R.sparsemax(x, m), sparsemax_reference),
    "entmax1.5": (lambda x, m: R.entmax(x, m, 1.5), lambda r: entmax_reference(r, 1.5)),
    "entmax1.3": (lambda x, m: R.entmax(x, m, 1.3), lambda r: entmax_reference(r, 1.3)),
    "entmax2.5": (lambda x, m: R.entmax(x, m, 2.5), lambda r: entmax_reference(r, 2.5)),
    "entmax1": (lambda x, m: R.entmax(x, m, 1.0), lambda r: entmax_reference(r, 1)),
    "topk3_T2": (lambda x, m: R.topk_softmax(x, m, 3, False, 2.0), lambda r: topk_reference(r, 3, 2.0)),
    "topk0.4": (lambda x, m: R.topk_softmax(x, m, 0.4, True), lambda r: topk_reference(r, 0.4)),
}


def masked_reference(reference, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """The row reference on the allowed positions of each row alone, zeros elsewhere."""
    rows, allowed = x.reshape(-1, x.shape[-1]), keep.expand(x.shape).reshape(-1, x.shape[-1])
    out = torch.zeros_like(rows)
    for i in range(rows.shape[0]):
        if allowed[i].any():
            out[i, allowed[i]] = reference(rows[i, allowed[i]])
    return out.reshape(x.shape)


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("masked", [False, True])
def test_forward_matches_independent_reference(name, masked):
    forward, reference = CASES[name]
    x = scores(2, 5, 9, seed=3)
    keep = random_mask(x.shape) if masked else torch.ones_like(x, dtype=torch.bool)
    expected = masked_reference(reference, x, keep)
    torch.testing.assert_close(forward(x, RowMask(keep) if masked else NO_MASK), expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", CASES)
def test_structured_mask_equals_dense_mask(name):
    forward, _ = CASES[name]
    x = scores(2, 3, 6, 6, seed=4)
    lengths = torch.tensor([4, 6])
    structured = RowMask(None, 1, lengths)
    dense = (torch.arange(6) <= torch.arange(6)[:, None] + 1) & (torch.arange(6) < lengths.reshape(2, 1, 1, 1))
    torch.testing.assert_close(forward(x, structured), forward(x, RowMask(dense)), rtol=0, atol=0)


def mpmath_entmax(row: torch.Tensor, alpha: float) -> list[float]:
    """alpha-entmax of a float64 row at 150 digits: bisection on the threshold in score space."""
    with mpmath.workdps(150):
        a = mpmath.mpf(alpha)
        values = [mpmath.mpf(float(v)) for v in row]
        power = 1 / (a - 1)
        low, high = max(values) - 1 / (a - 1), max(values)
        for _ in range(500):
            middle = (low + high) / 2
            if sum(((a - 1) * (v - middle)) ** power for v in values if v > middle) >= 1:
                low = middle
            else:
                high = middle
        return [float(((a - 1) * (v - low)) ** power) if v > low else 0.0 for v in values]


@pytest.mark.parametrize("alpha", [3.0, 10.0, 30.0])
def test_entmax_large_alpha_matches_mpmath(alpha):
    x = scores(6, 8, seed=int(alpha), scale=0.3)
    expected = torch.tensor([mpmath_entmax(row, alpha) for row in x], dtype=F64)
    assert (expected > 0).sum() > x.shape[0]  # some rows have several support positions
    torch.testing.assert_close(R.entmax(x, NO_MASK, alpha), expected, rtol=0, atol=1e-14)


def test_per_row_alpha_matches_each_alpha():
    alphas = [1.0, 1.5, 2.0, 1.25, 4.0, 1.0]
    x = scores(len(alphas), 7, seed=5)
    alpha = torch.tensor(alphas, dtype=torch.float32)[:, None]
    expected = torch.stack([entmax_reference(row, a) for row, a in zip(x, alphas, strict=True)])
    torch.testing.assert_close(R.entmax(x, NO_MASK, alpha), expected, rtol=0, atol=1e-12)


def test_topk_ties_keep_lowest_index():
    x = torch.tensor([[1.0, 3.0, 2.0, 3.0, 2.0, 2.0]], dtype=F64)
    y = R.topk_softmax(x, NO_MASK, 3)
    assert (y > 0).tolist() == [[False, True, True, True, False, False]]
    y = R.topk_softmax(torch.full((1, 5), 0.5, dtype=F64), NO_MASK, 2)
    torch.testing.assert_close(y, torch.tensor([[0.5, 0.5, 0, 0, 0]], dtype=F64))


@pytest.mark.parametrize(("k", "n", "kept"), [(0.06, 100, 6), (0.01, 50, 1), (0.5, 7, 4), (0.999, 3, 3)])
def test_topk_fraction_counts_allowed_positions(k, n, kept):
    x = scores(1, n + 3, seed=n)
    keep = torch.arange(n + 3) < n
    y = R.topk_softmax(x, RowMask(keep[None]), k, True)
    assert int((y > 0).sum()) == kept


def test_topk_posinf_row_is_uniform_over_first_k():
    x = torch.tensor([[math.inf, 0.0, math.inf, math.inf, 1.0]])
    torch.testing.assert_close(R.topk_softmax(x, NO_MASK, 2), torch.tensor([[0.5, 0, 0.5, 0, 0]]))


FORWARDS = {name: forward for name, (forward, _) in CASES.items()}


@pytest.mark.parametrize("name", FORWARDS)
def test_special_rows(name):
    inf, nan = math.inf, math.nan
    x = torch.tensor(
        [
            [1.0, 2.0, 3.0, 4.0],  # fully masked below
            [-inf, -inf, -inf, -inf],
            [inf, 0.5, inf, -inf],
            [0.5, nan, 1.0, 2.0],
        ],
        dtype=F64,
        requires_grad=True,
    )
    keep = torch.tensor([[False] * 4, [True] * 4, [True] * 4, [True] * 4])
    y = FORWARDS[name](x, RowMask(keep))
    assert (y[:2] == 0).all()
    uniform = torch.tensor([0.5, 0, 0.5, 0], dtype=F64)
    if name == "sa_plain":
        uniform = torch.tensor([inf, 0, inf, 0], dtype=F64)
    torch.testing.assert_close(y[2], uniform)
    assert y[3].isnan().all()
    (grad,) = torch.autograd.grad(torch.where(y.isfinite(), y, 0).sum(), x)
    assert (grad[:3] == 0).all()


@pytest.mark.parametrize("name", FORWARDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_finite_extreme_scores_stay_finite(name, dtype):
    big = torch.finfo(dtype).max
    x = torch.tensor([[big, 0.0, -big, 1.0], [big / 2, big / 2 * 0.99, -big, 0.0]], dtype=dtype, requires_grad=True)
    y = FORWARDS[name](x, NO_MASK)
    assert y.isfinite().all()
    (grad,) = torch.autograd.grad(y.sum(), x)
    assert not grad.isnan().any()


def test_softmax_low_temperature_on_huge_scores():
    y = R.softmax(torch.tensor([[3e38, 0.0]]), NO_MASK, 0.5)
    torch.testing.assert_close(y, torch.tensor([[1.0, 0.0]]))


def test_self_adjusted_denormal_and_overflowing_spans():
    denormal = torch.tensor([[1e-40, 3e-40, 0.0, 2e-40]])
    y = R.self_adjusted_softmax(denormal, NO_MASK, True)
    torch.testing.assert_close(y, self_adjusted_reference(denormal).float(), rtol=1e-2, atol=0)
    huge = torch.tensor([[3.06e38, -3.06e38, 0.0]])
    torch.testing.assert_close(R.self_adjusted_softmax(huge, NO_MASK, True), torch.tensor([[1.0, 0.0, 0.0]]))


def test_half_inputs_compute_in_their_dtype():
    x = scores(3, 8, seed=6, dtype=torch.float16)
    for name, forward in FORWARDS.items():
        y = forward(x, NO_MASK)
        assert y.dtype == torch.float16, name
        expected = forward(x.double(), NO_MASK)
        torch.testing.assert_close(y.double(), expected, rtol=0, atol=5e-3, msg=name)


# ---- gradients --------------------------------------------------------------------------

PARAMETRIC = {
    "softmax": (lambda x, p: R.softmax(x, NO_MASK, 0.5 + p[..., :1].exp()), 1),
    "ssmax": (lambda x, p: R.scalable_softmax(x, NO_MASK, p[..., :1], p[..., 1:]), 2),
    "topk": (lambda x, p: R.topk_softmax(x, NO_MASK, 3, False, 0.5 + p[..., :1].exp()), 1),
    "entmax": (lambda x, p: R.entmax(x, NO_MASK, 1.2 + p[..., :1].exp()), 1),
    "entmax15": (lambda x, p: R.entmax(x, NO_MASK, 1.5) * p[..., :1], 1),
    "sparsemax": (lambda x, p: R.sparsemax(x, NO_MASK) * p[..., :1], 1),
    "sa": (lambda x, p: R.self_adjusted_softmax(x, NO_MASK, True) * p[..., :1], 1),
    "sa_plain": (lambda x, p: R.self_adjusted_softmax(x, NO_MASK, False) * p[..., :1], 1),
}


@pytest.mark.parametrize("name", PARAMETRIC)
def test_gradcheck_and_gradgradcheck(name):
    forward, params = PARAMETRIC[name]
    x = scores(3, 6, seed=7).requires_grad_()
    p = (scores(3, params, seed=8, scale=0.3) + 0.6).requires_grad_()
    assert gradcheck(forward, (x, p), atol=1e-7)
    assert gradgradcheck(forward, (x, p), atol=1e-6)


def test_gradcheck_masked_per_row_alpha_with_softmax_rows():
    keep = random_mask((4, 7))
    keep[1, :3] = True
    x = scores(4, 7, seed=9).requires_grad_()
    alpha = torch.tensor([[1.0], [1.7], [2.0], [3.0]], dtype=F64, requires_grad=True)
    forward = lambda x, a: R.entmax(x, RowMask(keep), a)
    assert gradcheck(forward, (x, alpha), atol=1e-7)
    assert gradgradcheck(forward, (x, alpha), atol=1e-6)


def vjp_of(forward, inputs, grad):
    out = forward(*inputs)
    return torch.autograd.grad(out, inputs, grad)


def test_softmax_jacobians_match_autograd():
    x = scores(4, 6, seed=10).requires_grad_()
    temperature = torch.tensor([[0.5], [1.0], [2.0], [3.0]], dtype=F64, requires_grad=True)
    g = scores(4, 6, seed=11)
    y = R.softmax(x, NO_MASK, temperature)
    dx, dt = vjp_of(lambda x, t: R.softmax(x, NO_MASK, t), (x, temperature), g)
    torch.testing.assert_close(jacobians.softmax_vjp(y, g, 1 / temperature), dx, rtol=0, atol=1e-13)
    torch.testing.assert_close(jacobians.temperature_grad(y, g, 1 / temperature), dt, rtol=0, atol=1e-13)
    s = torch.tensor([[0.3], [0.5], [-0.2], [1.0]], dtype=F64, requires_grad=True)
    y = R.scalable_softmax(x, NO_MASK, s, 0.0)
    _, ds = vjp_of(lambda x, s: R.scalable_softmax(x, NO_MASK, s, 0.0), (x, s), g)
    torch.testing.assert_close(jacobians.multiplier_grad(y, g, x) * math.log(6), ds, rtol=0, atol=1e-13)


def test_entmax_jacobians_match_autograd():
    x = scores(4, 6, seed=12).requires_grad_()
    alpha = torch.tensor([[1.0], [1.5], [2.0], [2.7]], dtype=F64, requires_grad=True)
    g = scores(4, 6, seed=13)
    y = R.entmax(x, NO_MASK, alpha)
    dx, dalpha = vjp_of(lambda x, a: R.entmax(x, NO_MASK, a), (x, alpha), g)
    gate = torch.ones(4, 1, dtype=F64)
    torch.testing.assert_close(jacobians.entmax_vjp(y, g, gate, alpha), dx, rtol=0, atol=1e-13)
    torch.testing.assert_close(jacobians.entmax_alpha_grad(y, g, gate, alpha), dalpha, rtol=0, atol=1e-13)
    # the closed forms themselves against finite differences (independent of the Function's backward)
    numeric = torch.autograd.functional.jacobian(lambda a: (R.entmax(x.detach(), NO_MASK, a) * g).sum(), alpha)
    torch.testing.assert_close(dalpha[1:], numeric[1:], rtol=0, atol=1e-6)


def test_closed_forms_differentiate_again():
    """Each closed form, fed the forward's output, is smooth in (x, grad, parameter): double backward works."""
    x = scores(3, 6, seed=27).requires_grad_()
    g = scores(3, 6, seed=28).requires_grad_()
    t = torch.tensor([[0.7], [1.3], [2.0]], dtype=F64, requires_grad=True)
    alpha = torch.tensor([[1.3], [1.6], [2.4]], dtype=F64, requires_grad=True)  # d alpha is 0 at alpha = 1
    closed_forms = [
        (lambda x, g, t: jacobians.softmax_vjp(R.softmax(x, NO_MASK, t), g, 1 / t), t),
        (lambda x, g, t: jacobians.temperature_grad(R.softmax(x, NO_MASK, t), g, 1 / t), t),
        (lambda x, g, t: jacobians.multiplier_grad(R.softmax(x, NO_MASK, t), g, x), t),
        (lambda x, g, a: jacobians.entmax_vjp(R.entmax(x, NO_MASK, a), g, 1.0, a), alpha),
        (lambda x, g, a: jacobians.entmax_alpha_grad(R.entmax(x, NO_MASK, a), g, 1.0, a), alpha),
    ]
    for closed_form, parameter in closed_forms:
        assert gradcheck(closed_form, (x, g, parameter), atol=1e-7)


@pytest.mark.parametrize("normalized", [True, False])
def test_self_adjusted_vjp_matches_autograd_and_differentiates_again(normalized):
    keep = random_mask((4, 7))
    keep[2] = True
    x = scores(4, 7, seed=14)
    x[3, 4] = math.inf
    x.requires_grad_()
    mask = RowMask(keep)
    g = scores(4, 7, seed=15)
    (dx,) = vjp_of(lambda x: R.self_adjusted_softmax(x, mask, normalized), (x,), g)
    torch.testing.assert_close(jacobians.self_adjusted_vjp(x, mask, g, normalized), dx, rtol=0, atol=1e-13)
    x64 = scores(3, 7, seed=16).requires_grad_()
    g64 = scores(3, 7, seed=17).requires_grad_()
    assert gradcheck(lambda x, g: jacobians.self_adjusted_vjp(x, NO_MASK, g, normalized), (x64, g64))


# ---- the backend functions --------------------------------------------------------------

STRUCTURED = RowMask(None, 0, torch.tensor([5, 3]))


def row_shape(x):
    return x.shape[:-1]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64])
def test_softmax_backend_matches_forwards(dtype):
    x = scores(2, 2, 6, 6, seed=18, dtype=dtype)
    acc = torch.float64 if dtype == F64 else torch.float32
    y, m, log_count = R.softmax_forward(x, STRUCTURED, 0, 0.5, 0.0)
    assert (y.dtype, m.dtype, m.shape, log_count) == (dtype, acc, row_shape(x), None)
    torch.testing.assert_close(y, R.softmax(x.to(acc), STRUCTURED, 0.5).to(dtype))
    s = torch.full((2, 2, 1, 1), 0.4, dtype=torch.float32)
    y, m, log_count = R.softmax_forward(x, STRUCTURED, 1, s, 0.1)
    torch.testing.assert_close(y, R.scalable_softmax(x.to(acc), STRUCTURED, s, 0.1).to(dtype))
    n = torch.minimum(torch.arange(6)[:, None] + 1, torch.tensor([5, 3])[:, None, None, None]).expand(2, 2, 6, 1)
    torch.testing.assert_close(log_count, n.squeeze(-1).log().to(acc))
    torch.testing.assert_close(m, 0.4 * log_count + 0.1)
    g = scores(*x.shape, seed=19, dtype=dtype)
    dx, none = R.softmax_backward(y, g, m, x, 0)
    assert none is None and dx.dtype == dtype
    torch.testing.assert_close(dx, jacobians.softmax_vjp(y.to(acc), g.to(acc), m.unsqueeze(-1)).to(dtype))
    _, dm = R.softmax_backward(y, g, m, x, 2)
    _, dt = R.softmax_backward(y, g, m, None, 1)
    assert dm.shape == dt.shape == row_shape(x) and dm.dtype == dt.dtype == acc


def test_backend_gradients_equal_autograd_of_forwards():
    x = scores(3, 7, seed=20).requires_grad_()
    g = scores(3, 7, seed=21)
    temperature = torch.tensor([[0.5], [1.0], [2.0]], dtype=F64, requires_grad=True)
    y, m = R.topk_forward(x.detach(), NO_MASK, 4, False, temperature.detach())
    dx, dt = R.softmax_backward(y, g, m, x.detach(), 1)
    expected = vjp_of(lambda x, t: R.topk_softmax(x, NO_MASK, 4, False, t), (x, temperature), g)
    torch.testing.assert_close((dx, dt), (expected[0], expected[1].squeeze(-1)))
    alpha = torch.tensor([[1.0], [1.5], [3.0]], dtype=F64, requires_grad=True)
    y, gate = R.entmax_forward(x.detach(), NO_MASK, alpha.detach())
    dx, dalpha = R.entmax_backward(y, g, gate, alpha.detach(), True)
    expected = vjp_of(lambda x, a: R.entmax(x, NO_MASK, a), (x, alpha), g)
    torch.testing.assert_close((dx, dalpha), (expected[0], expected[1].squeeze(-1)))
    for normalized in (True, False):
        y, stats = R.self_adjusted_forward(x.detach(), NO_MASK, normalized)
        assert stats.shape == (3, 5) and stats.dtype == F64
        weights = torch.exp((x.detach() - stats[:, :1]) - stats[:, 1:2])
        torch.testing.assert_close(weights, torch.softmax(x.detach(), -1))
        dx = R.self_adjusted_backward(x.detach(), NO_MASK, g, stats, normalized)
        (expected,) = vjp_of(lambda x: R.self_adjusted_softmax(x, NO_MASK, normalized), (x,), g)  # noqa: B023
        torch.testing.assert_close(dx, expected)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_backend_half_and_single_precision(dtype):
    x = scores(2, 3, 5, 5, seed=22, dtype=dtype)
    g = scores(2, 3, 5, 5, seed=23, dtype=dtype)
    y, gate = R.entmax_forward(x, STRUCTURED, torch.full((2, 3, 1, 1), 1.7))
    assert (y.dtype, gate.dtype, gate.shape) == (dtype, torch.float32, (2, 3, 5))
    dx, dalpha = R.entmax_backward(y, g, gate, 1.7, True)
    assert (dx.dtype, dalpha.dtype, dalpha.shape) == (dtype, torch.float32, (2, 3, 5))
    y, stats = R.self_adjusted_forward(x, STRUCTURED, True)
    assert (y.dtype, stats.dtype, stats.shape) == (dtype, torch.float32, (2, 3, 5, 5))
    assert R.self_adjusted_backward(x, STRUCTURED, g, stats, True).dtype == dtype
    y, m = R.topk_forward(x, STRUCTURED, 0.5, True, 1.0)
    assert (y.dtype, m.dtype, m.shape) == (dtype, torch.float32, (2, 3, 5))


def test_backend_special_rows():
    inf = math.inf
    x = torch.tensor([[1.0, 2.0, 3.0], [inf, 0.0, 1.0], [0.0, 1.0, 2.0]])
    keep = RowMask(torch.tensor([[False] * 3, [True] * 3, [True] * 3]))
    _, m, _ = R.softmax_forward(x, keep, 0, 2.0, 0.0)
    assert m.tolist() == [0.5, 0.0, 0.5]
    _, gate = R.entmax_forward(x, keep, 1.5)
    assert gate.tolist() == [1.0, 0.0, 1.0]
    _, stats = R.self_adjusted_forward(x, keep, True)
    assert stats[:, 4].tolist() == [0.0, 0.0, 1.0]
    dx = R.self_adjusted_backward(x, keep, torch.ones_like(x), stats, True)
    assert (dx[:2] == 0).all()


# ---- torch.func and torch.compile -------------------------------------------------------

TRANSFORMED = {
    "softmax": lambda x: R.softmax(x, NO_MASK, 0.7),
    "ssmax": lambda x: R.scalable_softmax(x, NO_MASK, 0.5, 0.1),
    "topk": lambda x: R.topk_softmax(x, NO_MASK, 0.5, True, 1.0),
    "entmax1.3": lambda x: R.entmax(x, NO_MASK, 1.3),
    "entmax1.5": lambda x: R.entmax(x, NO_MASK, 1.5),
    "entmax_rows": lambda x: R.entmax(x, NO_MASK, torch.tensor([1.0, 2.0, 1.5, 4.0], dtype=x.dtype)[:, None]),
    "sparsemax": lambda x: R.sparsemax(x, NO_MASK),
    "sa": lambda x: R.self_adjusted_softmax(x, NO_MASK, True),
}


@pytest.mark.parametrize("name", TRANSFORMED)
def test_vmap_and_jacrev_equal_loops(name):
    forward = TRANSFORMED[name]
    batch = scores(3, 4, 6, seed=24)
    torch.testing.assert_close(torch.func.vmap(forward)(batch), torch.stack([forward(x) for x in batch]))
    jac = torch.func.vmap(torch.func.jacrev(forward))(batch)
    looped = torch.stack([torch.autograd.functional.jacobian(forward, x) for x in batch])
    torch.testing.assert_close(jac, looped, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", TRANSFORMED)
def test_compiles_without_graph_breaks(name):
    forward = TRANSFORMED[name]
    x = scores(4, 6, seed=25)
    torch._dynamo.reset()
    assert torch._dynamo.explain(forward)(x).graph_break_count == 0
    compiled = torch.compile(forward, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x), forward(x))


def test_masked_compile_and_vmap():
    keep = random_mask((4, 6))
    forward = partial(R.entmax, mask=RowMask(keep), alpha=2.5)
    x = scores(2, 4, 6, seed=26)
    torch._dynamo.reset()
    assert torch._dynamo.explain(forward)(x[0]).graph_break_count == 0
    torch.testing.assert_close(torch.func.vmap(forward)(x), torch.stack([forward(row) for row in x]))
