"""The native kernels' soft-capping (kernels/README.md, "Soft-capping"), called directly.

The expected values never come from the code under test: the cap is applied here in
float64 torch (``c(x) = cap tanh(x / cap)``, -inf kept), the reference backend
(attnorm.kernels.reference, without its softcap keyword) runs on the capped scores, and a
backward's expected ``dx`` is the reference's at the capped scores times
``1 - tanh(x / cap)^2`` in float64 (0 at infinite scores).  torch.autograd through float64
formulas (softmax with a temperature, the entmax package's entmax15 and sparsemax, plain
SA-Softmax) checks the chain rule against something other than a backend.
"""

from __future__ import annotations

import math

import entmax
import pytest
import torch
from torch import Tensor

from attnorm.kernels import reference, rules
from attnorm.kernels.cpu import build, native
from tests.kernels.test_native_sinks import masks

pytestmark = pytest.mark.skipif(not build.usable(), reason="native kernels unavailable (no C compiler)")

NO_MASK = rules.RowMask()
DTYPES = [torch.float32, torch.float64]
TOLERANCE = {torch.float32: {"atol": 3e-6, "rtol": 1e-4}, torch.float64: {"atol": 1e-12, "rtol": 1e-9}}
LOOSE = {torch.float32: {"atol": 2e-5, "rtol": 1e-3}, torch.float64: {"atol": 1e-10, "rtol": 1e-8}}
SHAPE = (2, 2, 4, 7)  # (B, H, Lq, Lk)
CAPS = [0.5, 4.0, 1e4]
ALPHAS = [1.0, 1.5, 2.0, 1.3, 2.5]


def close(got: Tensor, expected: Tensor, dtype: torch.dtype, **overrides: float) -> None:
    torch.testing.assert_close(got.double(), expected.double(), equal_nan=True, **{**TOLERANCE[dtype], **overrides})


def capped(x: Tensor, cap: float) -> Tensor:
    """The capped scores in float64: the oracle's input."""
    x = x.double()
    return torch.where(x == -math.inf, x, cap * torch.tanh(x / cap))


def slope(x: Tensor, cap: float) -> Tensor:
    """``dc/dx = 1 - tanh(x / cap)^2 = 1 / cosh(x / cap)^2`` in float64 (the latter: no cancellation), 0 at infinite
    scores."""
    x = x.double()
    return torch.where(x.isfinite(), torch.cosh(x / cap).reciprocal().square(), 0.0)


MASKS = masks(SHAPE)


def scores(dtype: torch.dtype, seed: int = 0) -> Tensor:
    """Random scores with +inf (capped: no longer special), -inf, a NaN row and huge scores."""
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 3
    x[0, 1, 2, 3] = math.inf
    x[1, 1, 2, [1, 4]] = math.inf
    x[1, 0, 2, 5] = math.nan
    x[0, 0, 3, ::2] = -math.inf
    x[0, 0, 0, :4] = torch.tensor([1e30, -1e30, 3e38, -3e38], dtype=torch.float64)
    x[1, 1, 3, 2:5] = torch.tensor([1e30, 3e38, -1e30], dtype=torch.float64)
    return x.to(dtype)


def sinks(dtype: torch.dtype) -> Tensor:
    sink = torch.randn(SHAPE[:-1], generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    sink[0, 0, 1] = -math.inf
    sink[1, 1, 0] = 10.0  # above every capped score with the small caps: the sink is not capped
    return sink.to(dtype)


def gradient(dtype: torch.dtype) -> Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(3), dtype=torch.float64).to(dtype)


def per_row_parameter(values: list[float], dtype: torch.dtype) -> Tensor:
    rows = math.prod(SHAPE[:-1])
    return torch.tensor(values, dtype=dtype).repeat(rows)[:rows].reshape(*SHAPE[:-1], 1)


def sink_keywords(sink: Tensor | None) -> dict[str, Tensor]:
    return {} if sink is None else {"sink": sink}


def through_cap(dx_capped: Tensor, x: Tensor, cap: float) -> Tensor:
    """The reference's dx at the capped scores carried to the raw scores."""
    return dx_capped.double() * slope(x, cap)


