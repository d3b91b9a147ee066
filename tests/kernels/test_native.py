"""The native CPU row kernels (attnorm.kernels.native) and their autograd Functions
(attnorm.kernels.cpu_native) against independent float64 references.

References: ``torch.softmax``; the ``entmax`` package (``sparsemax``, ``entmax15``,
``entmax_bisect``); a top-k softmax built here from a stable sort, or for ties from
an explicit scan; SA-Softmax from :mod:`attnorm.kernels.old_reference`.  Gradients are
compared with autograd through those references, and the public Functions pass
``gradcheck``.  Output buffers are filled with NaN before each call, so an element
a kernel leaves unwritten fails the comparison.

Tolerances, absolute: 1e-5 for float32, 1e-10 for float64; for entmax's backward
relative to its largest Jacobian entry (see :func:`test_entmax_backward`), and for
entmax with alpha > 2 on random rows plus what rounding alone may cost there (see
:func:`entmax_tolerance`).  Row lengths: 1, 2, 7, 300 and 1000 (not multiples of
16), 4096, and 9000 (past 8192 the entmax kernel bounds its threshold with more
position groups).
"""

from __future__ import annotations

import math
import os
import shutil

import entmax
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import Tensor
from torch.autograd import gradcheck, gradgradcheck

from attnorm.kernels import cpu_native, old_reference as reference
from attnorm.kernels.cpu import native

pytestmark = [
    pytest.mark.skipif(shutil.which(os.environ.get("CC") or "cc") is None, reason="no C compiler"),
    pytest.mark.skipif(os.environ.get("ATTNORM_NATIVE") == "0", reason="native kernels off (ATTNORM_NATIVE=0)"),
]

DTYPES = [torch.float32, torch.float64]
TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-10}
LENGTHS = [1, 2, 7, 300, 1000, 4096, 9000]
ALPHAS = [1.05, 1.3, 1.5, 1.7, 2.0, 2.5, 4.0]
# Two rows each: ordinary, near-uniform (every score in entmax's support), very peaked.
SPREADS = (2.0, 0.01, 30.0)

def scores(length: int, dtype: torch.dtype, seed: int = 0) -> Tensor:
    """``(6, length)`` normal scores, two rows per standard deviation in SPREADS."""
    generator = torch.Generator().manual_seed(seed)
    spread = torch.tensor(SPREADS, dtype=torch.float64).repeat_interleave(2).unsqueeze(-1)
    return (torch.randn(len(spread), length, generator=generator, dtype=torch.float64) * spread).to(dtype)


def poisoned(x: Tensor) -> Tensor:
    """An output buffer of NaN: whatever a kernel does not write stays NaN."""
    return torch.full_like(x, math.nan)


def assert_weights(out: Tensor, expected: Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[dtype], rtol=0)


def softmax_reference(x: Tensor, scale: float | Tensor) -> Tensor:
    """``softmax(scale * x)`` in float64; -inf scores get 0."""
    return torch.softmax(x.double() * scale, -1)


def entmax_reference(x: Tensor, alpha: float) -> Tensor:
    """alpha-entmax in float64 from the entmax package.

    -inf scores become finite ones far below the row (entmax15's cumulative sums
    turn -inf into NaN); they still get 0, since entmax's support lies within
    ``1 / (alpha - 1)`` of the row maximum.  The scores are shifted by the row
    maximum first (entmax is shift invariant), so that the package's threshold
    search rounds no more than the kernel's, which works relative to the maximum.
    """
    x = x.double()
    finite = x.detach()[torch.isfinite(x)]
    x = torch.nan_to_num(x, neginf=float(finite.min()) - 1e4 if finite.numel() else 0.0)
    x = x - x.detach().amax(-1, keepdim=True)
    if alpha == 2.0:
        return entmax.sparsemax(x, -1)
    if alpha == 1.5:
        return entmax.entmax15(x, -1)
    return entmax.entmax_bisect(x, alpha, -1, n_iter=100)  # bisection to float64's resolution


