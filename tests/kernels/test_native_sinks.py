"""The native kernels' sink per row (kernels/README.md, "A sink per row"), called directly.

The expected values never come from the code under test: the reference backend
(attnorm.kernels.reference, without its sink keyword) runs in float64 on the extended row
``[x, sink]`` with the sink always allowed, and its last column is the sink's.  The rules
that are not "the function on the extended row" (n counts the real keys only) are
computed explicitly here, and torch.autograd on float64 formulas (softmax over the
concatenation, SA-Softmax, the entmax package's bisection) checks the backward passes
against something other than a backend.
"""

from __future__ import annotations

import math

import entmax
import pytest
import torch
from torch import Tensor

from attnorm.kernels import reference, rules
from attnorm.kernels.cpu import build, native

pytestmark = pytest.mark.skipif(not build.usable(), reason="native kernels unavailable (no C compiler)")

NO_MASK = rules.RowMask()
DTYPES = [torch.float32, torch.float64]
TOLERANCE = {torch.float32: {"atol": 3e-6, "rtol": 1e-4}, torch.float64: {"atol": 1e-12, "rtol": 1e-9}}
SHAPE = (2, 2, 4, 6)  # (B, H, Lq, Lk)
ALPHAS = [1.0, 1.5, 2.0, 1.3, 2.5]


def close(got: Tensor, expected: Tensor | list | float, dtype: torch.dtype, **overrides: float) -> None:
    expected = expected.double() if isinstance(expected, Tensor) else torch.tensor(expected, dtype=torch.float64)
    torch.testing.assert_close(got.double(), expected, equal_nan=True, **{**TOLERANCE[dtype], **overrides})


def masks(shape: tuple[int, ...] = SHAPE) -> dict[str, rules.RowMask]:
    """Each mask kind over scores of ``shape``, with a fully masked row."""
    batch, _, queries, keys = shape
    dense = torch.rand(batch, 1, queries, keys, generator=torch.Generator().manual_seed(1)) > 0.3
    dense[1, 0, 1] = False  # a fully masked row
    return {
        "none": NO_MASK,
        "bool": rules.RowMask(tensor=dense),
        "causal": rules.RowMask(diagonal=-1),  # query 0 has no key
        "key_lengths": rules.RowMask(key_lengths=torch.tensor([keys, 2])),
    }


MASKS = masks()


def scores(dtype: torch.dtype, seed: int = 0) -> Tensor:
    """Random scores with the special rows: +inf (one row also with a +inf sink), NaN, -inf."""
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 2
    x[0, 1, 2, 3] = math.inf  # the sink is +inf too in this row
    x[1, 1, 2, [1, 4]] = math.inf
    x[1, 0, 2, 5] = math.nan
    x[0, 0, 3, ::2] = -math.inf
    return x.to(dtype)


