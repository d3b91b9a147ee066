"""The Triton backend's seven functions against independent float64 references.

Each function of ``kernels/README.md`` is called directly (forward, then backward on
the forward's outputs) on the ``device`` fixture's tensors: CUDA when there is a GPU,
else CPU tensors through Triton's interpreter.  The references are written here
from the formulas, row by row in float64: softmax-type maps through ``torch.softmax``,
entmax through the ``entmax`` package, top-k through a stable sort, gradients
through ``torch.autograd`` on those formulas.  Both row paths run: one block in
registers (rows of 37) and multi-pass (rows of 21 streamed in blocks of 8, the
single-block limit patched down).  Every output is poisoned with NaN before the
kernels run (``launch.empty`` is patched), so an element a kernel forgets fails.
"""

from __future__ import annotations

import itertools
import math
import pathlib
import re
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

import entmax  # noqa: E402

from attnorm.kernels import triton as kernels  # noqa: E402
from attnorm.kernels.rules import RowMask  # noqa: E402
from attnorm.kernels.triton import launch  # noqa: E402

# The interpreter evaluates masked-off lanes too (e.g. exp(-inf - -inf)); numpy warns about them.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

F64 = torch.float64
BATCH, HEADS, QUERIES = 2, 2, 3
SINGLE_LENGTH = 37  # one block of 64 lanes
MULTI_LENGTH = 21  # three blocks of 8 once the single-block limit is forced to 8
FORCED_BLOCK = 8
PATHS = ("single-block", "multi-pass")

# float16/bfloat16 outputs are rounded to the input dtype (2^-11 and 2^-8 relative).
TOLERANCES = {
    torch.float64: {"atol": 1e-12, "rtol": 1e-10},
    torch.float32: {"atol": 2e-6, "rtol": 2e-5},
    torch.float16: {"atol": 1e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 8e-3, "rtol": 1.6e-2},
}
GRADIENT_SLACK = 5  # gradients get 5x the tolerance


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    def empty(shape, dtype, device):
        return torch.full(shape, math.nan, dtype=dtype, device=device)

    monkeypatch.setattr(launch, "empty", empty)


def row_length(path: str, monkeypatch) -> int:
    """Row length for ``path``; multi-pass forces rows of 21 through blocks of 8."""
    if path == "multi-pass":
        monkeypatch.setattr(launch, "SINGLE_BLOCK_MAX", FORCED_BLOCK)
        monkeypatch.setattr(launch, "MULTI_PASS_BLOCK", FORCED_BLOCK)
        return MULTI_LENGTH
    return SINGLE_LENGTH


# ---- inputs ------------------------------------------------------------------------------


