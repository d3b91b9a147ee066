"""The Triton backend's ``sink=`` keyword (``kernels/README.md``, "A sink per row") against the reference.

The oracle is the reference backend run in float64 **without** a sink on the extended row
``[x, sink]`` (built here with one concatenation; its mask: the real allowed positions of
``rules.allowed`` and an always-True column), its last column the sink's weight; backwards
run the reference on ``[y, sink_weight]`` with gradient ``[g, 0]``.  The two count rules the
extended row cannot express are checked against explicit expectations: Scalable-Softmax's
``log max(n, 1)`` and a top-k fraction's ``max(1, ceil(k n - 1e-9))`` slots count the real
allowed keys only (the fraction's slots then go to the reference as an integer k per row).

Both row paths of every kernel run: one block in registers (rows of 15, the sink filling the
last of 16 lanes) and multi-pass (rows of 16 streamed in blocks of 8, the sink alone in a third
block).  Special rows: fully masked (the sink alone), -inf scores, +inf scores, and sinks of
-inf (no sink), NaN (the row NaN) and +inf.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

pytest.importorskip("triton")

from attnorm.kernels import reference, rules  # noqa: E402
from attnorm.kernels import triton as kernels  # noqa: E402
from attnorm.kernels.rules import RowMask  # noqa: E402
from attnorm.kernels.triton import launch  # noqa: E402

# The interpreter evaluates masked-off lanes too (e.g. exp(-inf - -inf)); numpy warns about them.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

F64 = torch.float64
BATCH, QUERIES = 2, 3  # scores (B, 1, Lq, L): six rows
LENGTHS = {"single-block": 15, "multi-pass": 16}
FORCED_BLOCK = 8
TOLERANCES = {
    torch.float32: {"atol": 2e-6, "rtol": 2e-5},
    torch.bfloat16: {"atol": 8e-3, "rtol": 1.6e-2},  # weights and dx rounded to bfloat16
}
GRADIENT_SLACK = 5
# Per row: the sink above every score, below every score, inside (no ties: scores are multiples of 1/8).
SINKS = ((5.0, -5.0, 0.0625), (0.3125, -0.1875, 2.0625))


def use_path(path: str, monkeypatch) -> int:
    """Row length for ``path``; multi-pass forces blocks of 8."""
    if path == "multi-pass":
        monkeypatch.setattr(launch, "SINGLE_BLOCK_MAX", FORCED_BLOCK)
        monkeypatch.setattr(launch, "MULTI_PASS_BLOCK", FORCED_BLOCK)
    return LENGTHS[path]


def make_scores(length: int) -> torch.Tensor:
    """(B, 1, Lq, L) float64: distinct multiples of 1/8 with -inf positions, a +inf row."""
    ranks = torch.rand(BATCH, 1, QUERIES, length, generator=torch.Generator().manual_seed(0)).argsort(-1)
    x = ((ranks - length // 2) / 8).to(F64)
    x[0, 0, 0, ::4] = -math.inf
    x[1, 0, 1, [2, 5]] = math.inf
    return x


MASK_KINDS = ("none", "bool", "causal", "key-lengths")


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


def column(value, x: torch.Tensor) -> torch.Tensor:
    """A per-row parameter (number or ``(..., 1)`` tensor) as float64 ``x.shape[:-1] + (1,)`` (CPU)."""
    value = value.cpu() if isinstance(value, torch.Tensor) else torch.tensor(value)
    return value.to(F64).expand(*x.shape[:-1], 1)


class Extended:
    """The extended row ``[x, sink]`` in float64 (CPU), its mask, and the real allowed count ``n``."""

    def __init__(self, x: torch.Tensor, mask: RowMask, sink: torch.Tensor):
        real = rules.allowed(x, mask).expand(x.shape).cpu()
        self.scores = torch.cat([x.cpu().to(F64), sink.cpu().to(F64)[..., None]], -1)
        self.mask = RowMask(torch.cat([real, torch.ones_like(real[..., :1])], -1))
        self.count = real.sum(-1)

    @staticmethod
    def grad(g: torch.Tensor) -> torch.Tensor:
        g = g.cpu().to(F64)
        return torch.cat([g, torch.zeros_like(g[..., :1])], -1)

    @staticmethod
    def outputs(values: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """A kernel's row output and its sink output as one extended row (float64, CPU)."""
        return torch.cat([values.cpu().to(F64), last.cpu().to(F64)[..., None]], -1)


