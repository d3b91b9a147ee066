"""The Triton backend's ``softcap=`` keyword (``kernels/README.md``, "Soft-capping") against the reference.

The oracle caps the scores here, in float64, ``c(x) = cap tanh(x / cap)`` with ``c(-inf) = -inf``,
and runs the reference backend **without** a cap on ``c(x)`` (with the same sink, which is not
capped); backwards run the reference at the capped scores and multiply ``dx`` by the float64
slope ``1 - tanh(x / cap)^2`` (0 where ``x`` is not finite).

Both row paths of every kernel run: one block in registers (rows of 15) and multi-pass (rows of
16 streamed in blocks of 8).  The scores hold -inf (stays masked), +inf (capped to the cap: no
longer a +inf row), a NaN row, and +-1e30 (tanh saturated); caps of 0.5, 3 and 1e4 (where
``tanh`` of small arguments must not cancel); masks with fully masked rows; per-row parameters;
float32 and bfloat16; with and without a sink.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from attnorm.kernels import reference  # noqa: E402
from attnorm.kernels import triton as kernels  # noqa: E402
from attnorm.kernels.rules import RowMask  # noqa: E402
from attnorm.kernels.triton import launch  # noqa: E402

# The interpreter evaluates masked-off lanes too (e.g. exp(-inf - -inf)); numpy warns about them.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

from tests.kernels.test_triton_sinks import (  # noqa: E402  (the same rows, paths and tolerances)
    BATCH,
    F64,
    FORCED_BLOCK,
    GRADIENT_SLACK,
    LENGTHS,
    QUERIES,
    TOLERANCES,
)

# (mask, cap, sink, dtype): each mask kind once, caps small to large, a sink in half of them.
CASES = (
    ("none", 0.5, False, torch.float32),
    ("bool", 1e4, True, torch.float32),
    ("causal", 3.0, True, torch.bfloat16),
    ("key-lengths", 0.5, True, torch.float32),
)
CASE_IDS = [f"{mask}-cap{cap:g}-{'sink' if sink else 'nosink'}-{str(dtype)[6:]}" for mask, cap, sink, dtype in CASES]


def use_path(path: str, monkeypatch) -> int:
    """Row length for ``path``; multi-pass forces blocks of 8."""
    if path == "multi-pass":
        monkeypatch.setattr(launch, "SINGLE_BLOCK_MAX", FORCED_BLOCK)
        monkeypatch.setattr(launch, "MULTI_PASS_BLOCK", FORCED_BLOCK)
    return LENGTHS[path]


def make_scores(length: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """(B, 1, Lq, L): scores of order 3 with -inf, +inf, +-1e30 and one NaN row (row 5)."""
    x = 3 * torch.randn(BATCH, 1, QUERIES, length, generator=torch.Generator().manual_seed(0), dtype=F64)
    x[0, 0, 0, ::4] = -math.inf
    x[0, 0, 2, [2, 5]] = math.inf
    x[1, 0, 0, 3] = 1e30
    x[1, 0, 0, 7] = -1e30
    x[1, 0, 2, 4] = math.nan
    return x.to(device, dtype)


def make_mask(kind: str, length: int, device: str) -> RowMask:
    """Masks with fully masked rows: a bool query, causal query 0, key lengths batch 1."""
    allowed = torch.rand(1, 1, QUERIES, length, generator=torch.Generator().manual_seed(1)) > 0.3
    allowed[..., 1, :] = False
    return {
        "none": RowMask(),
        "bool": RowMask(allowed.to(device)),
        "causal": RowMask(diagonal=-1),
        "key-lengths": RowMask(key_lengths=torch.tensor([length - 3, 0], device=device)),
    }[kind]


def make_sink(wanted: bool, device: str) -> torch.Tensor | None:
    """Per-row sinks beyond the small cap (they must not be capped), below and inside it."""
    return torch.tensor([[4.0, -1.0, 0.25], [1.5, -6.0, 0.0]], device=device).reshape(BATCH, 1, QUERIES) if wanted \
        else None


def inputs(length: int, mask_kind: str, with_sink: bool, dtype: torch.dtype, device: str):
    return make_scores(length, dtype, device), make_mask(mask_kind, length, device), make_sink(with_sink, device)


def capped(x: torch.Tensor, cap: float) -> torch.Tensor:
    """``c(x)`` in float64 on the CPU."""
    x = x.cpu().to(F64)
    return torch.where(x == -math.inf, x, cap * torch.tanh(x / cap))


def slope(x: torch.Tensor, cap: float) -> torch.Tensor:
    """``dc / dx`` in float64 on the CPU, 0 where ``x`` is not finite."""
    x = x.cpu().to(F64)
    return torch.where(x.isfinite(), 1 - torch.tanh(x / cap) ** 2, 0.0)


def cpu64(value):
    if value is None or not isinstance(value, torch.Tensor):
        return value
    return value.cpu().to(F64)


def _cpu_part(part):
    """One field of a RowMask moved to the CPU (masks stay bool / int64)."""
    return part.cpu() if isinstance(part, torch.Tensor) else part


def cpu_mask(mask: RowMask) -> RowMask:
    return RowMask(*map(_cpu_part, mask))


def assert_close(actual, expected, dtype, slack=1, what=""):
    tolerance = {key: value * slack for key, value in TOLERANCES[dtype].items()}
    torch.testing.assert_close(actual.cpu().to(F64), expected.cpu().to(F64), equal_nan=True, **tolerance,
                               msg=lambda message: f"{what}: {message}")


NAN_ROW = (1, 0, 2)


def without_nan_row(values: torch.Tensor) -> torch.Tensor:
    """A row output or per-row output with the NaN row zeroed (its per-row values are not specified)."""
    values = values.cpu().to(F64).clone()
    values[NAN_ROW] = 0.0
    return values


def assert_gradient(got, want, dtype, what):
    """A backward's output against the reference's, the NaN row's NaN included."""
    assert torch.equal(got.cpu().isnan(), want.cpu().isnan()), what
    assert_close(without_nan_row(got), without_nan_row(want), dtype, GRADIENT_SLACK, what=what)