def entmax_tolerance(alpha: float, dtype: torch.dtype) -> float:
    """TOLERANCE, plus for alpha > 2 what rounding alone may cost any implementation.

    There the weight ``d^(1 / (alpha - 1))`` of a score ``d`` above the threshold has
    an infinite slope at ``d = 0``: rounding such a score by epsilon (scores near the
    threshold are within 1 of the shifted maximum) moves the mass, so every weight,
    by up to ``epsilon^(1 / (alpha - 1))``.  Fixed-seed tests keep the plain tolerance.
    """
    if alpha <= 2:
        return TOLERANCE[dtype]
    return TOLERANCE[dtype] + torch.finfo(dtype).eps ** (1 / (alpha - 1))


def topk_reference(x: Tensor, k: int | Tensor, scale: float | Tensor) -> Tensor:
    """Softmax of ``scale * x`` over the ``k`` largest finite scores of each row (all of
    them when fewer), in float64; a stable sort ranks tied scores in index order."""
    x = x.double()
    order = x.sort(dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(x.shape[-1]).expand_as(order))
    keep = (rank < k) & (x > -math.inf)
    return torch.softmax((x * scale).masked_fill(~keep, -math.inf), -1)


def self_adjusted_reference(x: Tensor, normalized: bool) -> Tensor:
    return reference.self_adjusted_softmax_rows(x.double(), None, normalized=normalized)


# name -> (native forward (x, out) -> (weights, bad), float64 reference x -> weights)
FORWARD = {
    "softmax": (lambda x, out: native.softmax_forward(x, 0.7, out=out), lambda x: softmax_reference(x, 0.7)),
    "entmax1.3": (lambda x, out: native.entmax_forward(x, 1.3, out=out), lambda x: entmax_reference(x, 1.3)),
    "entmax1.5": (lambda x, out: native.entmax_forward(x, 1.5, out=out), lambda x: entmax_reference(x, 1.5)),
    "sparsemax": (lambda x, out: native.entmax_forward(x, 2.0, out=out), lambda x: entmax_reference(x, 2.0)),
    "entmax4": (lambda x, out: native.entmax_forward(x, 4.0, out=out), lambda x: entmax_reference(x, 4.0)),
    "topk": (lambda x, out: native.topk_forward(x, 20, 0.7, out=out), lambda x: topk_reference(x, 20, 0.7)),
    "self-adjusted": (
        lambda x, out: native.self_adjusted_forward(x, True, out=out)[:2],
        lambda x: self_adjusted_reference(x, True),
    ),
}


def test_the_library_builds_and_loads():
    info = native.build_info()
    assert info["available"], info.get("reason")
    assert os.path.isfile(info["path"])