WITH_SINK = pytest.mark.parametrize("with_sink", [False, True], ids=["no_sink", "sink"])


# ---- forward passes: the function of the capped row -----------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask_name", MASKS)
@pytest.mark.parametrize("cap", CAPS)
@WITH_SINK
def test_softmax_and_scalable_softmax_of_the_capped_row(dtype, mask_name, cap, with_sink):
    x, mask = scores(dtype), MASKS[mask_name]
    sink = sinks(dtype) if with_sink else None
    keyword, expected_keyword = sink_keywords(sink), sink_keywords(None if sink is None else sink.double())
    temperature = per_row_parameter([0.7, 1.3, -2.0], dtype)
    out = native.softmax_forward(x, mask, 0, temperature, 0.0, softcap=cap, **keyword)
    expected = reference.softmax_forward(capped(x, cap), mask, 0, temperature.double(), 0.0, **expected_keyword)
    for got, want in zip(out, expected, strict=True):
        if want is not None:
            close(got, want, dtype)
    out = native.softmax_forward(x, mask, 1, 0.6, per_row_parameter([0.1, 0.5], dtype), softcap=cap, **keyword)
    expected = reference.softmax_forward(capped(x, cap), mask, 1, 0.6, per_row_parameter([0.1, 0.5], torch.float64),
                                         **expected_keyword)
    for got, want in zip(out, expected, strict=True):
        close(got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask_name", MASKS)
@pytest.mark.parametrize("cap", [4.0, 1e4])  # no float32 ties among moderate capped scores
@WITH_SINK
def test_topk_of_the_capped_row(dtype, mask_name, cap, with_sink):
    x, mask = scores(dtype), MASKS[mask_name]
    x[0, 0, 0, :4] = torch.tensor([5.0, -1.0, 7.0, -9.0])  # saturated scores would tie; see the test below
    x[1, 1, 3, 2:5] = torch.tensor([2.5, 8.0, -6.0])
    sink = sinks(dtype) if with_sink else None
    keyword, expected_keyword = sink_keywords(sink), sink_keywords(None if sink is None else sink.double())
    temperature = per_row_parameter([1.0, 0.5, 2.0], dtype)
    for k, is_fraction in [(3, False), (0.5, True)]:
        out = native.topk_forward(x, mask, k, is_fraction, temperature, softcap=cap, **keyword)
        expected = reference.topk_forward(capped(x, cap), mask, k, is_fraction, temperature.double(),
                                          **expected_keyword)
        for got, want in zip(out, expected, strict=True):
            close(got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_topk_saturated_scores_tie_at_the_cap_and_the_lowest_index_wins(dtype):
    x = torch.tensor([[1e30, 3e38, 0.0, math.inf, 2e30]], dtype=dtype)
    y, multiplier = native.topk_forward(x, NO_MASK, 2, False, 1.0, softcap=0.5)
    expected = torch.tensor([[0.5, 0.5, 0.0, 0.0, 0.0]], dtype=torch.float64)  # c = 0.5 at 0, 1, 3, 4
    close(y, expected, dtype)
    close(multiplier, torch.ones(1, dtype=torch.float64), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask_name", MASKS)
@pytest.mark.parametrize("cap", CAPS)
@WITH_SINK
def test_entmax_of_the_capped_row(dtype, mask_name, cap, with_sink):
    x, mask = scores(dtype), MASKS[mask_name]
    sink = sinks(dtype) if with_sink else None
    keyword, expected_keyword = sink_keywords(sink), sink_keywords(None if sink is None else sink.double())
    for alpha in [*ALPHAS, "per_row"]:
        alpha = per_row_parameter(ALPHAS, dtype) if alpha == "per_row" else alpha
        alpha64 = alpha.double() if isinstance(alpha, Tensor) else alpha
        out = native.entmax_forward(x, mask, alpha, softcap=cap, **keyword)
        expected = reference.entmax_forward(capped(x, cap), mask, alpha64, **expected_keyword)
        for got, want in zip(out, expected, strict=True):
            close(got, want, dtype, **LOOSE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask_name", MASKS)
@pytest.mark.parametrize("cap", CAPS)
@WITH_SINK
def test_self_adjusted_of_the_capped_row(dtype, mask_name, cap, with_sink):
    x, mask = scores(dtype), MASKS[mask_name]
    sink = sinks(dtype) if with_sink else None
    keyword, expected_keyword = sink_keywords(sink), sink_keywords(None if sink is None else sink.double())
    for normalized in (False, True):
        y, stats, *weight = native.self_adjusted_forward(x, mask, normalized, softcap=cap, **keyword)
        expected, expected_stats, *expected_weight = reference.self_adjusted_forward(capped(x, cap), mask, normalized,
                                                                                     **expected_keyword)
        close(y, expected, dtype)
        for got, want in zip(weight, expected_weight, strict=True):
            close(got, want, dtype)
        # (c0, c1) may differ between backends (any shift of the log-sum); the gate may not, nor
        # low and high where the factor uses them, in capped units (NaN rows left out: NaN here)
        number = ~y.isnan().any(-1)
        close(stats[number][:, 4], expected_stats[number][:, 4], dtype)
        if normalized:
            close(stats[number][:, 2:4], expected_stats[number][:, 2:4], dtype)


# ---- backward passes: the reference at the capped scores, times the cap's slope -------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask_name", MASKS)
@pytest.mark.parametrize("param_grad", [0, 1, 2])
@pytest.mark.parametrize("forward", ["softmax", "scalable_softmax", "topk"])
@WITH_SINK
def test_softmax_backward_through_the_cap(dtype, mask_name, param_grad, forward, with_sink):
    cap = 0.5 if forward != "topk" else 4.0
    x, mask, grad = scores(dtype), MASKS[mask_name], gradient(dtype)
    if forward == "topk":  # saturated scores would tie
        x[0, 0, 0, :4] = torch.tensor([5.0, -1.0, 7.0, -9.0])
        x[1, 1, 3, 2:5] = torch.tensor([2.5, 8.0, -6.0])
    sink = sinks(dtype) if with_sink else None
    keyword = sink_keywords(sink)
    if forward == "softmax":
        y, multiplier, _, *weight = native.softmax_forward(x, mask, 0, per_row_parameter([0.7, 1.3], dtype), 0.0,
                                                           softcap=cap, **keyword)
    elif forward == "scalable_softmax":
        y, multiplier, _, *weight = native.softmax_forward(x, mask, 1, 0.6, 0.2, softcap=cap, **keyword)
    else:
        y, multiplier, *weight = native.topk_forward(x, mask, 3, False, 0.8, softcap=cap, **keyword)
    raw = rules.masked_scores(x, mask)
    sink_keyword = {} if sink is None else {"sink_weight": weight[0], "sink": sink}
    dx, per_row, *dsink = native.softmax_backward(y, grad, multiplier, raw, param_grad, softcap=cap, **sink_keyword)
    expected_keyword = {} if sink is None else {"sink_weight": weight[0].double(), "sink": sink.double()}
    expected = reference.softmax_backward(y.double(), grad.double(), multiplier.double(), capped(raw, cap), param_grad,
                                          **expected_keyword)
    close(dx, through_cap(expected[0], raw, cap), dtype)
    if sink is not None:
        close(dsink[0], expected[2], dtype)
    if param_grad:  # NaN in rows holding NaN, as the reference's
        close(per_row, expected[1], dtype, atol=2e-5 if dtype == torch.float32 else 1e-11)
    else:
        assert per_row is None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask_name", MASKS)
@pytest.mark.parametrize("cap", [0.5, 1e4])
@WITH_SINK
def test_entmax_backward_through_the_cap(dtype, mask_name, cap, with_sink):
    x, mask, grad = scores(dtype), MASKS[mask_name], gradient(dtype)
    sink = sinks(dtype) if with_sink else None
    raw = rules.masked_scores(x, mask)
    for alpha in [*ALPHAS, "per_row"]:
        alpha = per_row_parameter(ALPHAS, dtype) if alpha == "per_row" else alpha
        alpha64 = alpha.double() if isinstance(alpha, Tensor) else alpha
        y, gate, *weight = native.entmax_forward(x, mask, alpha, softcap=cap, **sink_keywords(sink))
        weight_keyword = {} if sink is None else {"sink_weight": weight[0]}
        dx, alpha_grad, *dsink = native.entmax_backward(y, grad, gate, alpha, True, x=raw, softcap=cap,
                                                        **weight_keyword)
        expected = reference.entmax_backward(y.double(), grad.double(), gate.double(), alpha64, True,
                                             **({} if sink is None else {"sink_weight": weight[0].double()}))
        close(dx, through_cap(expected[0], raw, cap), dtype, **LOOSE[dtype])
        close(alpha_grad, expected[1], dtype, **LOOSE[dtype])
        if sink is not None:
            close(dsink[0], expected[2], dtype, **LOOSE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask_name", MASKS)
@pytest.mark.parametrize("cap", [0.5, 1e4])
@WITH_SINK
def test_self_adjusted_backward_through_the_cap(dtype, mask_name, cap, with_sink):
    x, mask, grad = scores(dtype), MASKS[mask_name], gradient(dtype)
    sink = sinks(dtype) if with_sink else None
    keyword, expected_keyword = sink_keywords(sink), sink_keywords(None if sink is None else sink.double())
    raw = rules.masked_scores(x, mask)
    for normalized in (False, True):
        _, stats, *_ = native.self_adjusted_forward(x, mask, normalized, softcap=cap, **keyword)
        out = native.self_adjusted_backward(x, mask, grad, stats, normalized, softcap=cap, **keyword)
        _, expected_stats, *_ = reference.self_adjusted_forward(capped(x, cap), mask, normalized, **expected_keyword)
        expected = reference.self_adjusted_backward(capped(x, cap), mask, grad.double(), expected_stats, normalized,
                                                    **expected_keyword)
        if sink is None:
            close(out, through_cap(expected, raw, cap), dtype)
        else:
            close(out[0], through_cap(expected[0], raw, cap), dtype)
            close(out[1], expected[1], dtype)


# ---- against torch.autograd through float64 formulas -----------------------------------------


def finite_rows(seed: int = 4) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(6, 9, generator=generator, dtype=torch.float64) * 4
    x[0, 0] = 1e30  # saturated: slope 0
    return x, torch.randn(6, 9, generator=generator, dtype=torch.float64)


def autograd(formula, *leaves: Tensor, grad: Tensor) -> tuple[Tensor, ...]:
    leaves = tuple(leaf.detach().clone().requires_grad_(True) for leaf in leaves)
    return torch.autograd.grad((formula(*leaves) * grad).sum(), leaves)


def tanh_cap(x: Tensor, cap: float) -> Tensor:
    return cap * torch.tanh(x / cap)


@pytest.mark.parametrize("cap", [0.5, 3.0, 1e4])
def test_softmax_with_a_temperature_matches_autograd(cap):
    x, grad = finite_rows()
    temperature = torch.tensor([0.7, 1.3, 2.0, 0.5, 1.0, -1.5], dtype=torch.float64).unsqueeze(-1)
    y, multiplier, _ = native.softmax_forward(x, NO_MASK, 0, temperature, 0.0, softcap=cap)
    dx, dtemperature = native.softmax_backward(y, grad, multiplier, x, 1, softcap=cap)
    formula = lambda x, t: torch.softmax(tanh_cap(x, cap) / t, -1)  # noqa: E731
    close(y, formula(x, temperature), torch.float64)
    expected_dx, expected_dtemperature = autograd(formula, x, temperature, grad=grad)
    close(dx, expected_dx, torch.float64)
    close(dtemperature, expected_dtemperature.squeeze(-1), torch.float64)


def test_scalable_softmax_multiplier_gradient_matches_autograd():
    x, grad = finite_rows(5)
    y, multiplier, _ = native.softmax_forward(x, NO_MASK, 1, 0.6, 0.2, softcap=2.0)
    dx, dmultiplier = native.softmax_backward(y, grad, multiplier, x, 2, softcap=2.0)
    expected = autograd(lambda x, m: torch.softmax(m[:, None] * tanh_cap(x, 2.0), -1), x, multiplier, grad=grad)
    close(dx, expected[0], torch.float64)
    close(dmultiplier, expected[1], torch.float64)


@pytest.mark.parametrize("function", ["entmax15", "sparsemax"])
@pytest.mark.parametrize("cap", [0.5, 3.0])
def test_entmax_matches_autograd_through_the_entmax_package(function, cap):
    x, grad = finite_rows(6)
    alpha = 1.5 if function == "entmax15" else 2.0
    y, gate = native.entmax_forward(x, NO_MASK, alpha, softcap=cap)
    dx, _ = native.entmax_backward(y, grad, gate, alpha, False, x=x, softcap=cap)
    formula = lambda x: getattr(entmax, function)(tanh_cap(x, cap), dim=-1)  # noqa: E731
    close(y, formula(x), torch.float64)
    close(dx, autograd(formula, x, grad=grad)[0], torch.float64)


def test_plain_self_adjusted_matches_autograd():
    x, grad = finite_rows(7)
    _, stats = native.self_adjusted_forward(x, NO_MASK, False, softcap=2.0)
    dx = native.self_adjusted_backward(x, NO_MASK, grad, stats, False, softcap=2.0)
    formula = lambda x: tanh_cap(x, 2.0) * torch.softmax(tanh_cap(x, 2.0), -1)  # noqa: E731
    close(dx, autograd(formula, x, grad=grad)[0], torch.float64)


# ---- the cap itself, its slope, and the special scores ---------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cap", CAPS)
def test_the_cap_and_its_slope_match_float64_over_every_magnitude(dtype, cap):
    # Plain SA-Softmax over one position is c(x) itself, and its backward g dc/dx.
    magnitude = torch.logspace(-30, 38, 400, dtype=torch.float64).clamp_max(3e38)
    x = torch.cat([magnitude, -magnitude, torch.tensor([0.0, math.inf])]).to(dtype).unsqueeze(-1)
    y, stats = native.self_adjusted_forward(x, NO_MASK, False, softcap=cap)
    dx = native.self_adjusted_backward(x, NO_MASK, torch.ones_like(x), stats, False, softcap=cap)
    eps = torch.finfo(dtype).eps
    close(y, capped(x, cap), dtype, rtol=4 * eps, atol=0.0)
    # e^(-2|x|/cap) has condition number 2|x|/cap: a few ulps of it, relative, plus underflow
    expected = slope(x, cap)
    bound = (4 * eps * (1 + 2 * x.double().abs() / cap) * expected).nan_to_num(0.0) + torch.finfo(dtype).tiny
    assert ((dx.double() - expected).abs() <= bound).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_posinf_minus_inf_and_nan_scores(dtype):
    x = torch.tensor([[math.inf, 0.0, -math.inf, 1e30], [1.0, math.nan, 0.0, 2.0], [-math.inf] * 4], dtype=dtype)
    grad = torch.tensor([[1.0, -2.0, 3.0, 0.5]] * 3, dtype=dtype)
    cap = 2.0
    c = capped(x, cap)
    expected = torch.softmax(torch.where(c == -math.inf, -math.inf, c), -1)
    expected[2] = 0  # fully masked: zeros
    y, multiplier, _ = native.softmax_forward(x, NO_MASK, 0, 1.0, 0.0, softcap=cap)
    close(y, expected, dtype)
    assert y[0, 0] == y[0, 3] and y[0, 2] == 0  # +inf and 1e30 both become the cap; -inf stays masked
    assert y[1].isnan().all() and multiplier[0] == 1  # +inf is no longer special: m is not zeroed
    dx, _ = native.softmax_backward(y, grad, multiplier, x, 0, softcap=cap)
    assert dx[0, [0, 2, 3]].eq(0).all() and dx[1].isnan().all() and dx[2].eq(0).all()
    for alpha in (1.5, 2.0):
        y, gate = native.entmax_forward(x, NO_MASK, alpha, softcap=cap)
        assert gate[0] == 1 and y[0, 0] == y[0, 3] and y[1].isnan().all() and y[2].eq(0).all()
    _, stats = native.self_adjusted_forward(x, NO_MASK, True, softcap=cap)
    assert stats[0, 4] == 1 and stats[0, 3] == cap and stats[2, 4] == 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_sink_is_not_capped(dtype):
    x = torch.tensor([[0.0, 100.0]], dtype=dtype)
    sink = torch.tensor([100.0], dtype=dtype)
    y, _, _, weight = native.softmax_forward(x, NO_MASK, 0, 1.0, 0.0, sink=sink, softcap=1.0)
    close(weight, torch.ones(1, dtype=torch.float64), dtype, atol=1e-30)  # exp(1 - 100) is nothing beside it
    close(y, torch.zeros(1, 2, dtype=torch.float64), dtype, atol=1e-30)


# ---- without a cap: exactly the uncapped kernels ---------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_without_a_cap_every_function_returns_exactly_the_uncapped_results(dtype):
    x, grad, mask, sink = scores(dtype), gradient(dtype), MASKS["bool"], sinks(dtype)
    raw = rules.masked_scores(x, mask)

    def calls(**cap):
        softmax = native.softmax_forward(x, mask, 1, 0.6, 0.1, sink=sink, **cap)
        topk = native.topk_forward(x, mask, 0.5, True, 0.8, **cap)
        entmax_out = native.entmax_forward(x, mask, 1.3, sink=sink, **cap)
        self_adjusted = native.self_adjusted_forward(x, mask, True, **cap)
        return [
            *softmax, *topk, *entmax_out, *self_adjusted,
            *native.softmax_backward(softmax[0], grad, softmax[1], raw, 2, sink_weight=softmax[3], sink=sink, **cap),
            *native.entmax_backward(entmax_out[0], grad, entmax_out[1], 1.3, True, sink_weight=entmax_out[2], x=raw,
                                    **cap),
            native.self_adjusted_backward(x, mask, grad, self_adjusted[1], True, **cap),
        ]

    def identical(a: Tensor, b: Tensor) -> bool:  # torch.equal, with NaN equal to NaN
        return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())

    plain = calls()
    assert all(identical(a, b) for a, b in zip(plain, calls(softcap=None), strict=True))
    assert not all(identical(a, b) for a, b in zip(plain, calls(softcap=1e4), strict=True))  # the check can fail


# ---- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize("cap", [0.0, -1.0, math.inf, math.nan, True])
def test_bad_caps_name_softcap(cap):
    x = torch.randn(2, 3)
    for call in (
        lambda: native.softmax_forward(x, NO_MASK, 0, 1.0, 0.0, softcap=cap),
        lambda: native.topk_forward(x, NO_MASK, 1, False, 1.0, softcap=cap),
        lambda: native.entmax_forward(x, NO_MASK, 1.5, softcap=cap),
        lambda: native.self_adjusted_forward(x, NO_MASK, False, softcap=cap),
        lambda: native.entmax_backward(x, x, torch.ones(2), 1.5, False, x=x, softcap=cap),
        lambda: native.softmax_backward(x, x, torch.ones(2), x, 0, softcap=cap),
        lambda: native.self_adjusted_backward(x, NO_MASK, x, torch.zeros(2, 5), False, softcap=cap),
    ):
        with pytest.raises(ValueError, match="softcap"):
            call()


def test_capped_backwards_need_the_raw_scores():
    y = torch.softmax(torch.randn(2, 3), -1)
    with pytest.raises(ValueError, match="softcap needs the raw scores x"):
        native.softmax_backward(y, y, torch.ones(2), None, 0, softcap=1.0)
    with pytest.raises(ValueError, match="softcap needs the raw scores x"):
        native.entmax_backward(y, y, torch.ones(2), 1.5, False, softcap=1.0)