def assert_close(actual, expected, dtype, slack=1, what=""):
    tolerance = {key: value * slack for key, value in TOLERANCES[dtype].items()}
    torch.testing.assert_close(actual.cpu().to(F64), expected.cpu().to(F64), equal_nan=True, **tolerance,
                               msg=lambda message: f"{what}: {message}")


def assert_extended(values, last, expected, dtype, slack=1, what=""):
    """A row output (``dtype``) and its sink output (float32, the accumulation dtype) against an extended row."""
    assert values.dtype == dtype and last.dtype == torch.float32, what
    assert_close(values, expected[..., :-1], dtype, slack, what)
    assert_close(last, expected[..., -1], torch.float32, slack, f"{what} (the sink)")


def upstream(x: torch.Tensor) -> torch.Tensor:
    return torch.randn(x.shape, generator=torch.Generator().manual_seed(2), dtype=F64).to(x.device, x.dtype)


def posinf_rows(ext: Extended) -> torch.Tensor:
    allowed = ext.mask.tensor & (ext.scores != -math.inf)
    return (allowed & (ext.scores == math.inf)).any(-1)


# ---- each function pair against the reference on the extended row ---------------------------


def check_softmax(x, mask, sink, params, dtype):
    """softmax_forward variant 0 + softmax_backward param_grad 1 (temperature)."""
    temperature = params["temperature"]
    y, multiplier, log_count, weight = kernels.softmax_forward(x, mask, 0, temperature, 0.0, sink=sink)
    assert log_count is None
    ext = Extended(x, mask, sink)
    expected, expected_multiplier, _ = reference.softmax_forward(ext.scores, ext.mask, 0, column(temperature, x), 0.0)
    assert_extended(y, weight, expected, dtype, what="y, sink weight")
    assert_close(multiplier, expected_multiplier, dtype, what="multiplier")
    g = upstream(x)
    dx, d_temperature, dsink = kernels.softmax_backward(y, g, multiplier, None, 1, sink_weight=weight)
    expected_dx, expected_dt = reference.softmax_backward(Extended.outputs(y, weight), ext.grad(g),
                                                          multiplier.cpu().to(F64), None, 1)
    assert_extended(dx, dsink, expected_dx, dtype, GRADIENT_SLACK, "dx, dsink")
    assert_close(d_temperature, expected_dt, dtype, GRADIENT_SLACK, "d temperature")


def check_scalable_softmax(x, mask, sink, params, dtype):
    """softmax_forward variant 1 (m = s log max(n, 1) + b, n the real keys) + param_grad 2 (needs x and sink)."""
    s, bias = params["s"], params["bias"]
    y, multiplier, log_count, weight = kernels.softmax_forward(x, mask, 1, s, bias, sink=sink)
    ext = Extended(x, mask, sink)
    log_n = ext.count.clamp_min(1).to(F64).log()
    assert_close(log_count, log_n, dtype, what="log_count")
    m = column(s, x)[..., 0] * log_n + column(bias, x)[..., 0]
    assert_close(multiplier, torch.where(posinf_rows(ext), 0.0, m), dtype, what="multiplier")
    expected = reference.softmax_forward(ext.scores, ext.mask, 1, 0.0, m[..., None])[0]  # m = 0 log n + m
    assert_extended(y, weight, expected, dtype, what="y, sink weight")
    g = upstream(x)
    dx, d_multiplier, dsink = kernels.softmax_backward(y, g, multiplier, x, 2, sink_weight=weight, sink=sink)
    expected_dx, expected_dm = reference.softmax_backward(Extended.outputs(y, weight), ext.grad(g),
                                                          multiplier.cpu().to(F64), ext.scores, 2)
    assert_extended(dx, dsink, expected_dx, dtype, GRADIENT_SLACK, "dx, dsink")
    assert_close(d_multiplier, expected_dm, dtype, GRADIENT_SLACK, "d multiplier")