def multiplier_rounding(y, g, scores, sink_weight=None, sink=None) -> torch.Tensor:
    """A float32 rounding bound per row for the multiplier's gradient ``sum_j y_j (g_j - sum y g) c_j``.

    The sum cancels where the weight sits on a few equal capped scores (a +inf row capped
    to ``cap = 1e4`` on two keys: exactly 0; one key holding all the weight: ``g_j - sum y g``
    is 0).  What is left is the rounding of its operands: ``g_j - sum y g`` is only as exact
    as ``eps (|g_j| + sum |y g|)``, and it is multiplied by ``|y_j c_j|`` up to 1e4.  Bounds
    built on ``|g_j - sum y g|`` alone missed it on an H200 (2026-11-26: 4e-4 errors where
    that bound was 0).  The bound is 8 eps times ``sum_j |y_j c_j| (|g_j| + sum |y g|)``
    (float64, from the kernel's own ``y``); in rows of scores of order 1 it is below the
    fixed tolerance.
    """
    y, g, c = (cpu64(t) for t in (y, g, scores))
    if sink_weight is not None:
        y = torch.cat([y, cpu64(sink_weight).reshape(*y.shape[:-1], 1)], -1)
        g = torch.cat([g, torch.zeros_like(g[..., :1])], -1)
        c = torch.cat([c, cpu64(sink).reshape(*c.shape[:-1], 1)], -1)
    y = torch.where(y.isnan(), 0.0, y)
    g = g.expand_as(y)
    absolute_dot = (y * g).abs().sum(-1, keepdim=True)
    terms = torch.where(y != 0, (y * c).abs() * (g.abs() + absolute_dot), 0.0)
    return 8 * torch.finfo(torch.float32).eps * terms.nansum(-1)