def sinks(dtype: torch.dtype, seed: int = 1) -> Tensor:
    """A sink per row ``SHAPE[:-1]``: random, with -inf, +inf, NaN, dominant and negligible ones."""
    sink = torch.randn(SHAPE[:-1], generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 2
    sink[0, 0, 1] = -math.inf
    sink[0, 1, 2] = math.inf
    sink[1, 0, 3] = math.nan
    sink[1, 1, 0] = 10.0
    sink[1, 1, 1] = -10.0
    return sink.to(dtype)


def extend(x: Tensor, mask: rules.RowMask, sink: Tensor) -> tuple[Tensor, rules.RowMask, Tensor]:
    """``[x, sink]`` in float64, its mask (the sink always allowed) and the real allowed keys per row."""
    keep = rules.allowed(x, mask).expand(x.shape)
    extended = torch.cat([x.double(), sink.double().reshape(*x.shape[:-1], 1)], dim=-1)
    keep = torch.cat([keep, torch.ones_like(keep[..., :1])], dim=-1)
    return extended, rules.RowMask(keep, None, None), keep[..., :-1].sum(-1)


def joined(y: Tensor, weight: Tensor) -> Tensor:
    """``[y, sink_weight]`` in float64: the weights of the extended row."""
    return torch.cat([y.double(), weight.double().unsqueeze(-1)], dim=-1)


def split(extended: Tensor) -> tuple[Tensor, Tensor]:
    """The real positions and the sink's (the last)."""
    return extended[..., :-1], extended[..., -1]


def with_zero(grad: Tensor) -> Tensor:
    """``[g, 0]``: the sink's value is zero, so no gradient reaches its weight."""
    return torch.cat([grad.double(), torch.zeros_like(grad[..., :1], dtype=torch.float64)], dim=-1)


def per_row_parameter(values: list[float], dtype: torch.dtype) -> Tensor:
    """A column ``(..., 1)`` cycling through ``values`` over the rows."""
    rows = math.prod(SHAPE[:-1])
    return torch.tensor(values, dtype=dtype).repeat(rows)[:rows].reshape(*SHAPE[:-1], 1)


def sink_allowed(sink: Tensor) -> Tensor:
    """1 where the sink takes part (its score is not -inf; NaN counts, as NaN scores do)."""
    return (sink != -math.inf).long()


# ---- forward passes against the reference on [x, sink] --------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask_name", MASKS)
@pytest.mark.parametrize("per_row", [False, True], ids=["scalar", "per_row"])
def test_softmax_is_softmax_of_the_extended_row(dtype, mask_name, per_row):
    x, sink, mask = scores(dtype), sinks(dtype), MASKS[mask_name]
    temperature = per_row_parameter([0.7, 1.3, -2.0], dtype) if per_row else 0.7
    y, multiplier, log_count, weight = native.softmax_forward(x, mask, 0, temperature, 0.0, sink=sink)
    extended, extended_mask, _ = extend(x, mask, sink)
    first = temperature.double() if per_row else temperature
    expected, expected_multiplier, _ = reference.softmax_forward(extended, extended_mask, 0, first, 0.0)
    close(y, split(expected)[0], dtype)
    close(weight, split(expected)[1], dtype)
    close(multiplier, expected_multiplier, dtype)
    assert log_count is None
    assert weight.shape == SHAPE[:-1] and weight.dtype == dtype


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask_name", MASKS)
@pytest.mark.parametrize("per_row", [False, True], ids=["scalar", "per_row"])
def test_scalable_softmax_counts_the_real_keys_only(dtype, mask_name, per_row):
    x, sink, mask = scores(dtype), sinks(dtype), MASKS[mask_name]
    s = per_row_parameter([0.6, -0.4, 1.2], dtype) if per_row else 0.6
    bias = per_row_parameter([0.1, 0.5], dtype) if per_row else 0.1
    y, multiplier, log_count, weight = native.softmax_forward(x, mask, 1, s, bias, sink=sink)
    extended, extended_mask, n = extend(x, mask, sink)
    log_n = torch.log(n.clamp_min(1).double())
    close(log_count, log_n, dtype, rtol=0, atol=0 if dtype == torch.float64 else 1e-7)
    # The reference on the extended row counts the sink in n: shift the bias so that its
    # multiplier s log(n_ext) + bias' is s log(max(n, 1)) + bias with n the real keys.
    s64 = s.double().squeeze(-1) if per_row else s
    bias64 = bias.double().squeeze(-1) if per_row else bias
    n_extended = n + sink_allowed(sink)
    shifted = bias64 + s64 * (log_n - torch.log(n_extended.clamp_min(1).double()))
    s_column = s.double() if per_row else s
    expected, expected_multiplier, _ = reference.softmax_forward(extended, extended_mask, 1, s_column,
                                                                 shifted.unsqueeze(-1))
    close(y, split(expected)[0], dtype)
    close(weight, split(expected)[1], dtype)
    close(multiplier, expected_multiplier, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask_name", MASKS)
@pytest.mark.parametrize("k", [1, 3, 10])
def test_topk_integer_k_counts_slots_over_keys_and_sink(dtype, mask_name, k):
    x, sink, mask = scores(dtype), sinks(dtype), MASKS[mask_name]
    temperature = per_row_parameter([1.0, 0.5, 2.0], dtype)
    y, multiplier, weight = native.topk_forward(x, mask, k, False, temperature, sink=sink)
    extended, extended_mask, _ = extend(x, mask, sink)
    expected, expected_multiplier = reference.topk_forward(extended, extended_mask, k, False, temperature.double())
    close(y, split(expected)[0], dtype)
    close(weight, split(expected)[1], dtype)
    close(multiplier, expected_multiplier, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask_name", MASKS)
@pytest.mark.parametrize("k", [0.2, 0.5, 0.9])
def test_topk_fraction_counts_the_real_keys_only(dtype, mask_name, k):
    x, sink, mask = scores(dtype), sinks(dtype), MASKS[mask_name]
    y, _, weight = native.topk_forward(x, mask, k, True, 1.5, sink=sink)
    extended, extended_mask, n = extend(x, mask, sink)
    slots = torch.ceil(k * n.double() - 1e-9).long().clamp_min(1)  # max(1, ceil(k n)), the sink may take one
    expected = torch.empty_like(extended)
    for count in slots.unique().tolist():  # an integer k = the slots, over the extended row
        rows = slots == count
        expected[rows] = reference.topk_forward(extended, extended_mask, count, False, 1.5)[0][rows]
    close(y, split(expected)[0], dtype)
    close(weight, split(expected)[1], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask_name", MASKS)
@pytest.mark.parametrize("alpha", [*ALPHAS, "per_row"])
def test_entmax_is_entmax_of_the_extended_row(dtype, mask_name, alpha):
    x, sink, mask = scores(dtype), sinks(dtype), MASKS[mask_name]
    alpha = per_row_parameter(ALPHAS, dtype) if alpha == "per_row" else alpha
    y, gate, weight = native.entmax_forward(x, mask, alpha, sink=sink)
    extended, extended_mask, _ = extend(x, mask, sink)
    expected, expected_gate = reference.entmax_forward(
        extended, extended_mask, alpha.double() if isinstance(alpha, Tensor) else alpha
    )
    loose = {"atol": 2e-5, "rtol": 1e-3} if dtype == torch.float32 else {"atol": 1e-10, "rtol": 1e-8}
    close(y, split(expected)[0], dtype, **loose)
    close(weight, split(expected)[1], dtype, **loose)
    close(gate, expected_gate, dtype)


def check_self_adjusted_stats(
    stats: Tensor, expected: Tensor, extended: Tensor, normalized: bool, dtype: torch.dtype
) -> None:
    """gate (and low, high when normalized) as the reference's; c0, c1 may differ but give the same softmax weights.

    Rows holding NaN are left out: their statistics are NaN here, the reference's are not
    (both backward passes give NaN there).
    """
    number = ~extended.isnan().any(-1)
    kept = slice(2, None) if normalized else slice(4, None)
    close(stats[number][:, kept], expected[number][:, kept], dtype)
    finite = (stats[..., 4] == 1) & number
    weights = torch.exp((extended - stats[..., :1].double()) - stats[..., 1:2].double())
    expected_weights = torch.exp((extended - expected[..., :1]) - expected[..., 1:2])
    close(weights[finite], expected_weights[finite], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask_name", MASKS)
@pytest.mark.parametrize("normalized", [False, True])
def test_self_adjusted_is_self_adjusted_of_the_extended_row(dtype, mask_name, normalized):
    x, sink, mask = scores(dtype), sinks(dtype), MASKS[mask_name]
    y, stats, weight = native.self_adjusted_forward(x, mask, normalized, sink=sink)
    extended, extended_mask, _ = extend(x, mask, sink)
    expected, expected_stats = reference.self_adjusted_forward(extended, extended_mask, normalized)
    close(y, split(expected)[0], dtype)
    close(weight, split(expected)[1], dtype)
    masked = extended.masked_fill(~extended_mask.tensor, -math.inf)
    check_self_adjusted_stats(stats, expected_stats, masked, normalized, dtype)


def self_adjusted_rows(dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Rows where the sink becomes the row's min or max, sits between, or crosses 0 (changing low or high)."""
    x = torch.tensor([
        [0.5, -1.0, 2.0, 0.3],
        [0.5, -1.0, 2.0, 0.3],
        [0.5, -1.0, 2.0, 0.3],
        [0.5, 1.0, 2.0, 0.3],  # all positive: low = 0 until the sink
        [-0.5, -1.0, -2.0, -0.3],  # all negative: high = 0 until the sink
        [0.5, -1.0, 2.0, -1.0],  # the sink ties with the minimum
        [0.5, 3.0, 2.0, -1.0],  # ... with the maximum
    ], dtype=torch.float64)
    sink = torch.tensor([-3.0, 4.0, 0.7, -0.6, 1.5, -1.0, 3.0], dtype=torch.float64)
    return x.to(dtype), sink.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("normalized", [False, True])
def test_self_adjusted_sink_as_minimum_maximum_or_between(dtype, normalized):
    x, sink = self_adjusted_rows(dtype)
    y, stats, weight = native.self_adjusted_forward(x, NO_MASK, normalized, sink=sink)
    extended, extended_mask, _ = extend(x, NO_MASK, sink)
    expected, expected_stats = reference.self_adjusted_forward(extended, extended_mask, normalized)
    close(y, split(expected)[0], dtype)
    close(weight, split(expected)[1], dtype)
    check_self_adjusted_stats(stats, expected_stats, extended, normalized, dtype)
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64).to(dtype)
    dx, dsink = native.self_adjusted_backward(x, NO_MASK, grad, stats, normalized, sink=sink)
    expected_dx = reference.self_adjusted_backward(extended, extended_mask, with_zero(grad), expected_stats, normalized)
    close(dx, split(expected_dx)[0], dtype)
    close(dsink, split(expected_dx)[1], dtype)


# ---- backward passes: the reference on [y, sink_weight] with gradient [g, 0] ---------------


def gradient(dtype: torch.dtype) -> Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(2), dtype=torch.float64).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask_name", MASKS)
@pytest.mark.parametrize("param_grad", [0, 1, 2])
@pytest.mark.parametrize("forward", ["softmax", "scalable_softmax", "topk"])
def test_softmax_backward_on_the_extended_row(dtype, mask_name, param_grad, forward):
    x, sink, mask, grad = scores(dtype), sinks(dtype), MASKS[mask_name], gradient(dtype)
    if forward == "softmax":
        y, multiplier, _, weight = native.softmax_forward(x, mask, 0, per_row_parameter([0.7, 1.3], dtype), 0.0,
                                                          sink=sink)
    elif forward == "scalable_softmax":
        y, multiplier, _, weight = native.softmax_forward(x, mask, 1, 0.6, 0.2, sink=sink)
    else:
        y, multiplier, weight = native.topk_forward(x, mask, 3, False, 0.8, sink=sink)
    masked = rules.masked_scores(x, mask)
    dx, per_row, dsink = native.softmax_backward(y, grad, multiplier, masked, param_grad, sink_weight=weight,
                                                 sink=sink)
    extended_y = joined(y, weight)
    extended_x = extend(masked, NO_MASK, sink)[0]
    expected, expected_per_row = reference.softmax_backward(extended_y, with_zero(grad), multiplier.double(),
                                                            extended_x, param_grad)
    close(dx, split(expected)[0], dtype)
    close(dsink, split(expected)[1], dtype)
    if param_grad:  # NaN in rows holding NaN, as the reference's
        close(per_row, expected_per_row, dtype, atol=2e-5 if dtype == torch.float32 else 1e-11)
    else:
        assert per_row is None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask_name", MASKS)
@pytest.mark.parametrize("alpha", [*ALPHAS, "per_row"])
def test_entmax_backward_on_the_extended_row(dtype, mask_name, alpha):
    x, sink, mask, grad = scores(dtype), sinks(dtype), MASKS[mask_name], gradient(dtype)
    alpha = per_row_parameter(ALPHAS, dtype) if alpha == "per_row" else alpha
    y, gate, weight = native.entmax_forward(x, mask, alpha, sink=sink)
    dx, alpha_grad, dsink = native.entmax_backward(y, grad, gate, alpha, True, sink_weight=weight)
    extended_y = joined(y, weight)
    alpha64 = alpha.double() if isinstance(alpha, Tensor) else alpha
    expected, expected_alpha_grad = reference.entmax_backward(extended_y, with_zero(grad), gate.double(), alpha64,
                                                              True)
    loose = {"atol": 2e-5, "rtol": 1e-3} if dtype == torch.float32 else {}
    close(dx, split(expected)[0], dtype, **loose)
    close(dsink, split(expected)[1], dtype, **loose)
    close(alpha_grad, expected_alpha_grad, dtype, **loose)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask_name", MASKS)
@pytest.mark.parametrize("normalized", [False, True])
def test_self_adjusted_backward_on_the_extended_row(dtype, mask_name, normalized):
    x, sink, mask, grad = scores(dtype), sinks(dtype), MASKS[mask_name], gradient(dtype)
    _, stats, _ = native.self_adjusted_forward(x, mask, normalized, sink=sink)
    dx, dsink = native.self_adjusted_backward(x, mask, grad, stats, normalized, sink=sink)
    extended, extended_mask, _ = extend(x, mask, sink)
    _, expected_stats = reference.self_adjusted_forward(extended, extended_mask, normalized)
    expected = reference.self_adjusted_backward(extended, extended_mask, with_zero(grad), expected_stats, normalized)
    close(dx, split(expected)[0], dtype)
    close(dsink, split(expected)[1], dtype)


# ---- backward passes against torch.autograd on float64 formulas ----------------------------


def finite_case(seed: int = 4) -> tuple[Tensor, Tensor, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 7, generator=generator, dtype=torch.float64)
    sink = torch.randn(5, generator=generator, dtype=torch.float64)
    sink[0] = x[0].max() + 0.5  # the sink is the largest score of a row
    return x, sink, torch.randn(5, 7, generator=generator, dtype=torch.float64)


def autograd(formula, *leaves: Tensor, grad: Tensor) -> tuple[Tensor, ...]:
    """Gradients of sum(formula(...)[:, :-1] * grad) (the sink's weight is dropped) with respect to ``leaves``."""
    leaves = tuple(leaf.detach().clone().requires_grad_(True) for leaf in leaves)
    weights = formula(*leaves)
    return torch.autograd.grad((weights[:, :-1] * grad).sum(), leaves)


def test_softmax_backward_matches_autograd_with_a_temperature():
    x, sink, grad = finite_case()
    temperature = torch.tensor([0.7, 1.3, 2.0, 0.5, 1.0], dtype=torch.float64).unsqueeze(-1)
    y, multiplier, _, weight = native.softmax_forward(x, NO_MASK, 0, temperature, 0.0, sink=sink)
    dx, dtemperature, dsink = native.softmax_backward(y, grad, multiplier, None, 1, sink_weight=weight)
    expected = autograd(lambda x, s, t: torch.softmax(torch.cat([x, s[:, None]], -1) / t, -1), x, sink, temperature,
                        grad=grad)
    close(dx, expected[0], torch.float64)
    close(dsink, expected[1], torch.float64)
    close(dtemperature, expected[2].squeeze(-1), torch.float64)


def test_scalable_softmax_backward_matches_autograd_with_the_multiplier():
    x, sink, grad = finite_case(5)
    y, multiplier, _, weight = native.softmax_forward(x, NO_MASK, 1, 0.6, 0.2, sink=sink)
    dx, dmultiplier, dsink = native.softmax_backward(y, grad, multiplier, x, 2, sink_weight=weight, sink=sink)
    expected = autograd(lambda x, s, m: torch.softmax(m[:, None] * torch.cat([x, s[:, None]], -1), -1), x, sink,
                        multiplier, grad=grad)
    close(multiplier, 0.6 * math.log(7) + 0.2 * torch.ones(5, dtype=torch.float64), torch.float64)  # n = 7, not 8
    close(dx, expected[0], torch.float64)
    close(dsink, expected[1], torch.float64)
    close(dmultiplier, expected[2], torch.float64)


def self_adjusted_formula(normalized: bool):
    def formula(x: Tensor, s: Tensor) -> Tensor:
        extended = torch.cat([x, s[:, None]], -1)
        if not normalized:
            return extended * torch.softmax(extended, -1)
        low = extended.amin(-1, keepdim=True).clamp(max=0)
        high = extended.amax(-1, keepdim=True).clamp(min=0)
        return (extended - low) / (high - low) * torch.softmax(extended, -1)

    return formula


@pytest.mark.parametrize("normalized", [False, True])
def test_self_adjusted_backward_matches_autograd(normalized):
    x, sink = self_adjusted_rows(torch.float64)
    x, sink = x[:5], sink[:5]  # no ties at low or high: torch splits those as the kernels do, but leave it out
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    _, stats, _ = native.self_adjusted_forward(x, NO_MASK, normalized, sink=sink)
    dx, dsink = native.self_adjusted_backward(x, NO_MASK, grad, stats, normalized, sink=sink)
    expected = autograd(self_adjusted_formula(normalized), x, sink, grad=grad)
    close(dx, expected[0], torch.float64)
    close(dsink, expected[1], torch.float64)


@pytest.mark.parametrize("alpha", [1.3, 1.5, 2.0, 2.5])
def test_entmax_backward_matches_autograd_through_bisection(alpha):
    x, sink, grad = finite_case(7)
    alphas = torch.full((5, 1), alpha, dtype=torch.float64)
    y, gate, weight = native.entmax_forward(x, NO_MASK, alpha, sink=sink)
    dx, dalpha, dsink = native.entmax_backward(y, grad, gate, alpha, True, sink_weight=weight)
    expected = autograd(lambda x, s, a: entmax.entmax_bisect(torch.cat([x, s[:, None]], -1), a, n_iter=100), x, sink,
                        alphas, grad=grad)
    close(dx, expected[0], torch.float64, atol=1e-9)
    close(dsink, expected[1], torch.float64, atol=1e-9)
    close(dalpha, expected[2].squeeze(-1), torch.float64, atol=1e-9)


# ---- the rules, by hand ----------------------------------------------------------------------


def forwards(x: Tensor, mask: rules.RowMask, sink: Tensor | None) -> dict[str, tuple]:
    """Every forward with a few parameters, called with ``sink`` (or without it when None)."""
    keyword = {} if sink is None else {"sink": sink}
    calls = {
        "softmax": lambda: native.softmax_forward(x, mask, 0, 0.7, 0.0, **keyword),
        "scalable_softmax": lambda: native.softmax_forward(x, mask, 1, 0.6, 0.1, **keyword),
        "topk": lambda: native.topk_forward(x, mask, 2, False, 1.0, **keyword),
        "topk_fraction": lambda: native.topk_forward(x, mask, 0.5, True, 1.0, **keyword),
        "self_adjusted": lambda: native.self_adjusted_forward(x, mask, False, **keyword),
        "self_adjusted_normalized": lambda: native.self_adjusted_forward(x, mask, True, **keyword),
    }
    calls.update({f"entmax{alpha}": lambda alpha=alpha: native.entmax_forward(x, mask, alpha, **keyword)
                  for alpha in ALPHAS})
    return {name: call() for name, call in calls.items()}


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_minus_inf_sink_is_no_sink(dtype):
    x, mask, grad = scores(dtype), MASKS["bool"], gradient(dtype)
    without = forwards(x, mask, None)
    with_sink = forwards(x, mask, torch.full(SHAPE[:-1], -math.inf, dtype=dtype))
    for name, outputs in without.items():
        assert len(with_sink[name]) == len(outputs) + 1, name
        for got, expected in zip(with_sink[name], outputs, strict=False):
            assert (got is None and expected is None) or torch.equal(got.nan_to_num(), expected.nan_to_num()), name
        assert torch.equal(with_sink[name][-1], torch.zeros(SHAPE[:-1], dtype=dtype)), name
    y, multiplier, *_ = without["scalable_softmax"]
    dx, per_row = native.softmax_backward(y, grad, multiplier, rules.masked_scores(x, mask), 2)
    dx_sink, per_row_sink, dsink = native.softmax_backward(
        y, grad, multiplier, rules.masked_scores(x, mask), 2, sink_weight=torch.zeros(SHAPE[:-1], dtype=dtype),
        sink=torch.full(SHAPE[:-1], -math.inf, dtype=dtype))
    assert torch.equal(dx_sink.nan_to_num(), dx.nan_to_num()) and torch.equal(per_row_sink.nan_to_num(),
                                                                                per_row.nan_to_num())
    assert not dsink.nan_to_num().any()
    y, gate = without["entmax1.3"]
    dx, alpha_grad = native.entmax_backward(y, grad, gate, 1.3, True)
    dx_sink, alpha_grad_sink, dsink = native.entmax_backward(y, grad, gate, 1.3, True,
                                                             sink_weight=torch.zeros(SHAPE[:-1], dtype=dtype))
    assert torch.equal(dx_sink.nan_to_num(), dx.nan_to_num())
    assert torch.equal(alpha_grad_sink.nan_to_num(), alpha_grad.nan_to_num())
    assert not dsink.nan_to_num().any()
    _, stats = without["self_adjusted_normalized"]
    dx = native.self_adjusted_backward(x, mask, grad, stats, True)
    dx_sink, dsink = native.self_adjusted_backward(x, mask, grad, stats, True,
                                                   sink=torch.full(SHAPE[:-1], -math.inf, dtype=dtype))
    assert torch.equal(dx_sink.nan_to_num(), dx.nan_to_num()) and not dsink.nan_to_num().any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_nan_sink_makes_the_row_nan(dtype):
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(8), dtype=torch.float64).to(dtype)
    sink = torch.tensor([0.0, math.nan, 1.0], dtype=dtype)
    for name, (y, *_, weight) in forwards(x, NO_MASK, sink).items():
        assert y[1].isnan().all() and weight[1].isnan(), name
        assert not y[[0, 2]].isnan().any() and not weight[[0, 2]].isnan().any(), name


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_posinf_sink_takes_the_row_or_shares_it_with_posinf_keys(dtype):
    x = torch.tensor([[0.0, 1.0, 2.0], [0.0, math.inf, 2.0]], dtype=dtype)
    sink = torch.tensor([math.inf, math.inf], dtype=dtype)
    outputs = forwards(x, NO_MASK, sink)
    for name in ["softmax", "scalable_softmax", "topk", "topk_fraction", *(f"entmax{a}" for a in ALPHAS)]:
        y, per_row, *_, weight = outputs[name]  # top-k: 2 slots (k = 2, or max(1, ceil(0.5 * 3)) = 2)
        close(y, [[0, 0, 0], [0, 0.5, 0]], dtype)
        close(weight, [1.0, 0.5], dtype)
        close(per_row, [0, 0], dtype)  # multiplier / gate: 0 in rows holding +inf
    y, multiplier, weight = native.topk_forward(x, NO_MASK, 1, False, 1.0, sink=sink)  # one slot: the sink loses
    close(y[1], [0.0, 1.0, 0.0], dtype)
    close(weight, [1.0, 0.0], dtype)
    y, stats, weight = outputs["self_adjusted"]
    assert weight.tolist() == [math.inf, math.inf] and y[1].tolist() == [0, math.inf, 0]
    assert stats[:, 4].tolist() == [0, 0]
    y, _, weight = outputs["self_adjusted_normalized"]
    close(weight, [1.0, 0.5], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask_name", ["bool", "causal"])
def test_fully_masked_rows_give_everything_to_the_sink(dtype, mask_name):
    x, mask = scores(dtype), MASKS[mask_name]
    empty = ~rules.allowed(x, mask).expand(SHAPE).any(-1)
    sink = torch.full(SHAPE[:-1], 0.8, dtype=dtype)
    assert empty.any()
    for name, (y, *_, weight) in forwards(x, mask, sink).items():
        assert not y[empty].any(), name
        expected = 0.8 if name == "self_adjusted" else 1.0  # phi(0.8): 0.8 plain, (0.8 - 0) / (0.8 - 0) normalized
        close(weight[empty], torch.full_like(weight[empty], expected, dtype=torch.float64), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_topk_the_sink_loses_ties_and_takes_a_slot_when_larger(dtype):
    x = torch.tensor([[1.0, 2.0, 2.0, 0.0]] * 3, dtype=dtype)
    sink = torch.tensor([2.0, 5.0, 1.0], dtype=dtype)
    y, _, weight = native.topk_forward(x, NO_MASK, 2, False, 1.0, sink=sink)
    key, sink_share = 1 / (1 + math.exp(3.0)), 1 / (1 + math.exp(-3.0))  # softmax of (2, 5)
    close(y, [[0, 0.5, 0.5, 0], [0, key, 0, 0], [0, 0.5, 0.5, 0]], dtype)
    close(weight, [0.0, sink_share, 0.0], dtype)
    y, _, weight = native.topk_forward(x, NO_MASK, 3, False, 1.0, sink=sink)  # the third slot: the sink at 2 beats 1
    close(weight[0], 1 / 3, dtype)
    close(y[0], [0, 1 / 3, 1 / 3, 0], dtype)
    close(y[2], torch.exp(x[2].double()) * (x[2] >= 1) / torch.exp(x[2].double())[:3].sum(), dtype)  # sink ties 1
    close(weight[2], 0.0, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_topk_fraction_slots_by_hand(dtype):
    x = torch.tensor([[3.0, 1.0, 2.0, 0.0], [3.0, 1.0, 2.0, 0.0], [-math.inf] * 4], dtype=dtype)
    sink = torch.tensor([2.5, 0.5, -1.0], dtype=dtype)
    # n = 4, 0.5: 2 slots (3 and the sink at 2.5; then 3 and 2); n = 0: 1 slot, the sink's
    y, _, weight = native.topk_forward(x, NO_MASK, 0.5, True, 1.0, sink=sink)
    first, second = 1 / (1 + math.exp(-0.5)), 1 / (1 + math.exp(-1.0))  # the larger share of a softmax of 2
    close(y, [[first, 0, 0, 0], [second, 0, 1 - second, 0], [0, 0, 0, 0]], dtype)
    close(weight, [1 - first, 0.0, 1.0], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_of_length_one(dtype):
    x = torch.tensor([[0.3], [-math.inf], [2.0]], dtype=dtype)
    sink = torch.tensor([0.3, 1.0, -math.inf], dtype=dtype)
    extended, extended_mask, _ = extend(x, NO_MASK, sink)
    grad = torch.tensor([[1.0], [2.0], [-1.0]], dtype=dtype)
    y, multiplier, log_count, weight = native.softmax_forward(x, NO_MASK, 1, 0.5, 1.0, sink=sink)
    expected = reference.softmax_forward(extended, extended_mask, 0, 1.0, 0.0)[0]  # log max(n, 1) = 0: m = 1
    close(y, split(expected)[0], dtype)
    close(weight, split(expected)[1], dtype)
    close(log_count, torch.zeros(3), dtype)
    dx, _, dsink = native.softmax_backward(y, grad, multiplier, None, 0, sink_weight=weight)
    expected_dx = reference.softmax_backward(joined(y, weight), with_zero(grad), multiplier.double(), None, 0)[0]
    close(dx, split(expected_dx)[0], dtype)
    close(dsink, split(expected_dx)[1], dtype)
    for alpha in ALPHAS:
        y, gate, weight = native.entmax_forward(x, NO_MASK, alpha, sink=sink)
        close(joined(y, weight), reference.entmax_forward(extended, extended_mask, alpha)[0], dtype)
        dx, _, dsink = native.entmax_backward(y, grad, gate, alpha, False, sink_weight=weight)
        expected_dx = reference.entmax_backward(joined(y, weight), with_zero(grad), gate.double(), alpha, False)[0]
        close(joined(dx, dsink), expected_dx, dtype)
    y, _, weight = native.topk_forward(x, NO_MASK, 1, False, 1.0, sink=sink)
    close(joined(y, weight), reference.topk_forward(extended, extended_mask, 1, False, 1.0)[0], dtype)
    for normalized in (False, True):
        y, stats, weight = native.self_adjusted_forward(x, NO_MASK, normalized, sink=sink)
        expected, expected_stats = reference.self_adjusted_forward(extended, extended_mask, normalized)
        close(joined(y, weight), expected, dtype)
        dx, dsink = native.self_adjusted_backward(x, NO_MASK, grad, stats, normalized, sink=sink)
        expected_dx = reference.self_adjusted_backward(extended, extended_mask, with_zero(grad), expected_stats,
                                                       normalized)
        close(joined(dx, dsink), expected_dx, dtype)


def test_sink_as_a_column_or_per_row_and_a_number():
    x, sink = scores(torch.float64), sinks(torch.float64)
    per_row = native.entmax_forward(x, NO_MASK, 1.5, sink=sink)
    column = native.entmax_forward(x, NO_MASK, 1.5, sink=sink[..., None])
    for got, expected in zip(column, per_row, strict=True):
        assert torch.equal(got.nan_to_num(), expected.nan_to_num())
    number = native.softmax_forward(x, NO_MASK, 0, 1.0, 0.0, sink=0.0)  # softmax_1
    full = native.softmax_forward(x, NO_MASK, 0, 1.0, 0.0, sink=torch.zeros(SHAPE[:-1], dtype=torch.float64))
    assert torch.equal(number[0].nan_to_num(), full[0].nan_to_num())


def test_softmax_backward_names_the_missing_sink_arguments():
    y, grad = torch.full((2, 3), 1 / 3, dtype=torch.float64), torch.ones(2, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match="sink needs sink_weight"):
        native.softmax_backward(y, grad, 1.0, None, 0, sink=torch.zeros(2, dtype=torch.float64))
    with pytest.raises(ValueError, match="needs sink"):
        native.softmax_backward(y, grad, 1.0, y, 2, sink_weight=torch.zeros(2, dtype=torch.float64))


@pytest.mark.parametrize("dtype", DTYPES)
def test_long_rows_across_threads(dtype):
    """Rows long enough for the group bounds of top-k and entmax, and enough of them for threads."""
    generator = torch.Generator().manual_seed(9)
    x = (torch.randn(16, 300, generator=generator, dtype=torch.float64) * 2).to(dtype)
    sink = torch.cat([x[:4].amax(-1) + 0.5, x[4:8].amax(-1), x[8:].median(-1).values]).to(dtype)  # top, tied, middle
    extended, extended_mask, _ = extend(x, NO_MASK, sink)
    for k in (1, 5, 40):
        y, _, weight = native.topk_forward(x, NO_MASK, k, False, 0.5, sink=sink)
        expected = reference.topk_forward(extended, extended_mask, k, False, 0.5)[0]
        close(joined(y, weight), expected, dtype)
    loose = {"atol": 2e-5, "rtol": 1e-3} if dtype == torch.float32 else {"atol": 1e-10, "rtol": 1e-8}
    for alpha in ALPHAS:
        y, _, weight = native.entmax_forward(x, NO_MASK, alpha, sink=sink)
        expected = reference.entmax_forward(extended, extended_mask, alpha)[0]
        close(joined(y, weight), expected, dtype, **loose)
    y, _, _, weight = native.softmax_forward(x, NO_MASK, 0, 0.8, 0.0, sink=sink)
    close(joined(y, weight), reference.softmax_forward(extended, extended_mask, 0, 0.8, 0.0)[0], dtype)
