"""The rules every normalizer shares (attnorm.normalizers.base), checked for every normalizer.

Masks (bool, broadcastable, True = may attend; -inf counts as masked; masked positions
get weight 0 and gradient 0; fully masked rows give zeros), +inf and NaN scores, any
``dim``, dtypes, float64 gradients.  Expected values come from the float64 references in
``tests/normalizers/references.py`` applied to the allowed positions alone.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from normalizers.references import CASES, Case, reference_masked
from torch.autograd import gradcheck, gradgradcheck

import attnorm
from tests.conftest import DEVICE

TRITON = importlib.util.find_spec("triton") is not None
APIS = ("module", "functional")


def apply(case: Case, api: str, x: torch.Tensor, dim: int = -1, mask=None) -> torch.Tensor:
    if api == "module":
        return case.build(dim=dim)(x, mask=mask)
    return case.functional(x, dim=dim, mask=mask)


def random_scores(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (2 * torch.randn(*shape, generator=generator, dtype=torch.float64)).to(dtype)


def random_mask(*shape: int, seed: int = 1) -> torch.Tensor:
    """About 60% allowed, with one fully masked row and one fully allowed row."""
    generator = torch.Generator().manual_seed(seed)
    mask = torch.rand(*shape, generator=generator) < 0.6
    mask.view(-1, shape[-1])[0] = False
    mask.view(-1, shape[-1])[-1] = True
    return mask


@pytest.fixture(params=CASES, ids=str)
def case(request) -> Case:
    return request.param


# ---------------------------------------------------------------- masks


@pytest.mark.parametrize("api", APIS)
def test_mask_result_equals_normalizer_on_allowed_positions_alone(case, api):
    x = random_scores(2, 3, 4, 7)
    mask = random_mask(2, 3, 4, 7)
    out = apply(case, api, x, mask=mask)
    torch.testing.assert_close(out, reference_masked(case, x, mask), rtol=1e-9, atol=1e-12)
    assert (out[~mask] == 0).all()
    assert (out.view(-1, 7)[0] == 0).all()


@pytest.mark.parametrize("mask_shape", [(7,), (4, 7), (2, 1, 1, 7), (1, 3, 4, 1), (3, 1, 7)])
def test_broadcast_mask_equals_expanded_mask(case, mask_shape):
    x = random_scores(2, 3, 4, 7)
    mask = random_mask(*mask_shape)
    out = case.build()(x, mask=mask)
    torch.testing.assert_close(out, case.build()(x, mask=mask.expand(x.shape).clone()), rtol=0, atol=0)
    torch.testing.assert_close(out, reference_masked(case, x, mask), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("api", APIS)
def test_neg_inf_scores_count_as_masked(case, api):
    x = random_scores(3, 5, 6)
    mask = random_mask(3, 5, 6)
    with_neg_inf = x.masked_fill(~mask, -math.inf)
    expected = reference_masked(case, x, mask)
    torch.testing.assert_close(apply(case, api, with_neg_inf), expected, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(apply(case, api, with_neg_inf, mask=mask), expected, rtol=1e-9, atol=1e-12)


def test_masked_positions_and_masked_rows_get_zero_gradient(case):
    x = random_scores(2, 4, 6)
    mask = random_mask(2, 4, 6)
    x = x.masked_fill(torch.rand(x.shape, generator=torch.Generator().manual_seed(5)) < 0.15, -math.inf)
    x.requires_grad_(True)
    allowed = mask & (x != -math.inf)
    out = case.build()(x, mask=mask)
    upstream = random_scores(2, 4, 6, seed=3)
    (grad,) = torch.autograd.grad(out, x, upstream)
    assert torch.isfinite(out).all() and torch.isfinite(grad).all()
    assert (out[~allowed] == 0).all()
    assert (grad[~allowed] == 0).all()
    assert (grad.view(-1, 6)[0] == 0).all()


def test_structured_masks_equal_their_bool_masks(case):
    batch, heads, queries, keys = 2, 3, 5, 7
    x = random_scores(batch, heads, queries, keys)
    lengths = torch.tensor([4, 7])
    causal = torch.ones(queries, keys, dtype=torch.bool).tril(keys - queries)  # bottom-right aligned
    padding = (torch.arange(keys) < lengths[:, None]).reshape(batch, 1, 1, keys)
    module = case.build()
    structured = attnorm.causal_mask(keys - queries) & attnorm.key_padding_mask(lengths)
    torch.testing.assert_close(module(x, mask=structured), module(x, mask=causal & padding), rtol=0, atol=0)
    torch.testing.assert_close(module(x, mask=structured), reference_masked(case, x, causal & padding))
    top_left = torch.ones(queries, keys, dtype=torch.bool).tril()
    torch.testing.assert_close(module(x, mask=attnorm.causal_mask()), reference_masked(case, x, top_left))


# ---------------------------------------------------------------- +inf and NaN


def test_posinf_row_is_uniform_over_its_posinf_positions(case):
    x = torch.tensor(
        [
            [1.0, math.inf, -2.0, math.inf, 0.5, -math.inf],
            [1.0, math.inf, -2.0, math.inf, 0.5, math.inf],  # the last +inf is masked below
            [1.0, 3.0, -2.0, 0.0, 0.5, -1.0],
        ],
        dtype=torch.float64,
        requires_grad=True,
    )
    mask = torch.tensor([True] * 5 + [False])
    out = case.build()(x, mask=mask)
    on_posinf = torch.tensor([0, 1, 0, 1, 0, 0], dtype=torch.bool)
    plain_sa = case.name == "sa_softmax_plain"  # x * softmax(x): the +inf positions get +inf
    expected = torch.where(on_posinf, math.inf if plain_sa else 0.5, 0.0).double()
    torch.testing.assert_close(out[:2], torch.stack([expected, expected]))
    torch.testing.assert_close(out[2], reference_masked(case, x[2:].detach(), mask)[0])
    (grad,) = torch.autograd.grad(out[torch.isfinite(out)].sum(), x)
    assert not grad.isnan().any()


def test_nan_in_allowed_position_propagates_and_stays_in_its_row(case):
    x = random_scores(3, 6)
    x[0, 2] = math.nan
    x[1, 4] = math.nan
    mask = torch.ones(3, 6, dtype=torch.bool)
    mask[1, 4] = False  # a masked NaN takes no part
    out = case.build()(x, mask=mask)
    assert out[0].isnan().any()
    torch.testing.assert_close(out[1], reference_masked(case, x[1:2], mask[1:2])[0])
    torch.testing.assert_close(out[2], case.reference(x[2]))


# ---------------------------------------------------------------- dim


@pytest.mark.parametrize("dim", [-4, -3, -2, -1, 0, 1, 2, 3])
@pytest.mark.parametrize("api", APIS)
def test_any_dim_negative_or_positive(case, dim, api):
    x = random_scores(2, 3, 4, 5)
    expected = case.reference(x.movedim(dim, -1)).movedim(-1, dim)
    torch.testing.assert_close(apply(case, api, x, dim=dim), expected, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("shape", [(6,), (1,), (3, 1), (2, 1, 1), (1, 2, 3, 2, 5)])
def test_any_number_of_leading_dims_and_length_one(case, shape):
    x = random_scores(*shape)
    torch.testing.assert_close(case.build()(x), case.reference(x), rtol=1e-9, atol=1e-12)


def test_zero_dim_scores_are_a_row_of_one(case):
    x = torch.tensor(-0.75, dtype=torch.float64)
    out = case.build()(x)
    assert out.shape == ()
    torch.testing.assert_close(out, case.reference(x.reshape(1))[0])


def test_masked_dim_other_than_last(case):
    x = random_scores(5, 2, 4)
    mask = random_mask(5, 1, 1)
    expected = reference_masked(case, x.movedim(0, -1), mask.movedim(0, -1)).movedim(-1, 0)
    torch.testing.assert_close(case.build(dim=0)(x, mask=mask), expected, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("shape", [(2, 0), (0, 5), (3, 0, 4)])
def test_empty_scores_give_empty_output(case, shape):
    x = torch.zeros(shape, requires_grad=True)
    out = case.build()(x)
    assert out.shape == shape and out.dtype == x.dtype
    (grad,) = torch.autograd.grad(out.sum(), x)
    assert grad.shape == shape


@pytest.mark.parametrize("dim", [3, -4])
def test_dim_out_of_range_raises(case, dim):
    with pytest.raises(IndexError, match=f"got {dim}"):
        case.build(dim=dim)(random_scores(2, 3, 4))


# ---------------------------------------------------------------- dtypes


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_is_computed_in_float32_and_returned_in_input_dtype(case, dtype):
    x = random_scores(3, 4, 9, dtype=dtype).requires_grad_(True)
    mask = random_mask(3, 4, 9)
    out = case.build()(x, mask=mask)
    assert out.dtype == dtype
    upcast = x.detach().float().requires_grad_(True)
    expected = case.build()(upcast, mask=mask)
    torch.testing.assert_close(out, expected.to(dtype), rtol=0, atol=0)
    upstream = random_scores(3, 4, 9, seed=7, dtype=dtype)
    (grad,) = torch.autograd.grad(out, x, upstream)
    (expected_grad,) = torch.autograd.grad(expected, upcast, upstream.float())
    assert grad.dtype == dtype
    # The backward reads the saved half-precision output (as torch.softmax's does): a few ulps.
    ulps = 4 * torch.finfo(dtype).eps
    torch.testing.assert_close(grad, expected_grad.to(dtype), rtol=ulps, atol=ulps)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_float32_and_float64_keep_their_dtype(case, dtype):
    x = random_scores(4, 8, dtype=dtype)
    out = case.build()(x)
    assert out.dtype == dtype
    tolerance = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-10, "atol": 1e-12}
    torch.testing.assert_close(out.double(), case.reference(x), **tolerance)


def test_float16_extremes_give_no_nan(case):
    # bfloat16's range is float32's: scores near 3.4e38 overflow float32 arithmetic and are not covered.
    dtype = torch.float16
    info = torch.finfo(dtype)
    x = torch.tensor(
        [
            [info.max, -info.max, 0.0, 1.0],
            [info.max, info.max, -info.max, 0.0],
            [info.smallest_normal, -info.smallest_normal, info.tiny / 4, 0.0],
            [-info.max, -info.max, -info.max, -info.max],
        ],
        dtype=dtype,
        requires_grad=True,
    )
    out = case.build()(x)
    (grad,) = torch.autograd.grad(out, x, torch.ones_like(out))
    assert not out.isnan().any() and not grad.isnan().any()
    if case.build().sums_to_one:
        torch.testing.assert_close(out.float().sum(-1), torch.ones(4), rtol=0, atol=2e-3)
    torch.testing.assert_close(out, case.build()(x.detach().float()).to(dtype), rtol=0, atol=0)


# ---------------------------------------------------------------- properties


# Distinct multiples of 1/20: no ties (top-k's choice among ties is arbitrary) and
# exact differences after a shift, so the expected outputs are unambiguous.
distinct_rows = st.lists(st.integers(-1000, 1000), min_size=1, max_size=40, unique=True).map(
    lambda integers: torch.tensor(integers, dtype=torch.float64) / 20
)


@settings(max_examples=30, deadline=None)
@given(x=distinct_rows)
def test_weights_are_nonnegative_rows_sum_to_one_and_match_the_reference(x):
    for case in CASES:
        out = case.build()(x)
        if case.nonnegative:
            assert (out >= 0).all(), case
        if case.build().sums_to_one:
            torch.testing.assert_close(out.sum(), torch.tensor(1.0, dtype=torch.float64), rtol=0, atol=1e-12)
        torch.testing.assert_close(out, case.reference(x), rtol=1e-8, atol=1e-10, msg=str(case))


@settings(max_examples=30, deadline=None)
@given(x=distinct_rows, shift=st.floats(-1e3, 1e3))
def test_adding_a_constant_to_a_row_changes_nothing(x, shift):
    for case in CASES:
        if case.shift_invariant:
            torch.testing.assert_close(case.build()(x + shift), case.build()(x), rtol=0, atol=1e-9, msg=str(case))


@pytest.mark.parametrize("case", [case for case in CASES if case.shift_invariant], ids=str)
def test_large_offsets_in_float64(case):
    x = random_scores(4, 50)
    for offset in (1e3, 1e4, 3e4):
        torch.testing.assert_close(case.build()(x + offset), case.reference(x), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("case", [case for case in CASES if case.sparse], ids=str)
def test_large_offsets_in_float32_for_sparse_maps(case):
    # Exact to float32 rounding of the (shifted) inputs themselves.  Softmax with T != 1 and
    # SSMax are left out: they scale the logits before normalising, as torch.softmax(x / T)
    # does, so a float32 offset of 3e4 costs ~offset * eps / T in every logit.
    x = random_scores(4, 50, dtype=torch.float32)
    for offset in (1e3, 1e4, 3e4):
        shifted = x + offset
        torch.testing.assert_close(case.build()(shifted).double(), case.reference(shifted), rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------- float64 gradients


def assert_support_is_stable(fn, x: torch.Tensor, radius: float = 1e-4) -> None:
    """Precondition for finite differences: no support change within ``radius`` of ``x``."""
    support = fn(x) != 0
    generator = torch.Generator().manual_seed(11)
    for _ in range(8):
        shake = radius * (2 * torch.rand(x.shape, generator=generator, dtype=x.dtype) - 1)
        assert torch.equal(fn(x + shake) != 0, support), "input too close to a kink"


def gradient_input(case: Case, *shape: int) -> torch.Tensor:
    # Evenly spread logits keep the support (and the SA min/max) away from kinks.
    generator = torch.Generator().manual_seed(2)
    count = math.prod(shape)
    values = torch.linspace(-3, 3, count, dtype=torch.float64)[torch.randperm(count, generator=generator)]
    return values.reshape(shape)


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_gradcheck_over_dims(case, dim):
    x = gradient_input(case, 3, 4, 5)
    fn = case.build(dim=dim)
    if case.sparse:
        assert_support_is_stable(fn, x)
    assert gradcheck(fn, (x.requires_grad_(True),))


def test_gradcheck_with_mask(case):
    x = gradient_input(case, 3, 2, 6)
    mask = random_mask(3, 2, 6)
    fn = lambda scores: case.build()(scores, mask=mask)
    if case.sparse:
        assert_support_is_stable(fn, x)
    assert gradcheck(fn, (x.requires_grad_(True),))


def test_gradgradcheck(case):
    x = gradient_input(case, 2, 6)
    fn = case.build()
    if case.sparse:
        assert_support_is_stable(fn, x)
    assert gradgradcheck(fn, (x.requires_grad_(True),))


# ---------------------------------------------------------------- NaN rows: NaN gradients

_NAN_ROW_BACKENDS = ["reference"] + ["native"] * (DEVICE == "cpu") + ["triton"] * TRITON
_LEARNABLE = {  # a functional form with a per-row tensor parameter (None: none), and its value
    "softmax": (lambda x, p, **kw: attnorm.functional.softmax(x, temperature=p, **kw), 0.7),
    "scalable_softmax": (lambda x, p, **kw: attnorm.functional.scalable_softmax(x, s=p, **kw), 0.5),
    "topk_softmax": (lambda x, p, **kw: attnorm.functional.topk_softmax(x, k=3, temperature=p, **kw), 1.1),
    "entmax_1.3": (lambda x, p, **kw: attnorm.functional.entmax(x, alpha=p, **kw), 1.3),
    "entmax_1.5": (lambda x, p, **kw: attnorm.functional.entmax(x, alpha=p, **kw), 1.5),
    "sparsemax": (lambda x, p, **kw: attnorm.functional.sparsemax(x, **kw), None),
    "self_adjusted": (lambda x, p, **kw: attnorm.functional.self_adjusted_softmax(x, **kw), None),
    "self_adjusted_normalized": (
        lambda x, p, **kw: attnorm.functional.self_adjusted_softmax(x, normalized=True, **kw), None),
}


@pytest.mark.parametrize("with_sink", [False, True], ids=["", "sink"])
@pytest.mark.parametrize("backend", _NAN_ROW_BACKENDS)
@pytest.mark.parametrize("name", list(_LEARNABLE))
def test_a_row_holding_nan_gets_nan_gradients_and_the_others_none(name, backend, with_sink):
    """As torch.softmax: every score of the row, its parameter and its sink get NaN; other rows stay finite.

    The upstream gradient is 0 on the NaN row's outputs, as when a loss leaves them out.
    """
    function, value = _LEARNABLE[name]
    x = random_scores(3, 8, seed=5).to(DEVICE)
    x[1, 3] = math.nan
    x.requires_grad_()
    mask = torch.ones(3, 8, dtype=torch.bool, device=DEVICE)
    mask[1, 6] = False  # a masked position: NaN too, like its weight
    param = None if value is None else torch.full((3, 1), value, dtype=x.dtype, device=DEVICE, requires_grad=True)
    sink = torch.full((3, 1), 0.3, dtype=x.dtype, device=DEVICE, requires_grad=True) if with_sink else None
    y = function(x, param, mask=mask, backend=backend, sink=sink)
    assert y[1].isnan().all() and not y[[0, 2]].isnan().any()
    weights = torch.arange(8.0, dtype=x.dtype, device=DEVICE).expand(3, 8).clone()
    weights[1] = 0
    (torch.where(y.isnan(), 0.0, y) * weights).sum().backward()
    assert x.grad[1].isnan().all()
    assert not x.grad[[0, 2]].isnan().any()
    for leaf in (param, sink):
        if leaf is not None:
            assert leaf.grad[1].isnan().all() and not leaf.grad[[0, 2]].isnan().any(), leaf.shape


@pytest.mark.parametrize("backend", _NAN_ROW_BACKENDS)
@pytest.mark.parametrize("name", list(_LEARNABLE))
def test_a_masked_nan_or_inf_takes_no_part_under_a_cap(name, backend):
    """With ``softcap``, a NaN or +inf score at a masked position changes nothing and gets gradient 0: the
    reference capped it before masking, and the cap's slope at NaN carried NaN back to it."""
    function, value = _LEARNABLE[name]
    x = random_scores(3, 8, seed=6).to(DEVICE)
    mask = torch.ones(3, 8, dtype=torch.bool, device=DEVICE)
    mask[0, 2] = mask[1, 5] = mask[2, 0] = False
    poisoned = x.clone()
    poisoned[0, 2], poisoned[1, 5], poisoned[2, 0] = math.nan, math.inf, -math.inf
    weights = torch.arange(8.0, dtype=x.dtype, device=DEVICE).expand(3, 8)
    results = []
    for scores in (x, poisoned):
        scores = scores.clone().requires_grad_()
        param = None if value is None else torch.full((3, 1), value, dtype=x.dtype, device=DEVICE, requires_grad=True)
        y = function(scores, param, mask=mask, backend=backend, softcap=4.0)
        grads = torch.autograd.grad((y * weights).sum(), [scores] + ([] if param is None else [param]))
        results.append((y, *grads))
    for clean, dirty in zip(*results, strict=True):
        torch.testing.assert_close(dirty, clean, rtol=0, atol=0)
    assert (results[1][1][~mask] == 0).all()