def upstream(x: torch.Tensor) -> torch.Tensor:
    return torch.randn(x.shape, generator=torch.Generator().manual_seed(2), dtype=F64).to(x.device, x.dtype)


def per_row(values, x: torch.Tensor) -> torch.Tensor:
    """Per-row parameters ``(B, 1, Lq, 1)`` cycling through ``values``."""
    rows = torch.tensor(values, dtype=F64).repeat(BATCH * QUERIES)[: BATCH * QUERIES]
    return rows.reshape(BATCH, 1, QUERIES, 1).to(x.device, torch.float32)


@pytest.fixture(params=list(LENGTHS))
def path(request):
    return request.param


@pytest.mark.parametrize(("mask_kind", "cap", "with_sink", "dtype"), CASES, ids=CASE_IDS)
@pytest.mark.parametrize("variant", [0, 1])
def test_softmax(path, mask_kind, cap, with_sink, dtype, variant, device, monkeypatch):
    """softmax_forward (temperature / Scalable-Softmax) and softmax_backward with param_grad 1 or 2."""
    length = use_path(path, monkeypatch)
    x, mask, sink = inputs(length, mask_kind, with_sink, dtype, device)
    first, second = (per_row([0.5, 2.0, -1.0], x), 0.0) if variant == 0 else (per_row([0.7, -0.4], x), 0.3)
    out = kernels.softmax_forward(x, mask, variant, first, second, sink=sink, softcap=cap)
    expected = reference.softmax_forward(capped(x, cap), cpu_mask(mask), variant,
                                         cpu64(first), cpu64(second), sink=cpu64(sink))
    assert len(out) == len(expected)
    assert_close(out[0], expected[0], dtype, what="y")
    for got, want, name in zip(out[1:], expected[1:], ("multiplier", "log_count", "sink weight"), strict=False):
        if want is not None:
            assert_close(got, want, torch.float32, what=name)
    g = upstream(x)
    param_grad = 1 if variant == 0 else 2
    sink_weight = out[3] if with_sink else None
    got = kernels.softmax_backward(out[0], g, out[1], x, param_grad, sink_weight=sink_weight, sink=sink, softcap=cap)
    want = reference.softmax_backward(cpu64(out[0]), cpu64(g), cpu64(out[1]), capped(x, cap), param_grad,
                                      sink_weight=cpu64(sink_weight), sink=cpu64(sink))
    assert_gradient(got[0], want[0] * slope(x, cap), dtype, "dx")
    if param_grad == 2:
        rounding = multiplier_rounding(out[0], g, capped(x, cap), sink_weight, sink).reshape(want[1].shape)
        assert torch.equal(got[1].cpu().isnan(), want[1].cpu().isnan()), "per-row gradient"
        error = (without_nan_row(got[1]) - without_nan_row(want[1])).abs()
        tolerance = {key: value * GRADIENT_SLACK for key, value in TOLERANCES[dtype].items()}
        allowed = tolerance["atol"] + tolerance["rtol"] * without_nan_row(want[1]).abs() + without_nan_row(rounding)
        assert (error <= allowed).all(), f"per-row gradient: error {error.max():.3g}, allowed {allowed.min():.3g}"
    else:
        assert_gradient(got[1], want[1], dtype, "per-row gradient")
    if with_sink:
        assert_gradient(got[2], want[2], torch.float32, "dsink")