# name, native forward (x, value, out) -> (weights, bad), float64 reference (x, value), values
GRID = [
    ("softmax", lambda x, scale, out: native.softmax_forward(x, scale, out=out), softmax_reference, [1.0, 0.37, 0.01]),
    ("entmax", lambda x, alpha, out: native.entmax_forward(x, alpha, out=out), entmax_reference, ALPHAS),
    (
        "topk",
        lambda x, k, out: native.topk_forward(x, k, 0.8, out=out),
        lambda x, k: topk_reference(x, k, 0.8),
        [1, 5, 64, 2500],
    ),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize(
    "forward, reference, value",
    [
        pytest.param(forward, reference, value, id=f"{name}-{value}")
        for name, forward, reference, values in GRID
        for value in values
    ],
)
def test_forward(forward, reference, value, length, dtype):
    x = scores(length, dtype)
    out, bad = forward(x, value, poisoned(x))
    assert not bad.any()
    assert_weights(out, reference(x, value), dtype)


@pytest.mark.parametrize("length", [7, 300, 1000])
def test_entmax_alpha_gradient_per_row(length):
    # Against the entmax package's own alpha derivative (autograd of entmax_bisect,
    # float64), with a different alpha in every row, 1.5 and 2 (closed-form kernels) included.
    x = scores(length, torch.float64, seed=14)
    alphas = torch.tensor([1.3, 1.5, 1.7, 2.0, 2.5, 1.1], dtype=torch.float64).unsqueeze(-1)
    alpha = alphas.clone().requires_grad_(True)
    weights = entmax.entmax_bisect(x, alpha, dim=-1, n_iter=100)
    grad = grad_outputs(x)
    (expected,) = torch.autograd.grad(weights, alpha, grad)
    out, _ = native.entmax_forward(x, alphas)
    _, got = native.entmax_backward_with_alpha(out, grad, alphas)
    torch.testing.assert_close(got.unsqueeze(-1), expected, atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("normalized", [True, False], ids=["normalized", "plain"])
def test_self_adjusted_forward(normalized, length, dtype):
    x = scores(length, dtype)
    out, bad, _ = native.self_adjusted_forward(x, normalized, out=poisoned(x))
    assert not bad.any()
    # Plain SA-Softmax weighs by the scores themselves: relative tolerance too.
    expected = self_adjusted_reference(x, normalized)
    torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_per_row_parameters_broadcast(dtype):
    x = scores(1000, dtype).reshape(2, 3, 1000)  # (batch, head, L)
    scale = torch.tensor([0.5, 1.0, 3.0], dtype=dtype).reshape(3, 1)  # one per head
    out, bad = native.softmax_forward(x, scale, out=poisoned(x))
    assert not bad.any()
    assert_weights(out, softmax_reference(x, scale), dtype)

    # Every entmax kernel (sparsemax, 1.5, general) in one call; compared row by row.
    alpha = torch.tensor([[1.05, 1.5, 2.0], [1.3, 2.5, 4.0]], dtype=dtype).unsqueeze(-1)
    out, bad = native.entmax_forward(x, alpha, out=poisoned(x))
    assert not bad.any()
    rows = zip(x.reshape(6, -1), alpha.flatten(), strict=True)
    expected = torch.stack([entmax_reference(row, float(a)) for row, a in rows])
    assert_weights(out, expected.reshape(x.shape), dtype)

    k = torch.tensor([[1, 5, 64], [300, 2000, 1]]).unsqueeze(-1)
    out, bad = native.topk_forward(x, k, scale, out=poisoned(x))
    assert not bad.any()
    assert_weights(out, topk_reference(x, k, scale), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("length", [7, 1000, 9000])
@pytest.mark.parametrize("name", FORWARD)
def test_negative_infinity_is_masked(name, length, dtype):
    forward, reference = FORWARD[name]
    x = scores(length, dtype, seed=1)
    masked = torch.rand(x.shape, generator=torch.Generator().manual_seed(2)) < 0.4
    masked[:, 0] = False
    masked[0, 1:] = True  # a single allowed score
    x[masked] = -math.inf
    out, bad = forward(x, poisoned(x))
    assert not bad.any()
    assert (out[masked] == 0).all()
    assert_weights(out, reference(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", FORWARD)
def test_rows_for_the_reference_are_flagged_and_zero(name, dtype):
    forward, reference = FORWARD[name]
    x = scores(300, dtype, seed=3)
    x[0] = -math.inf  # fully masked
    x[1, 5] = math.inf
    x[2, 7] = math.nan
    x[3, 9:] = -math.inf  # partly masked: an ordinary row
    out, bad = forward(x, poisoned(x))
    assert bad.tolist() == [True, True, True, False, False, False]
    assert (out[bad] == 0).all()
    assert_weights(out[~bad], reference(x[~bad]), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_softmax_flags_rows_whose_scaled_scores_overflow(dtype):
    x = scores(300, dtype, seed=4)
    x[0, 3] = torch.finfo(dtype).max / 4  # times 10 overflows
    out, bad = native.softmax_forward(x, 10.0, out=poisoned(x))
    assert bad.tolist() == [True] + [False] * 5
    assert (out[0] == 0).all()
    assert_weights(out[1:], softmax_reference(x[1:], 10.0), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("length", [7, 300, 4096])
def test_topk_keeps_every_finite_score_when_fewer_than_k(length, dtype):
    x = scores(length, dtype, seed=5)
    finite_count = torch.tensor([1, 2, 3, 5, 6, 7]).clamp_max(length)
    order = torch.rand(x.shape, generator=torch.Generator().manual_seed(6)).argsort(-1)
    masked = torch.empty_like(order).scatter_(-1, order, torch.arange(length).expand_as(order)) >= finite_count[:, None]
    x[masked] = -math.inf
    out, bad = native.topk_forward(x, 8, 0.5, out=poisoned(x))  # 0.5: no weight underflows
    assert not bad.any()
    assert torch.equal(out > 0, ~masked)
    assert_weights(out, softmax_reference(x, 0.5), dtype)


def tie_support(x: Tensor, k: int) -> Tensor:
    """What top-k keeps: the scores above the k-th largest finite one, then the scores
    equal to it in index order until k are kept."""
    keep = torch.zeros(x.shape, dtype=torch.bool)
    for kept, row in zip(keep, x, strict=True):
        finite = row[row > -math.inf]
        count = min(k, len(finite))
        if count == 0:
            continue
        kth = finite.sort(descending=True).values[count - 1]
        above = row > kth
        kept[above] = True
        kept[(row == kth).nonzero().flatten()[: count - int(above.sum())]] = True
    return keep


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("length", [7, 300, 1000, 4096, 9000])
@pytest.mark.parametrize("k", [1, 3, 100, 2000])
def test_topk_keeps_ties_in_index_order(k, length, dtype):
    generator = torch.Generator().manual_seed(length + k)
    x = torch.randint(0, 6, (4, length), generator=generator).to(dtype)  # every value tied many times
    x[1] = 2.0  # nothing but ties
    x[2, ::3] = -math.inf
    x[3, length // 2 :] = 5.0  # ties at the maximum, after lower scores
    out, bad = native.topk_forward(x, k, 1.0, out=poisoned(x))
    assert not bad.any()
    keep = tie_support(x, k)
    assert torch.equal(out > 0, keep)
    assert_weights(out, softmax_reference(x.masked_fill(~keep, -math.inf), 1.0), dtype)


@pytest.mark.parametrize("length", [7, 1000, 9000])
@pytest.mark.parametrize("name", FORWARD)
def test_large_offsets_lose_nothing_beyond_rounding(name, length):
    # float32 scores near 3e4 are 2e-3 apart; subtracting the row maximum is exact.
    forward, reference = FORWARD[name]
    x = (scores(length, torch.float64, seed=7) + 3e4).float()
    out, bad = forward(x, poisoned(x))
    assert not bad.any()
    assert_weights(out, reference(x), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("length", [1, 7, 1000, 9000])
@pytest.mark.parametrize("name", FORWARD)
def test_in_place(name, length, dtype):
    forward, reference = FORWARD[name]
    x = scores(length, dtype, seed=8)
    x[0, 1::3] = -math.inf
    expected, _ = forward(x, poisoned(x))
    buffer = x.clone()
    out, bad = forward(buffer, buffer)
    assert out.data_ptr() == buffer.data_ptr()
    assert not bad.any()
    assert torch.equal(out, expected)
    assert_weights(out, reference(x), dtype)


@pytest.mark.parametrize("name", FORWARD)
def test_results_do_not_depend_on_the_thread_count(name):
    forward, _ = FORWARD[name]
    x = scores(4096, torch.float32, seed=9).repeat(5, 1)  # 30 rows, split unevenly over 4 threads
    threads = torch.get_num_threads()
    try:
        results = []
        for count in (1, 4):
            torch.set_num_threads(count)
            results.append(forward(x, poisoned(x)))
    finally:
        torch.set_num_threads(threads)
    (single, single_bad), (several, several_bad) = results
    assert torch.equal(single, several)
    assert torch.equal(single_bad, several_bad)


def grad_outputs(like: Tensor, seed: int = 10) -> Tensor:
    return torch.randn(like.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("scale", [1.0, 0.37, "per-row"])
def test_softmax_backward(scale, length, dtype):
    x = scores(length, torch.float64, seed=11)
    x[0, 1::4] = -math.inf
    x.requires_grad_(True)
    if scale == "per-row":
        scale = torch.linspace(0.2, 3.0, len(x), dtype=torch.float64).unsqueeze(-1)
    weights = softmax_reference(x, scale)
    grad = grad_outputs(x)
    (expected,) = torch.autograd.grad(weights, x, grad)
    got = native.softmax_backward(weights.detach().to(dtype), grad.to(dtype), scale)
    torch.testing.assert_close(got.double(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("alpha", ALPHAS)
def test_entmax_backward(alpha, length, dtype):
    x = scores(length, torch.float64, seed=12)
    x[0, 1::4] = -math.inf
    x.requires_grad_(True)
    weights = entmax_reference(x, alpha)
    grad = grad_outputs(x)
    (expected,) = torch.autograd.grad(weights, x, grad)
    got = native.entmax_backward(weights.detach().to(dtype), grad.to(dtype), alpha)
    # The Jacobian is diag(s) - s s^T / sum(s) with s = weights^(2 - alpha) on the
    # support: for alpha > 2 its entries exceed 1 on small weights, and the
    # cancellation in s * (grad - mean) costs epsilon * max(s) in any implementation.
    largest_slope = float(weights.detach()[weights > 0].pow(2 - alpha).max())
    tolerance = TOLERANCE[dtype] * max(1.0, largest_slope)
    torch.testing.assert_close(got.double(), expected, atol=tolerance, rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("normalized", [True, False], ids=["normalized", "plain"])
def test_self_adjusted_backward(normalized, length, dtype):
    x = scores(length, dtype, seed=16)
    x[0, 1::4] = -math.inf
    x[1] = x[1].round().clamp(-1, 1)  # tied minima and maxima share the gradient through low and high
    x[2] = x[2].abs()  # low is 0, not a score
    x[3] = -x[3].abs()  # high is 0, not a score
    scores64 = x.double().requires_grad_(True)
    grad = grad_outputs(x)
    (expected,) = torch.autograd.grad(self_adjusted_reference(scores64, normalized), scores64, grad)
    _, bad, stats = native.self_adjusted_forward(x, normalized)
    assert not bad.any()
    got = native.self_adjusted_backward(x, grad.to(dtype), normalized, stats)
    torch.testing.assert_close(got.double(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("normalized", [True, False], ids=["normalized", "plain"])
def test_self_adjusted_backward_is_zero_on_flagged_rows(normalized):
    x = scores(300, torch.float64, seed=17)
    x[0] = -math.inf
    x[1, 5] = math.inf
    x[2, 7] = math.nan
    _, bad, stats = native.self_adjusted_forward(x, normalized)
    assert bad.tolist() == [True, True, True, False, False, False]
    got = native.self_adjusted_backward(x, grad_outputs(x), normalized, stats)
    assert (got[:3] == 0).all()
    assert torch.isfinite(got[3:]).all()


# name -> public autograd Function of x (..., L) and keep (..., L), returning the weights
PUBLIC = {
    "softmax": lambda x, keep: cpu_native.scaled_softmax(x, 0.7, keep)[0],
    "softmax-per-row": lambda x, keep: cpu_native.scaled_softmax(x, torch.tensor([[0.5], [2.0]]).double(), keep)[0],
    "sparsemax": lambda x, keep: cpu_native.entmax_support(x, keep, 2.0)[0],
    "entmax1.3": lambda x, keep: cpu_native.entmax_support(x, keep, 1.3)[0],
    "entmax1.5": lambda x, keep: cpu_native.entmax_support(x, keep, 1.5)[0],
    "entmax4": lambda x, keep: cpu_native.entmax_support(x, keep, 4.0)[0],
    "entmax-per-row": lambda x, keep: cpu_native.entmax_support(x, keep, torch.tensor([[1.2], [2.5]]).double())[0],
    "topk": lambda x, keep: cpu_native.topk_support(x, keep, 3, 0.8, None)[0],
    "topk-fraction": lambda x, keep: cpu_native.topk_support(x, keep, 0.5, 0.8, keep.sum(-1, keepdim=True))[0],
    "self-adjusted": lambda x, keep: cpu_native.self_adjusted_softmax(x, keep, True)[0],
    "self-adjusted-plain": lambda x, keep: cpu_native.self_adjusted_softmax(x, keep, False)[0],
}


@pytest.mark.parametrize("name", PUBLIC)
def test_public_functions_pass_gradcheck(name):
    generator = torch.Generator().manual_seed(13)
    x = (torch.randn(2, 9, dtype=torch.float64, generator=generator) * 2).requires_grad_(True)
    keep = torch.rand(2, 9, generator=generator) > 0.3
    keep[:, 0] = True
    function = PUBLIC[name]
    assert gradcheck(function, (x, keep))
    assert gradgradcheck(function, (x, keep))  # create_graph: the torch formula of the same Jacobian


PUBLIC_FORWARD = {
    "softmax": (lambda x, keep: cpu_native.scaled_softmax(x, 0.7, keep), lambda x: softmax_reference(x, 0.7)),
    "entmax1.3": (lambda x, keep: cpu_native.entmax_support(x, keep, 1.3), lambda x: entmax_reference(x, 1.3)),
    "topk": (lambda x, keep: cpu_native.topk_support(x, keep, 20, 0.7, None), lambda x: topk_reference(x, 20, 0.7)),
    "self-adjusted": (
        lambda x, keep: cpu_native.self_adjusted_softmax(x, keep, True),
        lambda x: self_adjusted_reference(x, True),
    ),
}


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("with_keep", [False, True], ids=["no-keep", "keep"])
@pytest.mark.parametrize("name", PUBLIC_FORWARD)
def test_public_functions_apply_keep_and_leave_the_input_alone(name, with_keep, layout):
    # The kernels may write over their input: only a copy of x may serve as their output.
    function, reference = PUBLIC_FORWARD[name]
    x = scores(300, torch.float32, seed=14)
    if layout == "transposed":
        x = x.t().contiguous().t()
    keep = torch.rand(x.shape, generator=torch.Generator().manual_seed(15)) > 0.3 if with_keep else None
    original = x.clone()
    out, bad = function(x, keep)
    assert torch.equal(x, original)
    assert not bad.any()
    assert_weights(out, reference(x if keep is None else x.masked_fill(~keep, -math.inf)), torch.float32)


@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(1, 4),
    length=st.integers(1, 10_000),
    alpha=st.one_of(st.sampled_from(ALPHAS), st.floats(1.05, 4.0)),
    spread=st.floats(1e-3, 100.0),
    masked_share=st.floats(0.0, 0.95),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**31 - 1),
)
# Found by this test: Halley steps that stalled far from the threshold (near-uniform rows, alpha 4).
@example(rows=1, length=2727, alpha=4.0, spread=0.03125, masked_share=0.0, dtype=torch.float32, seed=0)
def test_entmax_rows_are_distributions_matching_the_reference(rows, length, alpha, spread, masked_share, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, length, generator=generator, dtype=torch.float64) * spread).to(dtype)
    masked = torch.rand(rows, length, generator=generator) < masked_share
    masked[:, torch.randint(length, (1,), generator=generator)] = False
    x[masked] = -math.inf
    out, bad = native.entmax_forward(x, alpha, out=poisoned(x))
    assert not bad.any()
    assert (out >= 0).all()
    assert (out[masked] == 0).all()
    sums = out.double().sum(-1)
    torch.testing.assert_close(sums, torch.ones(rows, dtype=torch.float64), atol=TOLERANCE[dtype], rtol=0)
    tolerance = entmax_tolerance(alpha, dtype)
    torch.testing.assert_close(out.double(), entmax_reference(x, alpha), atol=tolerance, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("length", [7, 300])
@pytest.mark.parametrize("alpha", ALPHAS)
def test_entmax_forward_on_many_near_uniform_rows(alpha, length, dtype):
    # Near-uniform rows put many scores close to the threshold: a wrong one shows.
    generator = torch.Generator().manual_seed(18)
    x = (torch.randn(140_000 // length, length, generator=generator, dtype=torch.float64) * 0.01).to(dtype)
    out, bad = native.entmax_forward(x, alpha, out=poisoned(x))
    assert not bad.any()
    tolerance = entmax_tolerance(alpha, dtype)
    torch.testing.assert_close(out.double(), entmax_reference(x, alpha), atol=tolerance, rtol=0)