def topk_slots(ext: Extended, k: float, is_fraction: bool) -> torch.Tensor:
    """Slots per row: an integer k as given (over the real keys and the sink), a fraction of the real keys."""
    if not is_fraction:
        return torch.full(ext.count.shape, int(k))
    return torch.ceil(ext.count.to(F64) * k - 1e-9).clamp_min(1).long()


def check_topk(x, mask, sink, params, dtype):
    """topk_forward + softmax_backward param_grad 1; the reference gets each row's slots as an integer k."""
    k, is_fraction, temperature = params["k"], params["is_fraction"], params["temperature"]
    y, multiplier, weight = kernels.topk_forward(x, mask, k, is_fraction, temperature, sink=sink)
    ext = Extended(x, mask, sink)
    slots = topk_slots(ext, k, is_fraction)
    temperatures = column(temperature, x)
    expected = torch.zeros_like(ext.scores)
    for row in slots.flatten().unique().tolist():
        rows = slots == row
        expected[rows] = reference.topk_forward(ext.scores[rows], RowMask(ext.mask.tensor[rows]), row, False,
                                                temperatures[rows])[0]
    assert_extended(y, weight, expected, dtype, what="y, sink weight")
    kept = (Extended.outputs(y, weight) > 0).sum(-1)
    finite = ~posinf_rows(ext) & ~(ext.scores.isnan() & ext.mask.tensor).any(-1)
    available = (ext.mask.tensor & (ext.scores != -math.inf)).sum(-1)
    assert torch.equal(kept[finite], torch.minimum(slots, available)[finite]), "slots kept"
    g = upstream(x)
    dx, d_temperature, dsink = kernels.softmax_backward(y, g, multiplier, None, 1, sink_weight=weight)
    expected_dx, expected_dt = reference.softmax_backward(Extended.outputs(y, weight), ext.grad(g),
                                                          multiplier.cpu().to(F64), None, 1)
    assert_extended(dx, dsink, expected_dx, dtype, GRADIENT_SLACK, "dx, dsink")
    assert_close(d_temperature, expected_dt, dtype, GRADIENT_SLACK, "d temperature")


def check_entmax(x, mask, sink, params, dtype):
    """entmax_forward + entmax_backward with alpha's gradient."""
    alpha = params["alpha"]
    y, gate, weight = kernels.entmax_forward(x, mask, alpha, sink=sink)
    ext = Extended(x, mask, sink)
    alpha64 = alpha.cpu().to(F64) if isinstance(alpha, torch.Tensor) else alpha
    expected, expected_gate = reference.entmax_forward(ext.scores, ext.mask, alpha64)
    assert_extended(y, weight, expected, dtype, what="y, sink weight")
    assert_close(gate, expected_gate, dtype, what="gate")
    g = upstream(x)
    dx, d_alpha, dsink = kernels.entmax_backward(y, g, gate, alpha, True, sink_weight=weight)
    expected_dx, expected_da = reference.entmax_backward(Extended.outputs(y, weight), ext.grad(g),
                                                         gate.cpu().to(F64), alpha64, True)
    assert_extended(dx, dsink, expected_dx, dtype, GRADIENT_SLACK, "dx, dsink")
    assert_close(d_alpha, expected_da, dtype, GRADIENT_SLACK, "d alpha")


def check_self_adjusted(x, mask, sink, params, dtype):
    """self_adjusted_forward + self_adjusted_backward; the stats' low, high, gate and softmax weights."""
    normalized = params["normalized"]
    y, stats, weight = kernels.self_adjusted_forward(x, mask, normalized, sink=sink)
    ext = Extended(x, mask, sink)
    expected, expected_stats = reference.self_adjusted_forward(ext.scores, ext.mask, normalized)
    assert_extended(y, weight, expected, dtype, what="y, sink weight")
    assert_close(stats[..., 2:], expected_stats[..., 2:], dtype, what="low, high, gate")
    live = (expected_stats[..., 4] > 0)[..., None] & ext.mask.tensor & (ext.scores != -math.inf)
    c0, c1 = stats[..., 0:1].cpu().to(F64), stats[..., 1:2].cpu().to(F64)
    rebuilt = torch.where(live, torch.exp((ext.scores - c0) - c1), 0.0)
    softmax = reference.softmax_forward(ext.scores, ext.mask, 0, 1.0, 0.0)[0]
    assert_close(rebuilt, torch.where(live, softmax, 0.0), dtype, what="exp((x - c0) - c1)")
    g = upstream(x)
    dx, dsink = kernels.self_adjusted_backward(x, mask, g, stats, normalized, sink=sink)
    expected_dx = reference.self_adjusted_backward(ext.scores, ext.mask, ext.grad(g), expected_stats, normalized)
    assert_extended(dx, dsink, expected_dx, dtype, GRADIENT_SLACK, "dx, dsink")