@pytest.mark.parametrize(("mask_kind", "cap", "with_sink", "dtype"), CASES, ids=CASE_IDS)
@pytest.mark.parametrize(("k", "is_fraction"), [(3, False), (0.4, True)])
def test_topk(path, mask_kind, cap, with_sink, dtype, k, is_fraction, device, monkeypatch):
    """topk_forward on the capped row: +inf scores compete as the cap, ties among them to the lowest index."""
    length = use_path(path, monkeypatch)
    x, mask, sink = inputs(length, mask_kind, with_sink, dtype, device)
    temperature = per_row([1.0, 0.5, -2.0], x)
    out = kernels.topk_forward(x, mask, k, is_fraction, temperature, sink=sink, softcap=cap)
    expected = reference.topk_forward(capped(x, cap), cpu_mask(mask), k, is_fraction, cpu64(temperature),
                                      sink=cpu64(sink))
    assert len(out) == len(expected)
    for got, want, name in zip(out, expected, ("y", "multiplier", "sink weight"), strict=False):
        assert_close(got, want, dtype if name == "y" else torch.float32, what=name)


@pytest.mark.parametrize(("mask_kind", "cap", "with_sink", "dtype"), CASES, ids=CASE_IDS)
def test_entmax(path, mask_kind, cap, with_sink, dtype, device, monkeypatch):
    """entmax_forward with alpha per row (softmax, 1.5, sparsemax, 3) and entmax_backward with alpha_grad."""
    length = use_path(path, monkeypatch)
    x, mask, sink = inputs(length, mask_kind, with_sink, dtype, device)
    alpha = per_row([1.0, 1.5, 2.0, 3.0], x)
    out = kernels.entmax_forward(x, mask, alpha, sink=sink, softcap=cap)
    expected = reference.entmax_forward(capped(x, cap), cpu_mask(mask), cpu64(alpha), sink=cpu64(sink))
    assert len(out) == len(expected)
    for got, want, name in zip(out, expected, ("y", "gate", "sink weight"), strict=False):
        assert_close(got, want, dtype if name == "y" else torch.float32, slack=2, what=name)
    g = upstream(x)
    sink_weight = out[2] if with_sink else None
    got = kernels.entmax_backward(out[0], g, out[1], alpha, True, sink_weight=sink_weight, x=x, softcap=cap)
    want = reference.entmax_backward(cpu64(out[0]), cpu64(g), cpu64(out[1]), cpu64(alpha), True,
                                     sink_weight=cpu64(sink_weight))
    assert_gradient(got[0], want[0] * slope(x, cap), dtype, "dx")
    for got_row, want_row, name in zip(got[1:], want[1:], ("alpha gradient", "dsink"), strict=False):
        assert_gradient(got_row, want_row, torch.float32, name)


@pytest.mark.parametrize(("mask_kind", "cap", "with_sink", "dtype"), CASES, ids=CASE_IDS)
@pytest.mark.parametrize("normalized", [False, True])
def test_self_adjusted(path, mask_kind, cap, with_sink, dtype, normalized, device, monkeypatch):
    """self_adjusted_forward (stats in capped units) and its backward recomputing c(x) from the raw x."""
    length = use_path(path, monkeypatch)
    x, mask, sink = inputs(length, mask_kind, with_sink, dtype, device)
    out = kernels.self_adjusted_forward(x, mask, normalized, sink=sink, softcap=cap)
    expected = reference.self_adjusted_forward(capped(x, cap), cpu_mask(mask), normalized, sink=cpu64(sink))
    assert len(out) == len(expected)
    assert_close(out[0], expected[0], dtype, slack=2, what="y")
    # c0 and c1 split the log-sum-exp differently per backend; the weights exp((c - c0) - c1) and low/high must agree.
    stats, expected_stats = without_nan_row(out[1]), without_nan_row(expected[1])
    assert_close(stats[..., 0] + stats[..., 1], expected_stats[..., 0] + expected_stats[..., 1], torch.float32,
                 slack=2, what="c0 + c1")
    assert_close(stats[..., 2:], expected_stats[..., 2:], torch.float32, what="low, high, gate")
    if with_sink:
        assert_close(out[2], expected[2], torch.float32, slack=2, what="sink weight")
    g = upstream(x)
    got = kernels.self_adjusted_backward(x, mask, g, out[1], normalized, sink=sink, softcap=cap)
    # The reference finds low and high by equality with its own stats (float64 capped scores).
    want = reference.self_adjusted_backward(capped(x, cap), cpu_mask(mask), cpu64(g), expected[1], normalized,
                                            sink=cpu64(sink))
    got_dx, want_dx = (got[0], want[0]) if with_sink else (got, want)
    assert_gradient(got_dx, want_dx * slope(x, cap), dtype, "dx")
    if with_sink:
        assert_gradient(got[1], want[1], torch.float32, "dsink")