def make_scores(length: int, seed: int = 0) -> torch.Tensor:
    """(B, H, Lq, L) float64 scores: distinct multiples of 3/32 (exact in every dtype, no ties), special rows.

    Never exactly at sparsemax's threshold either: ``x_j = tau = (sum_K x - 1) / K`` would need
    ``3 (sum_K r - K r_j) = 32`` in integers.  With multiples of 1/8 one row had a score on its
    threshold; its weight is 0 exactly, a rounding away from positive, and a GPU's rounding
    (2026-11-26, H100) made it positive and moved the gradient's support.
    """
    generator = torch.Generator().manual_seed(seed)
    ranks = torch.rand(BATCH, HEADS, QUERIES, length, generator=generator).argsort(-1)
    x = ((ranks - length // 2) * 3 / 32).to(F64)
    x[0, 0, 1, ::3] = -math.inf  # -inf scores count as masked
    x[1, 1, 2] = -math.inf  # a fully masked row
    x[1, 0, 0, [3, 7]] = math.inf  # a +inf row: uniform over its +inf positions
    x[0, 1, 2, length - 1] = math.inf  # excluded by key lengths, a +inf row otherwise
    return x


MASK_KINDS = ("none", "bool", "causal", "causal-top-left", "key-lengths", "all-three")


def make_mask(kind: str, length: int, device: str) -> RowMask:
    generator = torch.Generator().manual_seed(1)
    allowed = torch.rand(1, 1, QUERIES, length, generator=generator) > 0.3
    allowed[..., 1, :] = False  # a fully masked query, broadcast over batch and heads
    allowed[..., [3, 7]] = True
    lengths = torch.tensor([length - 4, 9], device=device)
    bottom_right = length - QUERIES  # as with a KV cache
    return {
        "none": RowMask(),
        "bool": RowMask(allowed.to(device)),
        "causal": RowMask(diagonal=bottom_right),
        "causal-top-left": RowMask(diagonal=0),
        "key-lengths": RowMask(key_lengths=lengths),
        "all-three": RowMask(allowed.to(device), bottom_right - 4, lengths),
    }[kind]


def allowed_positions(x: torch.Tensor, mask: RowMask) -> torch.Tensor:
    """Bool like ``x`` (CPU): the mask allows the position and the score is not -inf (written independently)."""
    x = x.cpu()
    keep = x != -math.inf
    if mask.tensor is not None:
        keep = keep & mask.tensor.cpu()
    queries = torch.arange(x.shape[-2])[:, None]
    keys = torch.arange(x.shape[-1])
    if mask.diagonal is not None:
        keep = keep & (keys <= queries + mask.diagonal)
    if mask.key_lengths is not None:
        lengths = mask.key_lengths.cpu().expand(x.shape[0]).reshape(-1, *([1] * (x.ndim - 1)))
        keep = keep & (keys < lengths)
    return keep


def per_row(value, x: torch.Tensor) -> torch.Tensor:
    """A parameter (number or ``(..., 1)`` tensor) as float64 values per row ``x.shape[:-1]`` (CPU)."""
    value = value.cpu() if isinstance(value, torch.Tensor) else torch.tensor(value, dtype=F64)
    return value.to(F64).expand(*x.shape[:-1], 1)[..., 0]


def per_head(*values: float, device: str) -> torch.Tensor:
    """A per-head parameter ``(1, H, 1, 1)`` broadcasting over scores (B, H, Lq, L)."""
    return torch.tensor(values, device=device).reshape(1, -1, 1, 1)


# ---- float64 references, one row at a time ---------------------------------------------


def topk_kept(values: torch.Tensor, k: float, is_fraction: bool) -> torch.Tensor:
    """Bool: the k largest of ``values`` (fraction: ``max(1, ceil(k n))``), ties to the lowest index."""
    n = values.numel()
    count = max(1, math.ceil(k * n - 1e-9)) if is_fraction else int(k)
    order = torch.sort(values, descending=True, stable=True).indices
    kept = torch.zeros(n, dtype=torch.bool)
    kept[order[: min(count, n)]] = True
    return kept


def softmax_row(values, temperature):
    return torch.softmax(values / temperature, -1)


def topk_row(k, is_fraction):
    def weights(values, temperature):
        kept = topk_kept(values.detach(), k, is_fraction)
        return torch.where(kept, torch.softmax((values / temperature).masked_fill(~kept, -math.inf), -1), 0.0)

    return weights


def entmax_row(values, alpha):
    if alpha.item() == 1:
        return torch.softmax(values, -1)
    return entmax.entmax_bisect(values, alpha, n_iter=100)


def self_adjusted_row(normalized):
    def weights(values, _):
        softmax = torch.softmax(values, -1)
        if not normalized:
            return values * softmax
        low = values.amin().clamp_max(0)
        high = values.amax().clamp_min(0)
        span = high - low
        return torch.where(span > 0, (values - low) / torch.where(span > 0, span, 1.0), 0.0) * softmax

    return weights


def reference(weights, x, allowed, param, grad, topk=None, posinf_value=None):
    """Weights, dx and the per-row parameter gradient of ``weights(values, param)`` over each row's allowed scores.

    ``param`` holds one float64 value per row; special rows follow the contract: NaN
    rows NaN, rows with nothing allowed zeros, +inf rows uniform over their +inf
    positions (top-k: the first ``topk(n)`` of them; ``posinf_value`` overrides the
    value there), all with zero gradients.
    """
    x, allowed, grad = x.cpu().to(F64), allowed.expand(x.shape), grad.cpu().to(F64)
    y, dx = torch.zeros_like(x), torch.zeros_like(x)
    dparam = torch.zeros(x.shape[:-1], dtype=F64)
    for index in itertools.product(*(range(size) for size in x.shape[:-1])):
        row, keep = x[index], allowed[index]
        if (keep & row.isnan()).any():
            y[index] = math.nan
            dx[index] = math.nan
            continue
        if not keep.any():
            continue
        posinf = keep & (row == math.inf)
        if posinf.any():
            slots = posinf.nonzero().flatten()
            if topk is not None:
                slots = slots[: topk(int(keep.sum()))]
            y[index + (slots,)] = 1 / len(slots) if posinf_value is None else posinf_value
            continue
        values = row[keep].clone().requires_grad_()
        value = param[index].clone().requires_grad_()
        out = weights(values, value)
        dvalues, dvalue = torch.autograd.grad(out, [values, value], grad[index][keep], allow_unused=True)
        y[index + (keep,)] = out.detach()
        dx[index + (keep,)] = dvalues
        dparam[index] = 0.0 if dvalue is None else dvalue
    return y, dx, dparam


def assert_close(actual, expected, dtype, slack=1, **kwargs):
    tolerance = {key: value * slack for key, value in TOLERANCES[dtype].items()}
    torch.testing.assert_close(actual.cpu().to(F64), expected, equal_nan=True, **tolerance, **kwargs)


def upstream(x: torch.Tensor, seed: int = 2) -> torch.Tensor:
    return torch.randn(x.shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


# ---- the grid: family x mask x path x dtype --------------------------------------------


def run_softmax(x, mask, params, device, dtype):
    """softmax_forward variant 0 + softmax_backward param_grad 1 against softmax(x / T) and dT."""
    temperature = params["temperature"]
    y, multiplier, log_count = kernels.softmax_forward(x, mask, 0, temperature, 0.0)
    g = upstream(x).to(device, dtype)
    dx, d_temperature = kernels.softmax_backward(y, g, multiplier, None, 1)
    assert log_count is None
    allowed = allowed_positions(x, mask)
    expected = reference(softmax_row, x, allowed, per_row(temperature, x), g)
    posinf_row = (allowed & (x.cpu() == math.inf)).any(-1)
    assert_close(multiplier, torch.where(posinf_row, 0.0, 1 / per_row(temperature, x)), dtype)
    return (y, dx, d_temperature), expected


def run_scalable_softmax(x, mask, params, device, dtype):
    """softmax_forward variant 1 + softmax_backward param_grad 2 against softmax(m x), m = s log n + b, and dm."""
    s, bias = params["s"], params["bias"]
    y, multiplier, log_count = kernels.softmax_forward(x, mask, 1, s, bias)
    g = upstream(x).to(device, dtype)
    dx, d_multiplier = kernels.softmax_backward(y, g, multiplier, x, 2)
    allowed = allowed_positions(x, mask)
    count = allowed.expand(x.shape).sum(-1).to(F64)
    expected_multiplier = per_row(s, x) * count.clamp_min(1).log() + per_row(bias, x)
    posinf_row = (allowed & (x.cpu() == math.inf)).any(-1)
    assert_close(log_count, count.clamp_min(1).log(), dtype)
    assert_close(multiplier, torch.where(posinf_row, 0.0, expected_multiplier), dtype)
    expected = reference(lambda v, m: torch.softmax(m * v, -1), x, allowed, expected_multiplier, g)
    return (y, dx, d_multiplier), expected


def run_topk(x, mask, params, device, dtype):
    """topk_forward + softmax_backward param_grad 1 against a stable-sort top-k softmax and dT."""
    k, is_fraction, temperature = params["k"], params["is_fraction"], params["temperature"]
    y, multiplier = kernels.topk_forward(x, mask, k, is_fraction, temperature)
    g = upstream(x).to(device, dtype)
    dx, d_temperature = kernels.softmax_backward(y, g, multiplier, None, 1)
    allowed = allowed_positions(x, mask)

    def kept_count(n):
        return max(1, math.ceil(k * n - 1e-9)) if is_fraction else int(k)

    expected = reference(topk_row(k, is_fraction), x, allowed, per_row(temperature, x), g, topk=kept_count)
    return (y, dx, d_temperature), expected


def run_entmax(x, mask, params, device, dtype):
    """entmax_forward + entmax_backward (alpha_grad) against the entmax package's bisection and its d alpha."""
    alpha = params["alpha"]
    y, gate = kernels.entmax_forward(x, mask, alpha)
    g = upstream(x).to(device, dtype)
    dx, d_alpha = kernels.entmax_backward(y, g, gate, alpha, True)
    allowed = allowed_positions(x, mask)
    posinf_row = (allowed & (x.cpu() == math.inf)).any(-1)
    assert_close(gate, (~posinf_row).to(F64), dtype)
    expected = reference(entmax_row, x, allowed, per_row(alpha, x), g)
    return (y, dx, d_alpha), expected


def run_self_adjusted(x, mask, params, device, dtype):
    """self_adjusted_forward + self_adjusted_backward against phi(x) softmax(x) and autograd."""
    normalized = params["normalized"]
    y, stats = kernels.self_adjusted_forward(x, mask, normalized)
    g = upstream(x).to(device, dtype)
    dx = kernels.self_adjusted_backward(x, mask, g, stats, normalized)
    allowed = allowed_positions(x, mask)
    posinf_row = (allowed & (x.cpu() == math.inf)).any(-1)
    gate = allowed.expand(x.shape).any(-1) & ~posinf_row
    assert stats.shape == (*x.shape[:-1], 5)
    assert_close(stats[..., 4], gate.to(F64), dtype)
    # The softmax weights rebuilt from the stats, w = exp((x - c0) - c1), on live rows.
    c0, c1 = stats[..., 0:1].cpu().to(F64), stats[..., 1:2].cpu().to(F64)
    rebuilt = torch.where(allowed & gate[..., None], torch.exp((x.cpu().to(F64) - c0) - c1), 0.0)
    softmax = reference(softmax_row, x, allowed & gate[..., None], torch.ones(x.shape[:-1], dtype=F64), g)[0]
    finite_row = ~(allowed & x.cpu().isnan()).any(-1)
    assert_close(rebuilt[finite_row], softmax[finite_row], dtype)
    posinf_value = None if normalized else math.inf
    expected = reference(self_adjusted_row(normalized), x, allowed, torch.zeros(x.shape[:-1], dtype=F64), g,
                         posinf_value=posinf_value)
    return (y, dx, None), expected


CASES = {
    "softmax": (run_softmax, lambda device: {"temperature": 0.7}),
    "softmax-per-head": (run_softmax, lambda device: {"temperature": per_head(0.5, 1.5, device=device)}),
    "scalable-softmax": (run_scalable_softmax, lambda device: {"s": 0.43, "bias": 0.0}),
    "scalable-softmax-per-head": (
        run_scalable_softmax,
        lambda device: {"s": per_head(0.3, -0.6, device=device), "bias": per_head(0.1, 0.5, device=device)},
    ),
    "topk-3": (run_topk, lambda device: {"k": 3, "is_fraction": False, "temperature": 1.0}),
    "topk-fraction": (
        run_topk,
        lambda device: {"k": 0.2, "is_fraction": True, "temperature": per_head(0.5, 2.0, device=device)},
    ),
    "sparsemax": (run_entmax, lambda device: {"alpha": 2.0}),
    "entmax-1.5": (run_entmax, lambda device: {"alpha": 1.5}),
    "entmax-per-head": (run_entmax, lambda device: {"alpha": per_head(1.0, 1.3, device=device)}),  # head 0: softmax
    "entmax-3": (run_entmax, lambda device: {"alpha": 3.0}),
    "self-adjusted": (run_self_adjusted, lambda device: {"normalized": True}),
    "self-adjusted-plain": (run_self_adjusted, lambda device: {"normalized": False}),
}


def grid() -> list:
    """Every (case, mask kind, path, dtype).  The interpreter is slow: the default run keeps every
    single-block float32 combination, every case on the multi-pass path with one mask kind, and every
    case in float64/float16/bfloat16 on one block with one mask kind; the rest is marked slow."""
    combinations = []
    for index, case in enumerate(CASES):
        for mask_index, mask_kind in enumerate(MASK_KINDS):
            for path in PATHS:
                for dtype in TOLERANCES:
                    rotated = mask_index == index % len(MASK_KINDS)
                    if path == "single-block":
                        fast = dtype == torch.float32 or (rotated and index % 3 == list(TOLERANCES).index(dtype) - 1)
                    else:
                        fast = dtype == torch.float32 and rotated
                    marks = () if fast else (pytest.mark.slow,)
                    ids = f"{case}-{mask_kind}-{path}-{str(dtype).removeprefix('torch.')}"
                    combinations.append(pytest.param(case, mask_kind, path, dtype, marks=marks, id=ids))
    return combinations


@pytest.mark.parametrize(("case", "mask_kind", "path", "dtype"), grid())
def test_matches_float64_reference(case, mask_kind, path, dtype, monkeypatch, device):
    run, make_params = CASES[case]
    length = row_length(path, monkeypatch)
    x = make_scores(length).to(device, dtype)  # the reference sees exactly the scores the kernel sees
    (y, dx, per_row_grad), (expected_y, expected_dx, expected_per_row) = run(
        x, make_mask(mask_kind, length, device), make_params(device), device, dtype
    )
    assert y.dtype == dx.dtype == dtype and y.device == x.device
    assert_close(y, expected_y, dtype, msg=lambda m: f"y: {m}")
    assert_close(dx, expected_dx, dtype, GRADIENT_SLACK, msg=lambda m: f"dx: {m}")
    if per_row_grad is not None:
        wide = F64 if dtype == F64 else torch.float32
        assert per_row_grad.shape == x.shape[:-1] and per_row_grad.dtype == wide
        assert_close(per_row_grad, expected_per_row, dtype, GRADIENT_SLACK, msg=lambda m: f"per-row grad: {m}")


# ---- special rows and finite extremes ----------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", CASES)
def test_nan_makes_its_row_nan_and_only_when_allowed(case, path, monkeypatch, device):
    run, make_params = CASES[case]
    length = row_length(path, monkeypatch)
    x = torch.randn(1, HEADS, QUERIES, length, generator=torch.Generator().manual_seed(3), dtype=F64)
    x[0, 0, 0, 4] = math.nan  # allowed: the whole row becomes NaN
    x[0, 1, 1, 5] = math.nan  # masked: the row is unaffected
    x[0, 1, 2, [2, 6]] = torch.tensor([math.nan, math.inf], dtype=F64)  # NaN beats +inf
    allowed = torch.ones(length, dtype=torch.bool)
    allowed[[5, 6, 7]] = False
    x = x.to(device, torch.float32)
    mask = RowMask(allowed.reshape(1, 1, 1, -1).to(device))
    (y, dx, _), (expected_y, _, _) = run(x, mask, make_params(device), device, torch.float32)
    assert y[0, 0, 0].isnan().all() and dx[0, 0, 0].isnan().all()
    assert not y[0, 1, 1].isnan().any() and not dx[0, 1, 1].isnan().any()
    assert y[0, 1, 2].isnan().all()
    assert_close(y, expected_y, torch.float32)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_finite_extreme_scores_never_give_nan(path, dtype, monkeypatch, device):
    row_length(path, monkeypatch)
    big = torch.finfo(dtype).max
    none = RowMask()

    def scores(*values):
        return torch.tensor([values], dtype=dtype, device=device)

    y = kernels.softmax_forward(scores(big * 0.9, 0.0), none, 0, 0.5, 0.0)[0]  # m x overflows before the shift
    assert_close(y, torch.tensor([[1.0, 0.0]], dtype=F64), dtype)
    y = kernels.softmax_forward(scores(big / 3.4, 0.0, 0.0, 0.0), none, 1, -1.0, 0.0)[0]  # m < 0: shift by the min
    assert_close(y, torch.tensor([[0.0, 1 / 3, 1 / 3, 1 / 3]], dtype=F64), dtype)
    y = kernels.softmax_forward(scores(big * 0.9, big * 0.6, -big * 0.9), none, 1, 2.0, 0.0)[0]
    assert_close(y, torch.tensor([[1.0, 0.0, 0.0]], dtype=F64), dtype)
    y = kernels.softmax_forward(scores(big * 0.9, -big * 0.9), none, 1, 0.0, 0.0)[0]  # m = 0: uniform
    assert_close(y, torch.tensor([[0.5, 0.5]], dtype=F64), dtype)
    y = kernels.topk_forward(scores(big * 0.9, -big * 0.9, 0.0), none, 2, False, 0.5)[0]
    assert_close(y, torch.tensor([[1.0, 0.0, 0.0]], dtype=F64), dtype)
    y = kernels.topk_forward(scores(big * 0.9, -big * 0.9, 0.0), none, 2, False, -1.0)[0]  # m < 0: shift by the k-th
    assert_close(y, torch.tensor([[0.0, 0.0, 1.0]], dtype=F64), dtype)
    for normalized in (True, False):
        x = scores(big * 0.9, -big * 0.9, 1.0)
        y, stats = kernels.self_adjusted_forward(x, none, normalized)
        expected = [[1.0, 0.0, 0.0]] if normalized else [[big * 0.9, 0.0, 0.0]]
        assert y.isfinite().all() and stats.isfinite().all()
        assert_close(y, torch.tensor(expected, dtype=F64), dtype)
        dx = kernels.self_adjusted_backward(x, none, torch.ones_like(x), stats, normalized)
        assert not dx.isnan().any()
    for alpha in (1.5, 2.0, 3.0):
        y = kernels.entmax_forward(scores(big * 0.9, -big * 0.9, 0.0), none, alpha)[0]
        assert_close(y, torch.tensor([[1.0, 0.0, 0.0]], dtype=F64), dtype)


@pytest.mark.parametrize("path", PATHS)
def test_self_adjusted_on_denormal_scores(path, monkeypatch, device):
    row_length(path, monkeypatch)
    x = torch.tensor([[1e-40, 3e-40, 0.0, 2e-40]], device=device)
    y, stats = kernels.self_adjusted_forward(x, RowMask(), True)
    exact = x.cpu().to(F64)  # the float32 denormals, exactly
    expected = exact / exact.max() * torch.softmax(exact, -1)
    assert y.isfinite().all() and stats.isfinite().all()
    assert_close(y, expected, torch.float32)
    dx = kernels.self_adjusted_backward(x, RowMask(), torch.zeros_like(x), stats, True)
    assert (dx == 0).all()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_topk_ties_at_the_kth_value_keep_the_lowest_index(path, dtype, monkeypatch, device):
    length = row_length(path, monkeypatch)
    x = torch.zeros(4, length, dtype=dtype)
    x[0, [2, 9, 11, 17]] = 3.0  # four-way tie for the 2nd..4th places behind position 20
    x[0, 20] = 4.0
    x[1, [19, 5, 13]] = 1.0  # ties spread over blocks, k = 3 of them plus the zeros
    x[1, 0] = 2.0
    x[2] = -0.0  # -0.0 and 0.0 tie: every position ties
    x[2, ::2] = 0.0
    x[3, [1, 4, 16]] = math.inf  # a +inf row keeps its first k +inf positions
    y = kernels.topk_forward(x.to(device), RowMask(), 3, False, 1.0)[0].cpu()
    kept = torch.zeros_like(x, dtype=torch.bool)
    kept[0, [2, 9, 20]] = True
    kept[1, [0, 5, 13]] = True
    kept[2, [0, 1, 2]] = True
    kept[3, [1, 4, 16]] = True
    expected = torch.where(kept, torch.softmax(torch.where(kept, x, -math.inf).nan_to_num(posinf=0.0), -1), 0.0)
    assert_close(y, expected.to(F64), dtype)


@pytest.mark.parametrize("path", PATHS)
def test_topk_negative_inverse_temperature_shifts_by_the_least_kept_score(path, monkeypatch, device):
    """The kernel's rule for ``1 / T < 0`` (eager checks reject such T; the kernel still defines it).

    A streamed row's search may stop at a threshold far below its k-th score (here +0.0,
    settled by the first 4-bit pass): shifted by it, ``exp((x - shift) / T)`` underflows to 0.
    """
    length = row_length(path, monkeypatch)
    x = -1.0 - torch.arange(length, dtype=F64).repeat(2, 1) / length
    x[:, :3] = torch.tensor([100.0, 101.0, 102.0], dtype=F64)
    temperature = torch.tensor([[-0.01], [0.5]], dtype=F64)
    y = kernels.topk_forward(x.to(device), RowMask(), 3, False, temperature.to(device))[0].cpu()
    expected = torch.zeros_like(x)
    expected[:, :3] = torch.softmax(x[:, :3] / temperature, -1)
    assert_close(y, expected, torch.float64)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("alpha", [3.0, 10.0])
def test_entmax_large_alpha_matches_mpmath(alpha, dtype, path, monkeypatch, device):
    """A 60-digit bisection: at alpha = 10 the two largest of these 37 scores get 0.987 / 0.013.

    ``(z_i - tau)^(1/9)`` with ``z_i - tau ~ 1e-17`` is beyond any tau found to float
    precision; the kernel writes tau relative to the pivot score and must match to rounding.
    """
    mpmath = pytest.importorskip("mpmath")
    row_length(path, monkeypatch)
    mpmath.mp.dps = 60
    x = torch.stack([torch.randn(37, generator=torch.Generator().manual_seed(seed)) for seed in (25, 14)]).to(dtype)
    expected = torch.tensor([mpmath_entmax(row.tolist(), alpha, mpmath) for row in x], dtype=F64)
    y = kernels.entmax_forward(x.to(device), RowMask(), alpha)[0]
    tolerance = {"atol": 2e-7, "rtol": 0} if dtype == torch.float32 else {"atol": 1e-14, "rtol": 0}
    torch.testing.assert_close(y.cpu().to(F64), expected, **tolerance)
    if alpha == 10:
        assert expected[0].topk(2).values.tolist() == pytest.approx([0.98666, 0.01334], abs=1e-5)


def mpmath_entmax(row: list[float], alpha: float, mpmath) -> list[float]:
    """alpha-entmax of ``row`` by bisection on tau at the current mpmath precision."""
    z = [(mpmath.mpf(alpha) - 1) * mpmath.mpf(value) for value in row]
    power = 1 / (mpmath.mpf(alpha) - 1)
    low, high = max(z) - 1, max(z)
    for _ in range(400):
        tau = (low + high) / 2
        if sum((value - tau) ** power for value in z if value > tau) >= 1:
            low = tau
        else:
            high = tau
    tau = (low + high) / 2
    return [float((value - tau) ** power) if value > tau else 0.0 for value in z]


# ---- the contract's shapes, dtypes and aliasing --------------------------------------------


def all_outputs(x, device):
    """Every function's outputs on ``x`` with a per-row parameter, and the inputs they were given."""
    mask = RowMask(torch.ones(1, 1, x.shape[-1], dtype=torch.bool, device=device))
    rows = torch.full((*x.shape[:-1], 1), 1.5, device=device)
    g = torch.ones_like(x)
    outputs = {}
    y, multiplier, log_count = kernels.softmax_forward(x, mask, 1, rows, 0.1)
    outputs["softmax_forward"] = (y, multiplier, log_count)
    outputs["softmax_backward"] = kernels.softmax_backward(y, g, multiplier, x, 2)
    outputs["topk_forward"] = kernels.topk_forward(x, mask, 0.5, True, rows)
    y, gate = kernels.entmax_forward(x, mask, rows)
    outputs["entmax_forward"] = (y, gate)
    outputs["entmax_backward"] = kernels.entmax_backward(y, g, gate, rows, True)
    y, stats = kernels.self_adjusted_forward(x, mask, True)
    outputs["self_adjusted_forward"] = (y, stats)
    outputs["self_adjusted_backward"] = (kernels.self_adjusted_backward(x, mask, g, stats, True),)
    return outputs, (x, g, rows, mask.tensor)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_output_shapes_dtypes_and_no_aliasing(dtype, device):
    x = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(8)).to(device, dtype)
    outputs, inputs = all_outputs(x, device)
    wide = F64 if dtype == F64 else torch.float32
    expected_shapes = {"self_adjusted_forward": (x.shape, (2, 3, 5))}
    seen = [tensor.untyped_storage().data_ptr() for tensor in inputs]
    for name, result in outputs.items():
        for position, tensor in enumerate(result):
            if tensor is None:
                continue
            shape = expected_shapes.get(name, (x.shape, x.shape[:-1], x.shape[:-1]))[position]
            assert tensor.shape == shape, name
            assert tensor.dtype == (dtype if position == 0 else wide), name
            assert tensor.isfinite().all(), name
            assert tensor.untyped_storage().data_ptr() not in seen, f"{name} output {position} aliases"
            seen.append(tensor.untyped_storage().data_ptr())
    assert outputs["softmax_forward"][2] is not None
    assert kernels.softmax_forward(x, RowMask(), 0, 1.0, 0.0)[2] is None
    y, multiplier, _ = outputs["softmax_forward"]
    assert kernels.softmax_backward(y, torch.ones_like(y), multiplier, None, 0)[1] is None
    y, gate = outputs["entmax_forward"]
    assert kernels.entmax_backward(y, torch.ones_like(y), gate, 1.5, False)[1] is None


def test_non_contiguous_scores_and_a_batched_five_dim_mask(device):
    x = torch.randn(2, 2, 3, 5, 4, generator=torch.Generator().manual_seed(6), dtype=F64)  # (B, G, H, Lk, Lq)
    x = x.to(device).transpose(-1, -2)  # (B, G, H, Lq, Lk), not contiguous along Lk
    mask = RowMask(diagonal=1, key_lengths=torch.tensor([4], device=device))
    y = kernels.softmax_forward(x, mask, 1, 0.43, 0.0)[0]
    allowed = allowed_positions(x, mask)
    multiplier = 0.43 * allowed.expand(x.shape).sum(-1).clamp_min(1).to(F64).log()
    expected = reference(lambda v, m: torch.softmax(m * v, -1), x, allowed, multiplier, torch.zeros_like(x))[0]
    assert_close(y, expected, F64)


def test_mask_errors_name_the_shape(device):
    with pytest.raises(ValueError, match="batch axis"):
        kernels.softmax_forward(torch.randn(3, 5, device=device), RowMask(key_lengths=torch.tensor([2, 3, 4])), 0,
                                1.0, 0.0)
    with pytest.raises(ValueError, match="key_lengths must have shape"):
        kernels.softmax_forward(torch.randn(2, 3, 5, device=device), RowMask(key_lengths=torch.tensor([2, 3, 4])),
                                0, 1.0, 0.0)
    with pytest.raises(ValueError, match="at least 2 dims"):
        kernels.entmax_forward(torch.randn(5, device=device), RowMask(diagonal=0), 1.5)
    with pytest.raises(ValueError, match="variant"):
        kernels.softmax_forward(torch.randn(5, device=device), RowMask(), 2, 1.0, 0.0)
    with pytest.raises(ValueError, match="param_grad"):
        kernels.softmax_backward(torch.rand(5, device=device), torch.rand(5, device=device), 1.0, None, 2)


def test_empty_input(device):
    x = torch.empty(0, 7, device=device)
    y, multiplier, log_count = kernels.softmax_forward(x, RowMask(), 1, 0.5, 0.0)
    assert y.shape == (0, 7) and multiplier.shape == log_count.shape == (0,)


def test_launch_integer_helpers_match_the_definitions():
    for n in range(0, 5000):
        assert launch.next_power_of_2(n) == (1 if n <= 1 else 2 ** math.ceil(math.log2(n)))
        for d in (1, 3, 16, 64):
            assert launch.cdiv(n, d) == math.ceil(n / d)


def test_number_parameters_are_made_once_per_value_in_eager_calls(device, monkeypatch):
    """A number parameter is one kept element per (value bits, dtype, device): no fill per call
    (on CUDA a kernel launch), -0.0 apart from 0.0, every NaN one; fresh under a dispatch mode
    (a tracer sees it) and once the store is full (nothing kept is ever freed)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    monkeypatch.setattr(launch, "_CONSTANTS", {})
    x32, x64 = torch.zeros(2, 3, device=device), torch.zeros(2, 3, device=device, dtype=F64)
    half = launch.row_param(0.5, x32)[0]
    assert launch.row_param(0.5, x32)[0] is half and launch.softcap_arg(0.5, x32) is half
    assert half.dtype == torch.float32 and half.device == x32.device and half.tolist() == [0.5]
    assert launch.row_param(0.5, x64)[0].dtype == F64
    assert launch.row_param(0.1, x64)[0].item() == 0.1  # float64 rows keep float64 numbers
    assert math.copysign(1.0, launch.row_param(-0.0, x32)[0].item()) == -1.0
    assert math.copysign(1.0, launch.row_param(0.0, x32)[0].item()) == 1.0
    assert launch.row_param(math.nan, x32)[0] is launch.row_param(float("nan"), x32)[0]

    class Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Seen():
        assert launch.row_param(0.5, x32)[0] is not half
    if x32.is_cuda:  # kept per stream: a kernel on another stream is not ordered after the fill
        with torch.cuda.stream(torch.cuda.Stream()):
            other = launch.row_param(0.5, x32)[0]
            assert other is not half and launch.row_param(0.5, x32)[0] is other
    monkeypatch.setattr(launch, "CONSTANTS_KEPT", len(launch._CONSTANTS))
    seven = launch.row_param(7.0, x32)[0]
    assert seven.tolist() == [7.0] and launch.row_param(7.0, x32)[0] is not seven
    assert launch.row_param(0.5, x32)[0] is half


def test_source_never_synchronises_with_the_host():
    """No ``.item()``, ``.tolist()``, ``bool(tensor)`` or ``.cpu()`` in the launch code (the kernels cannot)."""
    package = pathlib.Path(kernels.__file__).parent
    for path in package.glob("*.py"):
        source = path.read_text()
        syncing = r"\.item\(\)|\.tolist\(\)|\.cpu\(\)|\.numpy\(\)|\bbool\((?!normalized|is_fraction|alpha_grad)"
        found = re.findall(syncing, source)
        assert not found, f"{path.name}: {found}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host synchronisation is only observable on CUDA")
def test_no_host_synchronisation_on_cuda(device):
    x = torch.randn(2, 3, 300, device=device)
    lengths = torch.tensor([200, 100], device=device)
    mask = RowMask(torch.rand(1, 3, 300, device=device) > 0.2, 250, lengths)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for single_block_max in (launch.SINGLE_BLOCK_MAX, 64):
            launch.SINGLE_BLOCK_MAX, saved = single_block_max, launch.SINGLE_BLOCK_MAX
            try:
                all_outputs(x, device)
                kernels.topk_forward(x, mask, 3, False, 0.5)
                kernels.softmax_forward(x, mask, 0, 0.5, 0.0)
                kernels.self_adjusted_backward(x, mask, x, kernels.self_adjusted_forward(x, mask, False)[1], False)
            finally:
                launch.SINGLE_BLOCK_MAX = saved
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_package_import_fails_cleanly_without_triton():
    program = (
        "import sys\n"
        "sys.modules['triton'] = None\n"
        "try:\n"
        "    import attnorm.kernels.triton\n"
        "except ImportError:\n"
        "    pass\n"
        "else:\n"
        "    raise SystemExit('imported without triton')\n"
    )
    subprocess.run([sys.executable, "-c", program], check=True)


WEIGHTS_ONLY = {  # name -> call(x, sink, softcap, weights_only): the forward's outputs
    "softmax": lambda x, sink, cap, only: kernels.softmax_forward(x, RowMask(), 0, 0.7, 0.0, sink, cap,
                                                                  weights_only=only),
    "ssmax": lambda x, sink, cap, only: kernels.softmax_forward(x, RowMask(), 1, 0.6, 0.1, sink, cap,
                                                                weights_only=only),
    "topk": lambda x, sink, cap, only: kernels.topk_forward(x, RowMask(), 5, False, 1.5, sink, cap, weights_only=only),
    "sparsemax": lambda x, sink, cap, only: kernels.entmax_forward(x, RowMask(), 2.0, sink, cap, weights_only=only),
    "sa": lambda x, sink, cap, only: kernels.self_adjusted_forward(x, RowMask(), True, sink, cap, weights_only=only),
}


@pytest.mark.parametrize("path", [PATHS[0], pytest.param(PATHS[1], marks=pytest.mark.slow)])  # one epilogue
@pytest.mark.parametrize("modifiers", ["none", "sink and cap"])
@pytest.mark.parametrize("name", list(WEIGHTS_ONLY))
def test_weights_only_skips_the_statistics_and_keeps_the_weights(name, modifiers, path, device, monkeypatch):
    """``weights_only=True`` (every no-grad module call and decoding step) allocates and writes no per-row
    statistics: None comes back in their place, and the weights (and a sink's weight) are bit for bit those
    of the full call, outputs poisoned first."""
    length = row_length(path, monkeypatch)
    generator = torch.Generator().manual_seed(11)
    x = (torch.randn(4, length, generator=generator) * 4).to(device)
    x[0, 2] = math.inf  # a row holding +inf: the statistics differ there
    x[-1] = -math.inf  # a fully masked row
    sink, cap = ((torch.randn(4, generator=generator).to(device), 3.0) if modifiers != "none" else (None, None))
    full = WEIGHTS_ONLY[name](x, sink, cap, False)
    only = WEIGHTS_ONLY[name](x, sink, cap, True)
    assert len(only) == len(full)
    torch.testing.assert_close(only[0], full[0], rtol=0, atol=0, equal_nan=True)
    assert not only[0].isnan().any()
    statistics = only[1:len(only) - (sink is not None)]
    assert statistics and all(value is None for value in statistics)
    if sink is not None:
        torch.testing.assert_close(only[-1], full[-1], rtol=0, atol=0)


BROADCAST_MASKS = {  # mask shape against scores (2, 3, 4, L): how Hugging Face and users pass them
    "per batch (B,1,1,L)": (2, 1, 1, None),
    "per batch and query (B,1,Lq,L)": (2, 1, 4, None),
    "per head (1,H,1,L)": (1, 3, 1, None),
    "per query (Lq,L)": (4, None),
    "one row (L,)": (None,),
    "full (B,H,Lq,L)": (2, 3, 4, None),
}
MASKED_CALLS = {
    "softmax": lambda x, m: kernels.softmax_forward(x, m, 0, 0.7, 0.0)[0],
    "topk": lambda x, m: kernels.topk_forward(x, m, 3, False, 1.0)[0],
    "entmax": lambda x, m: kernels.entmax_forward(x, m, 1.5)[0],
    "sa": lambda x, m: kernels.self_adjusted_forward(x, m, True)[0],
    "sa backward": lambda x, m: kernels.self_adjusted_backward(
        x, m, torch.ones_like(x), kernels.self_adjusted_forward(x, m, True)[1], True)[0],
}


@pytest.mark.parametrize(("name", "shape"), [  # every shape through one kernel, every kernel's arguments with one
    pytest.param(name, shape, marks=() if name == "entmax" or shape == "per batch (B,1,1,L)" else pytest.mark.slow)
    for name in MASKED_CALLS for shape in BROADCAST_MASKS])
def test_broadcast_bool_masks_are_read_in_place(name, shape, device):
    """A bool mask that broadcasts over heads, queries or batches is read through its own strides (no copy of it per
    call: the kernels take its batch, head and query strides), with the weights of the same mask materialised."""
    length = 37
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, 4, length, generator=generator).to(device)
    sizes = tuple(length if size is None else size for size in BROADCAST_MASKS[shape])
    mask = torch.rand(sizes, generator=generator) > 0.4
    mask[..., 0] = True
    mask = mask.to(device)
    flat, _ = launch._mask_view(mask, x, 3 * 4, 4)
    assert flat.data_ptr() == mask.data_ptr()  # a view of the caller's mask
    got = MASKED_CALLS[name](x, RowMask(mask))
    want = MASKED_CALLS[name](x, RowMask(mask.expand(x.shape).contiguous()))
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def test_masks_whose_head_dims_do_not_merge_are_copied_and_still_right(device):
    """Scores (B, A, H, Lq, L) and a mask varying along H but broadcast along A: no single head stride walks
    (A, H), so the mask is copied to one row per score row, and the weights are those of the materialised mask."""
    generator = torch.Generator().manual_seed(6)
    x = torch.randn(2, 2, 3, 4, 19, generator=generator).to(device)
    mask = (torch.rand(2, 1, 3, 4, 19, generator=generator) > 0.4).to(device)
    flat, strides = launch._mask_view(mask, x, 2 * 3 * 4, 4)
    assert flat.data_ptr() != mask.data_ptr() and strides == (24 * 19, 4 * 19, 19, 1)
    got = kernels.entmax_forward(x, RowMask(mask), 2.0)[0]
    want = kernels.entmax_forward(x, RowMask(mask.expand(x.shape).contiguous()), 2.0)[0]
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    reference = entmax.sparsemax(torch.where(mask, x.double(), -math.inf).cpu(), dim=-1)
    torch.testing.assert_close(got.double().cpu(), reference, rtol=1e-5, atol=1e-6)