def rows_of(device, *values: float) -> torch.Tensor:
    """A per-row parameter ``(B, 1, Lq, 1)`` from ``B * Lq`` values."""
    return torch.tensor(values, device=device).reshape(BATCH, 1, QUERIES, 1)


CASES = {
    "softmax-rows": (check_softmax, lambda d: {"temperature": rows_of(d, 0.5, 1.5, 0.7, 2.0, 1.0, 0.25)}),
    "scalable-softmax-rows": (check_scalable_softmax, lambda d: {
        "s": rows_of(d, 0.3, -0.6, 0.43, 1.0, 0.0, 0.2), "bias": rows_of(d, 0.1, 0.5, 0.0, -0.2, 0.3, 0.0)}),
    "topk-3": (check_topk, lambda d: {"k": 3, "is_fraction": False, "temperature": 1.0}),
    "topk-fraction-rows": (check_topk, lambda d: {
        "k": 0.2, "is_fraction": True, "temperature": rows_of(d, 0.5, 2.0, 1.0, 0.7, 1.3, 0.4)}),
    "softmax-entmax": (check_entmax, lambda d: {"alpha": 1.0}),
    "entmax-1.5": (check_entmax, lambda d: {"alpha": 1.5}),
    "sparsemax": (check_entmax, lambda d: {"alpha": 2.0}),
    "entmax-3": (check_entmax, lambda d: {"alpha": 3.0}),
    "entmax-rows": (check_entmax, lambda d: {"alpha": rows_of(d, 1.0, 1.3, 1.5, 2.0, 2.5, 1.15)}),
    "self-adjusted": (check_self_adjusted, lambda d: {"normalized": True}),
    "self-adjusted-plain": (check_self_adjusted, lambda d: {"normalized": False}),
}


def grid() -> list:
    """Every case x mask on one block; on the multi-pass path two mask kinds per case (rotating)."""
    params = []
    for index, case in enumerate(CASES):
        for mask_index, kind in enumerate(MASK_KINDS):
            for path in LENGTHS:
                if path == "single-block" or (mask_index - index) % len(MASK_KINDS) in (0, 2):
                    params.append(pytest.param(case, kind, path, id=f"{case}-{kind}-{path}"))
    return params


@pytest.mark.parametrize(("case", "mask_kind", "path"), grid())
def test_matches_reference_on_the_extended_row(case, mask_kind, path, monkeypatch, device):
    check, make_params = CASES[case]
    length = use_path(path, monkeypatch)
    x = make_scores(length).to(device, torch.float32)
    sink = torch.tensor(SINKS, device=device).reshape(BATCH, 1, QUERIES)
    check(x, make_mask(mask_kind, length, device), sink, make_params(device), torch.float32)


@pytest.mark.parametrize("path", LENGTHS)
@pytest.mark.parametrize("case", ["softmax-rows", "scalable-softmax-rows", "topk-fraction-rows", "entmax-1.5",
                                  "self-adjusted"])
def test_bfloat16_scores(case, path, monkeypatch, device):
    """bfloat16 scores and a float32 sink (not rounded to bfloat16: the kernels compute in float32)."""
    check, make_params = CASES[case]
    length = use_path(path, monkeypatch)
    x = make_scores(length).to(device, torch.bfloat16)
    sink = torch.tensor(SINKS, device=device).reshape(BATCH, 1, QUERIES) + 0.01  # not a bfloat16 number
    check(x, make_mask("bool", length, device), sink, make_params(device), torch.bfloat16)