def test_capped_scores_are_exact_in_float64(device):
    """Float64 rows cap in float64 (the cap is not rounded to float32), both tanh branches, to 1e-13."""
    x = torch.tensor([[-3e-3, 1e-3, 0.02, 0.05, 0.07, 0.3, 2.0, -5.0, 40.0, 1e30, math.inf, -math.inf]],
                     dtype=F64, device=device)
    for cap in (0.3, 1.0, 1e4):
        y, _, _ = kernels.softmax_forward(x, RowMask(), 0, 1.0, 0.0, softcap=cap)
        expected, _, _ = reference.softmax_forward(capped(x, cap), RowMask(), 0, 1.0, 0.0)
        torch.testing.assert_close(y.cpu(), expected, atol=1e-15, rtol=1e-13)
        g = upstream(x)
        dx, _ = kernels.softmax_backward(y, g, 1.0, x, 0, softcap=cap)
        want, _ = reference.softmax_backward(expected, g.cpu(), 1.0, None, 0)
        torch.testing.assert_close(dx.cpu(), want * slope(x, cap), atol=1e-15, rtol=1e-12)


def test_uncapped_launches_keep_the_flag_off(device, monkeypatch):
    """Without softcap every kernel launches with SOFTCAP False (the code of before); with one, True."""
    seen = []
    original = launch.run

    def recording(kernel, run, *args, **constants):
        seen.append(constants["SOFTCAP"])
        return original(kernel, run, *args, **constants)

    monkeypatch.setattr(launch, "run", recording)
    x = make_scores(15, torch.float32, device)[:1, :, :1]
    for cap in (None, 2.0):
        seen.clear()
        y, multiplier, _ = kernels.softmax_forward(x, RowMask(), 0, 1.0, 0.0, softcap=cap)
        kernels.softmax_backward(y, y, multiplier, x, 2, softcap=cap)
        kernels.topk_forward(x, RowMask(), 2, False, 1.0, softcap=cap)
        y, gate = kernels.entmax_forward(x, RowMask(), 1.5, softcap=cap)
        kernels.entmax_backward(y, y, gate, 1.5, False, x=x, softcap=cap)
        y, stats = kernels.self_adjusted_forward(x, RowMask(), False, softcap=cap)
        kernels.self_adjusted_backward(x, RowMask(), y, stats, False, softcap=cap)
        assert seen == [cap is not None] * 7


@pytest.mark.parametrize("cap", [0.0, -1.0, math.inf, math.nan, True, "2"])
def test_bad_caps_raise(cap, device):
    x = torch.zeros(2, 4, device=device)
    with pytest.raises(ValueError, match="softcap"):
        kernels.softmax_forward(x, RowMask(), 0, 1.0, 0.0, softcap=cap)
    with pytest.raises(ValueError, match="softcap"):
        kernels.entmax_forward(x, RowMask(), 1.5, softcap=cap)


def test_capped_backwards_need_the_raw_scores(device):
    y = torch.full((2, 4), 0.25, device=device)
    with pytest.raises(ValueError, match="softcap"):
        kernels.softmax_backward(y, y, 1.0, None, 0, softcap=2.0)
    with pytest.raises(ValueError, match="softcap"):
        kernels.entmax_backward(y, y, torch.ones(2, device=device), 1.5, False, softcap=2.0)