# ---- special sinks ------------------------------------------------------------------------------


@pytest.mark.parametrize("path", LENGTHS)
@pytest.mark.parametrize("case", CASES)
def test_posinf_sink_is_a_posinf_position(case, path, monkeypatch, device):
    """A +inf sink: the row is uniform over its +inf positions, the sink's included (top-k: it loses ties)."""
    check, make_params = CASES[case]
    length = use_path(path, monkeypatch)
    x = make_scores(length)
    x[0, 0, 1] = -math.inf  # nothing real allowed
    sink = torch.tensor(SINKS).reshape(BATCH, 1, QUERIES)
    sink[0, 0, :] = math.inf  # a row with -inf scores, one with none allowed, a plain one
    sink[1, 0, 1] = math.inf  # the row holding two +inf scores: three +inf positions
    check(x.to(device, torch.float32), RowMask(), sink.to(device), make_params(device), torch.float32)


def all_outputs(case: str, x, mask, sink, device) -> dict:
    """Every output of ``case``'s forward and backward by name, with a sink or without (None)."""
    keyword = {} if sink is None else {"sink": sink}
    g = upstream(x)
    params = CASES[case][1](device)
    if case.startswith(("softmax", "scalable")):
        variant, first, second = (0, params["temperature"], 0.0) if "temperature" in params else (
            1, params["s"], params["bias"])
        y, multiplier, log_count, *weight = kernels.softmax_forward(x, mask, variant, first, second, **keyword)
        backward = {} if sink is None else {"sink_weight": weight[0], "sink": sink}
        dx, per_row, *dsink = kernels.softmax_backward(y, g, multiplier, x, 2, **backward)
        rows = {"multiplier": multiplier, "log_count": log_count, "per_row": per_row}
    elif case.startswith("topk"):
        y, multiplier, *weight = kernels.topk_forward(x, mask, params["k"], params["is_fraction"],
                                                      params["temperature"], **keyword)
        backward = {} if sink is None else {"sink_weight": weight[0]}
        dx, per_row, *dsink = kernels.softmax_backward(y, g, multiplier, None, 1, **backward)
        rows = {"multiplier": multiplier, "per_row": per_row}
    elif "entmax" in case or case == "sparsemax":
        y, gate, *weight = kernels.entmax_forward(x, mask, params["alpha"], **keyword)
        backward = {} if sink is None else {"sink_weight": weight[0]}
        dx, per_row, *dsink = kernels.entmax_backward(y, g, gate, params["alpha"], True, **backward)
        rows = {"gate": gate, "per_row": per_row}
    else:
        y, stats, *weight = kernels.self_adjusted_forward(x, mask, params["normalized"], **keyword)
        backward = kernels.self_adjusted_backward(x, mask, g, stats, params["normalized"], **keyword)
        dx, *dsink = backward if sink is not None else (backward,)
        rows = {"stats": stats}
    sunk = {} if sink is None else {"weight": weight[0], "dsink": dsink[0]}
    assert len(weight) == len(dsink) == len(sunk) // 2
    return {"y": y, "dx": dx, **rows, **sunk}


@pytest.mark.parametrize("path", LENGTHS)
@pytest.mark.parametrize("case", ["scalable-softmax-rows", "topk-fraction-rows", "entmax-rows", "self-adjusted"])
def test_minus_inf_sink_is_no_sink(case, path, monkeypatch, device):
    """A -inf sink takes no part: every output as without a sink, its weight and gradient 0."""
    length = use_path(path, monkeypatch)
    x = make_scores(length).to(device, torch.float32)
    mask = make_mask("bool", length, device)
    plain = all_outputs(case, x, mask, None, device)
    sunk = all_outputs(case, x, mask, torch.full((BATCH, 1, QUERIES), -math.inf, device=device), device)
    assert (sunk.pop("weight") == 0).all() and (sunk.pop("dsink") == 0).all()
    assert sunk.keys() == plain.keys()
    for name, expected in plain.items():
        if expected is None:
            assert sunk[name] is None, name
        else:
            assert_close(sunk[name], expected, torch.float32, what=name)


@pytest.mark.parametrize("path", LENGTHS)
@pytest.mark.parametrize("case", ["softmax-rows", "scalable-softmax-rows", "topk-3", "entmax-1.5", "entmax-3",
                                  "self-adjusted", "self-adjusted-plain"])
def test_nan_sink_makes_its_row_nan(case, path, monkeypatch, device):
    """A NaN sink: its row's weights, sink weight, dx and dsink NaN, whatever the mask; other rows finite."""
    length = use_path(path, monkeypatch)
    x = torch.randn(BATCH, 1, QUERIES, length, generator=torch.Generator().manual_seed(3)).to(device)
    sink = torch.zeros(BATCH, 1, QUERIES, device=device)
    nan_row = torch.zeros(BATCH, 1, QUERIES, dtype=torch.bool, device=device)
    nan_row[0, 0, 1] = nan_row[1, 0, 2] = True  # query 1's keys are all masked: the sink alone makes it NaN
    sink[nan_row] = math.nan
    outputs = all_outputs(case, x, make_mask("bool", length, device), sink, device)
    for name in ("y", "dx"):
        assert outputs[name][nan_row].isnan().all() and not outputs[name][~nan_row].isnan().any(), name
    for name in ("weight", "dsink"):
        assert torch.equal(outputs[name].isnan(), nan_row), name


@pytest.mark.parametrize(("dtype", "path"), [(torch.float32, "single-block"), (torch.float32, "multi-pass"),
                                             (torch.float64, "single-block")])  # 64-bit keys: 67 passes multi-pass
def test_topk_sink_loses_ties_and_takes_a_slot_when_larger(dtype, path, monkeypatch, device):
    length = use_path(path, monkeypatch)
    x = torch.zeros(4, length, dtype=dtype)
    x[:3, [2, 9, 11]] = torch.tensor([4.0, 3.0, 3.0], dtype=dtype)
    x[3, 2] = 4.0
    sink = torch.tensor([3.0, 3.5, 4.0, -0.0], dtype=dtype)
    y, _, weight = kernels.topk_forward(x.to(device), RowMask(), 3, False, 1.0, sink=sink.to(device))
    kept = torch.zeros(4, length + 1, dtype=torch.bool)
    kept[0, [2, 9, 11]] = True  # the sink ties 9 and 11 at the 3rd value and loses
    kept[1, [2, 9, length]] = True  # 3.5 takes 11's slot
    kept[2, [2, 9, length]] = True  # tied with the largest, above the 3rd value: kept
    kept[3, [0, 1, 2]] = True  # -0.0 ties every 0.0 and loses
    extended = torch.cat([x, sink[:, None]], -1).to(F64)
    expected = torch.where(kept, torch.softmax(extended.masked_fill(~kept, -math.inf), -1), 0.0)
    torch.testing.assert_close(Extended.outputs(y, weight), expected, atol=1e-6, rtol=1e-6)
    y, _, weight = kernels.topk_forward(x.to(device), RowMask(), 1, False, 1.0, sink=sink.to(device))
    assert (weight == 0).all() and (y[:, 2] == 1).all()  # row 2: the sink ties the largest and loses
    # A fraction of n = 0 real keys keeps one slot, which the sink takes.
    y, _, weight = kernels.topk_forward(x.to(device), RowMask(torch.zeros(1, length, dtype=torch.bool,
                                                                          device=device)), 0.5, True, 1.0,
                                        sink=sink.to(device))
    assert (y == 0).all() and (weight == 1).all()


@pytest.mark.parametrize("path", ["single-block", "multi-pass"])
@pytest.mark.parametrize("case", CASES)
def test_rows_of_length_one(case, path, monkeypatch, device):
    """One key per row (causal: query 0's masked) and its sink: a block of 2 lanes, or streamed in blocks of 8."""
    if path == "multi-pass":
        monkeypatch.setattr(launch, "SINGLE_BLOCK_MAX", 1)
        monkeypatch.setattr(launch, "MULTI_PASS_BLOCK", FORCED_BLOCK)
    check, make_params = CASES[case]
    x = torch.tensor([0.5, -1.0, 2.0, 1.0, -math.inf, 3.0], device=device).reshape(BATCH, 1, QUERIES, 1)
    sink = torch.tensor([0.5, 1.0, -3.0, 0.0, -math.inf, 2.5], device=device).reshape(BATCH, 1, QUERIES)
    check(x, make_mask("causal", 1, device), sink, make_params(device), torch.float32)


# ---- the keyword's plumbing -------------------------------------------------------------------


def test_sink_shapes_broadcast_and_errors_name_the_argument(device):
    x = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(4)).to(device)
    per_row = torch.tensor([0.5, -0.5, 1.0], device=device).expand(2, 3)
    expected = kernels.entmax_forward(x, RowMask(), 1.5, sink=per_row.contiguous())
    for sink in (per_row, per_row[..., None], torch.tensor([0.5, -0.5, 1.0], device=device).reshape(1, 3, 1)):
        for actual, wanted in zip(kernels.entmax_forward(x, RowMask(), 1.5, sink=sink), expected, strict=True):
            torch.testing.assert_close(actual, wanted)
    with pytest.raises(ValueError, match="sink must have shape"):
        kernels.softmax_forward(x, RowMask(), 0, 1.0, 0.0, sink=torch.zeros(3, device=device))
    with pytest.raises(ValueError, match="sink must have shape"):
        kernels.self_adjusted_forward(x, RowMask(), True, sink=torch.zeros(2, 3, 2, device=device))
    y, multiplier, _, weight = kernels.softmax_forward(x, RowMask(), 1, 1.0, 0.0, sink=per_row)
    with pytest.raises(ValueError, match="sink None"):
        kernels.softmax_backward(y, y, multiplier, x, 2, sink_weight=weight)
    with pytest.raises(ValueError, match="sink_weight None"):
        kernels.softmax_backward(y, y, multiplier, x, 2, sink=per_row)


IN_PLACE_SINKS = {  # sink shape for (B, H, Lq, L) = (2, 3, 2, 5) scores -> (period, count), None: a copy per row
    (1, 3, 1, 1): (2, 3),  # per head (gpt-oss): every batch and query of a head reads one value
    (2, 1, 2, 1): None,  # varies along batch and query, not adjacent
    (2, 1, 1, 1): (6, 2),
    (1, 1, 2, 1): (1, 2),
    (2, 3, 1, 1): (2, 6),  # batch and head merge into one stride
    (2, 3, 2): (1, 12),
    (1, 1, 1, 1): (1, 1),
}
SLOW_SINK_SHAPES = list(IN_PLACE_SINKS)[1:]


@pytest.mark.parametrize(("shape", "dtype"), [
    pytest.param(shape, dtype, id=f"{shape}-{str(dtype).removeprefix('torch.')}", marks=[pytest.mark.slow] * (
        shape in SLOW_SINK_SHAPES or dtype == torch.float32))
    for shape in IN_PLACE_SINKS for dtype in (torch.bfloat16, torch.float32)])
def test_broadcast_sinks_are_read_in_place_bit_for_bit(shape, dtype, device):
    """A sink broadcast over rows reaches the kernels in place, through ``(row // period) % count``: every kernel
    that reads sink scores (six forwards; Scalable-Softmax's multiplier gradient and Self-Adjusted's backward) gives
    bit for bit what the same values materialised one per row give.  A bfloat16 sink is read in its own dtype."""
    x = torch.randn(2, 3, 2, 5, generator=torch.Generator().manual_seed(6)).to(device)
    values = torch.randn(shape, generator=torch.Generator().manual_seed(7))
    sink = values.to(device, dtype)
    materialised = sink.expand((2, 3, 2) if sink.ndim == 3 else (2, 3, 2, 1)).float().contiguous()
    passed, _, period, count = launch.sink_scores(sink, x)
    if IN_PLACE_SINKS[shape] is None:
        assert (period, count) == (1, 12)
    else:
        assert passed.data_ptr() == sink.data_ptr() and passed.dtype == dtype
        assert (period, count) == IN_PLACE_SINKS[shape]
    calls = [functools.partial(kernels.softmax_forward, x, RowMask(), 0, 0.7, 0.0),
             functools.partial(kernels.softmax_forward, x, RowMask(), 1, 0.3, 0.1),
             functools.partial(kernels.topk_forward, x, RowMask(), 2, False, 1.0),
             functools.partial(kernels.entmax_forward, x, RowMask(), 1.5),
             functools.partial(kernels.entmax_forward, x, RowMask(), 2.0),
             functools.partial(kernels.self_adjusted_forward, x, RowMask(), True)]
    g = upstream(x)
    y, multiplier, _, weight = calls[1](sink=materialised)
    stats = calls[5](sink=materialised)[1]
    calls += [functools.partial(kernels.softmax_backward, y, g, multiplier, x, 2, sink_weight=weight),
              functools.partial(kernels.self_adjusted_backward, x, RowMask(), g, stats, True)]
    for index, call in enumerate(calls):
        for actual, wanted in zip(call(sink=sink), call(sink=materialised), strict=True):
            assert (actual is None and wanted is None) or torch.equal(actual, wanted), (shape, dtype, index)


def test_a_float64_sink_of_float32_rows_is_rounded_once(device):
    """A sink wider than the accumulation dtype is cast by torch (rounded to nearest), not read in place."""
    x = torch.randn(2, 5, generator=torch.Generator().manual_seed(8)).to(device)
    sink = torch.tensor([1 / 3, -2 / 3], dtype=F64, device=device)
    values, stride, period, count = launch.sink_scores(sink, x)
    assert values.dtype == torch.float32 and torch.equal(values, sink.float()) and (period, count) == (1, 2)
    assert torch.equal(kernels.softmax_forward(x, RowMask(), 0, 1.0, 0.0, sink=sink)[0],
                       kernels.softmax_forward(x, RowMask(), 0, 1.0, 0.0, sink=sink.float())[0])


def test_outputs_dtypes_and_shapes(device):
    """Sink outputs are per row in the accumulation dtype; without a sink the tuples are as before."""
    for dtype, wide in ((torch.bfloat16, torch.float32), (torch.float64, F64)):
        x = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(5)).to(device, dtype)
        sink = torch.zeros(2, 3, device=device)
        y, multiplier, _, weight = kernels.softmax_forward(x, RowMask(), 0, 1.0, 0.0, sink=sink)
        dx, per_row, dsink = kernels.softmax_backward(y, y, multiplier, None, 0, sink_weight=weight)
        assert per_row is None and y.dtype == dx.dtype == dtype
        for tensor in (weight, dsink, kernels.topk_forward(x, RowMask(), 2, False, 1.0, sink=sink)[2],
                       kernels.entmax_forward(x, RowMask(), 2.0, sink=sink)[2],
                       kernels.self_adjusted_forward(x, RowMask(), True, sink=sink)[2]):
            assert tensor.shape == (2, 3) and tensor.dtype == wide
        assert len(kernels.softmax_forward(x, RowMask(), 0, 1.0, 0.0)) == 3
        assert len(kernels.softmax_backward(y, y, 1.0, None, 0)) == 2
        assert len(kernels.topk_forward(x, RowMask(), 2, False, 1.0)) == 2
        assert len(kernels.entmax_forward(x, RowMask(), 2.0)) == 2
        y, gate = kernels.entmax_forward(x, RowMask(), 2.0)
        assert len(kernels.entmax_backward(y, y, gate, 2.0, False)) == 2
        y, stats = kernels.self_adjusted_forward(x, RowMask(), True)
        assert isinstance(kernels.self_adjusted_backward(x, RowMask(), y, stats, True), torch.Tensor)


def test_without_a_sink_the_launches_are_unchanged(launched_kernels, device):
    """No sink: HAS_SINK is off and blocks are sized for L (16 lanes for 16 keys); a sink needs L + 1 (32)."""
    x = torch.randn(3, 16, device=device)
    kernels.entmax_forward(x, RowMask(), 1.5)
    assert launched_kernels["_entmax_forward_kernel"]["HAS_SINK"] is False
    assert launched_kernels["_entmax_forward_kernel"]["BLOCK"] == 16
    kernels.entmax_forward(x, RowMask(), 1.5, sink=torch.zeros(3, device=device))
    assert launched_kernels["_entmax_forward_kernel"]["HAS_SINK"] is True
    assert launched_kernels["_entmax_forward_kernel"]["BLOCK"] == 32
