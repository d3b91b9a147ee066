"""attnorm.attention against float64 references built from the formulas.

The reference computes ``scale * q k^T (+ additive mask)`` in float64, applies each
normalizer's independent reference (``tests/normalizers/references.py``: torch.softmax,
the ``entmax`` package, explicit top-k) to the allowed keys of every row, and
multiplies by ``v``.  Both routes of :func:`attnorm.attention` are checked: the
logit-scaling SDPA route (softmax, Scalable-Softmax), also with tiny row blocks so
that blocking, the banded causal masks and the output assembly are exercised, and
the materialised route (every other normalizer, ``return_weights=True``).
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from normalizers.references import CASES, Case, reference_masked, scalable_softmax_reference, topk_count
from torch.profiler import ProfilerActivity, profile

import attnorm
from attnorm import causal_mask, key_padding_mask

B, H, D = 2, 3, 8


def qkv(lq: int, lk: int, dtype=torch.float64, heads: int = H, kv_heads: int = H, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(B, heads, lq, D, generator=generator, dtype=dtype)
    k = torch.randn(B, kv_heads, lk, D, generator=generator, dtype=dtype)
    v = torch.randn(B, kv_heads, lk, D + 2, generator=generator, dtype=dtype)
    return q, k, v


def reference_attention(case: Case, q, k, v, allowed, additive=None, scale=None):
    """Float64 ``reference(scale q k^T + additive on allowed keys) @ v`` and the weights."""
    q, k, v = q.double(), k.double(), v.double()
    if q.ndim >= 3:
        groups = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(groups, dim=-3), v.repeat_interleave(groups, dim=-3)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = q @ k.transpose(-2, -1) * scale
    allowed = allowed.expand(scores.shape)
    if additive is not None:
        allowed = allowed & (additive != -math.inf)
        scores = scores + additive.double().masked_fill(additive == -math.inf, 0.0)
    weights = reference_masked(case, scores, allowed)
    return weights @ v, weights


def allowed_of(lq: int, lk: int, diagonal: int | None = None, lengths: list[int] | None = None):
    allowed = torch.ones(lq, lk, dtype=torch.bool)
    if diagonal is not None:
        allowed = allowed.tril(diagonal)
    if lengths is not None:
        allowed = allowed & (torch.arange(lk) < torch.tensor(lengths)[:, None, None, None])
    return allowed


def window_of(lq: int, lk: int, window: int, diagonal: int) -> torch.Tensor:
    """Query i attends keys i + diagonal - window < j <= i + diagonal."""
    return torch.tensor([[i + diagonal - window < j <= i + diagonal for j in range(lk)] for i in range(lq)])


def documents_of(length: int, bounds: list[int]) -> torch.Tensor:
    """Positions attend positions of their own document (positions past the last bound: one more document)."""
    document = [sum(position >= bound for bound in bounds) for position in range(length)]
    return torch.tensor([[document[i] == document[j] for j in range(length)] for i in range(length)])


def mask_kinds(lq: int, lk: int):
    """(id, attention kwargs, allowed bool mask, additive mask) for the mask conventions."""
    generator = torch.Generator().manual_seed(1)
    random_bool = torch.rand(B, 1, lq, lk, generator=generator) > 0.4
    random_bool[0, 0, 1] = False  # one fully masked row
    additive = torch.randn(B, H, lq, lk, generator=generator, dtype=torch.float64)
    additive = additive.masked_fill(torch.rand(B, H, lq, lk, generator=generator) < 0.3, -math.inf)
    lengths = [lk, max(1, lk - 4)]
    return [
        ("none", {}, allowed_of(lq, lk), None),
        ("is_causal", {"is_causal": True}, allowed_of(lq, lk, 0), None),
        ("bool", {"attn_mask": random_bool}, random_bool, None),
        ("padding", {"attn_mask": key_padding_mask(torch.tensor(lengths))}, allowed_of(lq, lk, None, lengths), None),
        (
            "causal_bottom_right&padding",
            {"attn_mask": causal_mask(lk - lq) & key_padding_mask(torch.tensor(lengths))},
            allowed_of(lq, lk, lk - lq, lengths),
            None,
        ),
        ("causal_diag-2", {"attn_mask": causal_mask(-2)}, allowed_of(lq, lk, -2), None),
        ("causal_diag3", {"attn_mask": causal_mask(3)}, allowed_of(lq, lk, 3), None),
        ("additive", {"attn_mask": additive}, allowed_of(lq, lk), additive),
        ("window", {"attn_mask": attnorm.sliding_window_mask(3, lk - lq)}, window_of(lq, lk, 3, lk - lq), None),
    ] + ([] if lq != lk else [
        (
            "documents&causal",
            {"attn_mask": attnorm.document_mask(torch.tensor([0, 3, lq - 2])) & causal_mask()},
            documents_of(lq, [0, 3, lq - 2]) & allowed_of(lq, lk, 0),
            None,
        )
    ])


SHAPES = [(8, 8), (7, 11), (12, 5)]
FAST_CASES = [case for case in CASES if case.name.startswith(("softmax", "ssmax"))]


@pytest.fixture(params=["one_block", "tiny_blocks"])
def blocks(request):
    """Normalizers off the SDPA route run materialised (one block) or blocked, one query row per block."""
    if request.param == "tiny_blocks":
        request.getfixturevalue("force_blocked")
    return request.param


@pytest.mark.parametrize("case", FAST_CASES, ids=repr)
@pytest.mark.parametrize("lq,lk", SHAPES)
def test_sdpa_route_matches_float64_reference_under_every_mask(case, lq, lk, blocks):
    q, k, v = qkv(lq, lk)
    for name, kwargs, allowed, additive in mask_kinds(lq, lk):
        expected, _ = reference_attention(case, q, k, v, allowed, additive)
        out = attnorm.attention(q, k, v, case.build(), **kwargs)
        torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10, msg=f"mask {name}")


@pytest.mark.parametrize("case", FAST_CASES, ids=repr)
@pytest.mark.parametrize("lq,lk", SHAPES)
def test_negative_scale_matches_float64_reference_under_every_mask(case, lq, lk, blocks):
    """A negative ``scale``: SDPA's CPU kernel with ``is_causal`` gave NaN rows (its -inf mask times the scale).

    float32 and head dim 16: SDPA took its math kernel, which was right, in float64 or at head dim 8."""
    generator = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(B, H, length, 16, generator=generator) for length in (lq, lk, lk))
    q.requires_grad_()
    for name, kwargs, allowed, additive in mask_kinds(lq, lk):
        expected, _ = reference_attention(case, q.detach(), k, v, allowed, additive, scale=-0.5)
        out = attnorm.attention(q, k, v, case.build(), scale=-0.5, **kwargs)
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5, msg=f"mask {name}")
        grad, expected_grad = (torch.autograd.grad(result.square().sum(), q)[0].double() for result in (
            out, reference_attention(case, q, k, v, allowed, additive, scale=-0.5)[0]))
        torch.testing.assert_close(grad, expected_grad, rtol=1e-4, atol=1e-4, msg=f"mask {name}")


@pytest.mark.parametrize("case", CASES, ids=repr)
def test_scale_zero_gives_uniform_weights_over_allowed_keys_under_every_mask(case, blocks):
    """``scale=0``: SDPA's own kernels return NaN rows under a mask (0 x -inf); attention must not."""
    q, k, v = qkv(7, 11, seed=4)
    q.requires_grad_()
    for name, kwargs, allowed, additive in mask_kinds(7, 11):
        expected, _ = reference_attention(case, q.detach(), k, v, allowed, additive, scale=0.0)
        if case.name.startswith("topk") and additive is None:
            # Every score ties: top-k keeps the first allowed keys (lowest index wins), uniformly.
            allowed = allowed.expand(B, H, 7, 11)
            count = torch.tensor([[[[topk_count(case.build().k, int(n))] for n in row] for row in head]
                                  for head in allowed.sum(-1)])
            kept = allowed & (allowed.cumsum(-1) <= count)
            expected = (kept.double() / kept.sum(-1, keepdim=True).clamp_min(1)) @ v
        out = attnorm.attention(q, k, v, case.build(), scale=0.0, **kwargs)
        torch.testing.assert_close(out, expected, rtol=1e-9, atol=1e-9, msg=f"mask {name}")
        assert torch.autograd.grad(out.sum(), q)[0].eq(0).all(), f"mask {name}"


@pytest.mark.parametrize("case", CASES, ids=repr)
@pytest.mark.parametrize("lq,lk", [*SHAPES[:2], pytest.param(*SHAPES[2], marks=pytest.mark.slow)])  # Lq > Lk: slow
def test_materialised_and_blocked_routes_match_float64_reference_under_every_mask(case, lq, lk, blocks):
    q, k, v = qkv(lq, lk)
    for name, kwargs, allowed, additive in mask_kinds(lq, lk):
        expected, expected_weights = reference_attention(case, q, k, v, allowed, additive)
        out, weights = attnorm.attention(q, k, v, case.build(), return_weights=True, **kwargs)
        torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10, msg=f"mask {name}")
        torch.testing.assert_close(weights, expected_weights, rtol=1e-10, atol=1e-10, msg=f"weights, mask {name}")
        if case not in FAST_CASES:
            torch.testing.assert_close(attnorm.attention(q, k, v, case.build(), **kwargs), out, rtol=1e-12, atol=1e-12)


@settings(max_examples=40, deadline=None)
@given(
    lq=st.integers(1, 9),
    lk=st.integers(1, 9),
    diagonal=st.one_of(st.none(), st.integers(-10, 10)),
    lengths=st.one_of(st.none(), st.lists(st.integers(0, 9), min_size=B, max_size=B)),
)
def test_scalable_softmax_structured_masks(lq, lk, diagonal, lengths):
    """Any causal diagonal and key lengths (0 included), any block size: n counts the allowed keys."""
    if diagonal is None and lengths is None:
        diagonal = 0
    mask = causal_mask(diagonal) if diagonal is not None else None
    if lengths is not None:
        padding = key_padding_mask(torch.tensor(lengths))
        mask = padding if mask is None else mask & padding
    q, k, v = qkv(lq, lk)
    expected, _ = reference_attention(FAST_CASES[1], q, k, v, allowed_of(lq, lk, diagonal, lengths))
    out = attnorm.attention(q, k, v, FAST_CASES[1].build(), attn_mask=mask)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("case", [CASES[1], CASES[4]], ids=repr)
@pytest.mark.parametrize("is_causal", [False, True])
def test_grouped_query_attention(case, is_causal, blocks):
    q, k, v = qkv(6, 6, heads=6, kv_heads=2)
    expected, _ = reference_attention(case, q, k, v, allowed_of(6, 6, 0 if is_causal else None))
    out = attnorm.attention(q, k, v, case.build(), is_causal=is_causal)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("lengths", [None, [9, 4]], ids=["causal", "causal&padding"])
def test_per_head_learnable_scalable_softmax_gradients(lengths, blocks):
    """Gradients of q, k, v, s and bias through the SDPA route equal float64 autograd of the formula."""
    lq, lk = 7, 9
    q, k, v = (t.requires_grad_() for t in qkv(lq, lk))
    normalizer = attnorm.ScalableSoftmax(s=0.5, bias=0.2, learnable=True, num_heads=H).double()
    with torch.no_grad():
        normalizer.s.copy_(torch.tensor([0.3, 0.5, 0.9]).view(H, 1, 1))
    allowed = allowed_of(lq, lk, lk - lq, lengths).expand(B, H, lq, lk)
    cotangent = torch.randn(B, H, lq, D + 2, dtype=torch.float64)
    mask = causal_mask(lk - lq)
    if lengths is not None:
        mask = mask & key_padding_mask(torch.tensor(lengths))
    out = attnorm.attention(q, k, v, normalizer, attn_mask=mask)
    got = torch.autograd.grad((out * cotangent).sum(), (q, k, v, normalizer.s, normalizer.bias))

    s, bias = (p.detach().clone().requires_grad_() for p in (normalizer.s, normalizer.bias))
    scores = q @ k.transpose(-2, -1) / math.sqrt(D)
    multiplier = s * torch.log(allowed.sum(-1, keepdim=True).double()) + bias
    weights = torch.softmax((multiplier * scores).masked_fill(~allowed, -math.inf), dim=-1)
    expected = torch.autograd.grad(((weights @ v) * cotangent).sum(), (q, k, v, s, bias))
    for name, actual, wanted in zip(("q", "k", "v", "s", "bias"), got, expected, strict=True):
        torch.testing.assert_close(actual, wanted, rtol=1e-9, atol=1e-10, msg=name)


@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "causal"])
def test_float32_learnable_scalable_softmax_keeps_float64_attention_exact(masked):
    """A learnable module left in float32 with float64 inputs: the multiplier ``s log n + bias`` is computed in
    float64 (without a mask ``n`` was a 0-d tensor, which does not promote the float32 parameters: the logits
    carried float32 rounding, ~4e-8 relative)."""
    lq, lk = 7, 9
    q, k, v = qkv(lq, lk)
    normalizer = attnorm.ScalableSoftmax(learnable=True, num_heads=H)
    with torch.no_grad():
        normalizer.s.copy_(torch.tensor([0.3, 0.55, 0.9]).view(H, 1, 1))
        normalizer.bias.copy_(torch.tensor([0.1, -0.2, 0.3]).view(H, 1, 1))
    allowed = allowed_of(lq, lk, lk - lq if masked else None).expand(B, H, lq, lk)
    out = attnorm.attention(q, k, v, normalizer, attn_mask=causal_mask(lk - lq) if masked else None)
    s, bias = normalizer.s.detach().double(), normalizer.bias.detach().double()
    multiplier = s * torch.log(allowed.sum(-1, keepdim=True).double()) + bias
    scores = (q @ k.transpose(-2, -1) / math.sqrt(D)) * multiplier
    expected = torch.softmax(scores.masked_fill(~allowed, -math.inf), dim=-1) @ v
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


GRADIENT_MASKS = {
    "is_causal": {"is_causal": True},
    "causal_diag1": {"attn_mask": causal_mask(1)},
    "causal_diag1&padding": {"attn_mask": causal_mask(1) & key_padding_mask(torch.tensor([6, 4]))},
}


@pytest.mark.parametrize("mask", GRADIENT_MASKS.values(), ids=GRADIENT_MASKS)
@pytest.mark.parametrize("normalizer", ["softmax:temperature=0.5", "ssmax", "sparsemax"])
def test_gradcheck(normalizer, mask, blocks):
    q, k, v = (t[:, :1, :, :4].detach().requires_grad_() for t in qkv(5, 6, seed=3))
    check = lambda *inputs: attnorm.attention(*inputs, normalizer, **mask)
    assert torch.autograd.gradcheck(check, (q, k, v), fast_mode=True)


def test_blocked_route_gradients_of_learnable_parameters_and_additive_masks(blocks):
    """q, k, v, a learnable alpha and an additive mask get float64 autograd's gradients of the formula."""
    q, k, v = (t.requires_grad_() for t in qkv(7, 9, heads=4, kv_heads=2))
    normalizer = attnorm.Entmax(alpha=1.4, learnable=True).double()
    additive = torch.randn(4, 7, 9, dtype=torch.float64, requires_grad=True)
    cotangent = torch.randn(B, 4, 7, D + 2, dtype=torch.float64)
    out = attnorm.attention(q, k, v, normalizer, attn_mask=additive)
    wanted = (q, k, v, additive, *normalizer.parameters())
    got = torch.autograd.grad((out * cotangent).sum(), wanted)
    groups_k, groups_v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    scores = q @ groups_k.transpose(-2, -1) / math.sqrt(D) + additive
    weights = normalizer(scores)  # the row normalizer itself is checked against entmax in its own tests
    expected = torch.autograd.grad(((weights @ groups_v) * cotangent).sum(), wanted)
    for actual, reference in zip(got, expected, strict=True):
        torch.testing.assert_close(actual, reference, rtol=1e-9, atol=1e-10)


def test_blocked_route_replays_dropout_in_its_backward(force_blocked):
    q, k, v = (t[:, :1, :, :4].detach().requires_grad_() for t in qkv(5, 6, seed=3))

    def dropped(*inputs):
        torch.manual_seed(0)  # the same dropout masks at every call: a deterministic function of the inputs
        return attnorm.attention(*inputs, "sparsemax", dropout_p=0.4)

    assert not torch.equal(dropped(q, k, v), attnorm.attention(q, k, v, "sparsemax"))
    assert torch.autograd.gradcheck(dropped, (q, k, v), fast_mode=True)


def test_blocked_route_never_holds_the_score_matrix():
    q, k, v = (t.float() for t in qkv(2048, 2048))
    scores = B * H * 2048 * 2048 * 4
    blocked = peak_allocated_bytes(lambda: attnorm.attention(q, k, v, "sparsemax", is_causal=True))
    assert blocked < scores // 4


@pytest.mark.parametrize("normalizer", ["softmax", "ssmax", "entmax", "sa_softmax"])
def test_fully_masked_rows_give_zeros_and_zero_gradient(normalizer, blocks):
    q, k, v = (t.requires_grad_() for t in qkv(6, 6))
    mask = torch.ones(B, 1, 6, 6, dtype=torch.bool)
    mask[:, :, 2] = False
    out = attnorm.attention(q, k, v, normalizer, attn_mask=mask)
    assert torch.isfinite(out).all()
    assert (out[:, :, 2] == 0).all()
    out.sum().backward()
    assert (q.grad[:, :, 2] == 0).all()
    assert torch.isfinite(k.grad).all() and torch.isfinite(v.grad).all()
    additive = torch.zeros(6, 6, dtype=torch.float64).index_fill(0, torch.tensor([4]), -math.inf)
    assert (attnorm.attention(q, k, v, normalizer, attn_mask=additive)[:, :, 4] == 0).all()


@pytest.mark.parametrize("normalizer", ["softmax", "ssmax", "sparsemax"])
def test_nan_in_a_query_propagates_to_its_row_only(normalizer):
    q, k, v = qkv(5, 5)
    q[0, 1, 3, 0] = math.nan
    out = attnorm.attention(q, k, v, normalizer, is_causal=True)
    assert out[0, 1, 3].isnan().all()
    assert not out[0, 1, :3].isnan().any() and not out[1].isnan().any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", [CASES[1], CASES[5]], ids=repr)
def test_low_precision_inputs(dtype, case):
    q, k, v = qkv(9, 9, dtype=dtype)
    expected, _ = reference_attention(case, q, k, v, allowed_of(9, 9, 0))
    out = attnorm.attention(q, k, v, case.build(), is_causal=True)
    assert out.dtype == dtype
    tolerance = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(out.double(), expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("lq", [1, 9], ids=["decoding", "prefill"])
@pytest.mark.parametrize("case", CASES, ids=repr)
def test_low_precision_inputs_with_a_float32_additive_mask(case, lq, dtype, blocks):
    """A float32 additive mask on half-precision q, k, v (SDPA accepts it): added at float32, output in q's dtype."""
    q, k, v = qkv(lq, 9, dtype=dtype)
    generator = torch.Generator().manual_seed(3)
    additive = torch.randn(lq, 9, generator=generator)
    if case.name.startswith("topk"):
        # Rounding scores to half precision may reorder near-ties; keys far apart keep the top-k set exact.
        additive = additive + 16 * torch.stack([torch.randperm(9, generator=generator) for _ in range(lq)])
    additive = additive.masked_fill(torch.eye(lq, 9, dtype=torch.bool).roll(1, -1), -math.inf).requires_grad_()
    expected, _ = reference_attention(case, q, k, v, allowed_of(lq, 9), additive.detach())
    out = attnorm.attention(q, k, v, case.build(), attn_mask=additive)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), expected, rtol=5e-2, atol=5e-2)
    out.float().square().sum().backward()
    assert additive.grad.dtype == torch.float32 and additive.grad.isfinite().all()


def test_defaults_spec_strings_and_scale():
    q, k, v = qkv(4, 6)
    softmax_case = FAST_CASES[0]
    expected, _ = reference_attention(
        Case("softmax", None, None, lambda x: torch.softmax(x, -1)), q, k, v, allowed_of(4, 6), scale=0.3
    )
    torch.testing.assert_close(attnorm.attention(q, k, v, scale=0.3), expected)
    torch.testing.assert_close(attnorm.attention(q, k, v, "softmax", scale=0.3), expected)
    expected, _ = reference_attention(softmax_case, q, k, v, allowed_of(4, 6))
    torch.testing.assert_close(attnorm.attention(q, k, v, "softmax:temperature=0.7"), expected)
    expected, _ = reference_attention(
        Case("ssmax", None, None, lambda x: scalable_softmax_reference(x, 0.43)), q, k, v, allowed_of(4, 6)
    )
    torch.testing.assert_close(attnorm.attention(q, k, v, "ssmax"), expected)


def test_unbatched_and_three_dim_inputs():
    q, k, v = (t[0, 0] for t in qkv(5, 7))  # (L, D)
    expected, _ = reference_attention(FAST_CASES[1], q, k, v, allowed_of(5, 7, 0))
    torch.testing.assert_close(attnorm.attention(q, k, v, FAST_CASES[1].build(), is_causal=True), expected)
    q, k, v = (t[:, 0] for t in qkv(5, 7))  # (B, L, D)
    expected, _ = reference_attention(FAST_CASES[1], q, k, v, allowed_of(5, 7, None, [7, 3])[:, 0])
    mask = key_padding_mask(torch.tensor([7, 3]))
    torch.testing.assert_close(attnorm.attention(q, k, v, FAST_CASES[1].build(), attn_mask=mask), expected)


@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")  # SDPA's CPU backward under vmap
@pytest.mark.parametrize("case", CASES, ids=repr)
def test_torch_func_grad_jacrev_and_vmap_of_attention(case):
    """``torch.func.grad``, ``jacrev`` and ``vmap`` through attention() (causal, GQA): the float64 reference's
    gradient and output.  The SDPA route's memory-saving saved-tensor hooks (Scalable-Softmax) are refused by
    torch.func, so the route leaves them out there."""
    q, k, v = qkv(5, 5, heads=4, kv_heads=2)
    normalizer = case.build()
    cotangent = torch.randn(B, 4, 5, D + 2, generator=torch.Generator().manual_seed(3), dtype=torch.float64)

    def loss(queries):
        return (attnorm.attention(queries, k, v, normalizer, is_causal=True) * cotangent).sum()

    leaf = q.clone().requires_grad_()
    expected = torch.autograd.grad((reference_attention(case, leaf, k, v, allowed_of(5, 5, 0))[0] * cotangent).sum(),
                                   leaf)[0]
    torch.testing.assert_close(torch.func.grad(loss)(q), expected)
    jacobian = torch.func.jacrev(lambda queries: attnorm.attention(queries, k, v, normalizer, is_causal=True))(q)
    torch.testing.assert_close(torch.einsum("bhld,bhldxyzw->xyzw", cotangent, jacobian), expected)
    mapped = torch.func.vmap(lambda *qkv: attnorm.attention(*qkv, normalizer, is_causal=True))(q, k, v)
    torch.testing.assert_close(mapped, reference_attention(case, q, k, v, allowed_of(5, 5, 0))[0])


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "error::torch.jit.TracerWarning")
@pytest.mark.parametrize("spec", ["softmax", "ssmax", "sparsemax", "entmax15", "topk:k=3", "self_adjusted_softmax"])
def test_jit_trace_of_attention_reproduces_eager_on_new_values(spec):
    """A traced attention() (causal, key padding; SDPA or blocked route) gives eager's output on
    other values of the same shapes, and attnorm's route and shape checks raise no TracerWarning."""
    mask = causal_mask() & key_padding_mask(torch.tensor([8, 5]))

    def run(q, k, v):
        return attnorm.attention(q, k, v, spec, attn_mask=mask)

    traced = torch.jit.trace(run, qkv(8, 8, torch.float32), check_trace=False)
    other = qkv(8, 8, torch.float32, seed=5)
    torch.testing.assert_close(traced(*other), run(*other))


def test_dropout_is_applied_to_the_weights():
    q, k, v = qkv(16, 16)
    torch.manual_seed(0)
    dropped = attnorm.attention(q, k, v, "sparsemax", dropout_p=0.5)
    assert torch.isfinite(dropped).all()
    assert not torch.allclose(dropped, attnorm.attention(q, k, v, "sparsemax"))


def peak_allocated_bytes(run) -> int:
    """Peak of the bytes torch's CPU allocator holds during ``run()``, above what it held before."""
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        run()
    events = [event for event in profiler.profiler.kineto_results.events() if event.name() == "[memory]"]
    held = torch.tensor([event.nbytes() for event in sorted(events, key=lambda event: event.start_ns())])
    return int(held.cumsum(0).max())


SDPA_EQUIVALENT = {
    "is_causal": ({"is_causal": True}, {"is_causal": True}),
    "structured": (
        {"attn_mask": causal_mask(3) & key_padding_mask(torch.tensor([1000, 600]))},
        {"attn_mask": allowed_of(1024, 1024, 3, [1000, 600])},
    ),
    "bool": ({"attn_mask": torch.ones(B, 1, 1024, 1024, dtype=torch.bool).tril()},) * 2,
}


@pytest.mark.parametrize("mask", list(SDPA_EQUIVALENT))
@pytest.mark.parametrize("learnable", [False, True])
def test_scalable_softmax_route_holds_what_sdpa_holds(mask, learnable):
    """Peak memory of the SDPA route: what SDPA holds given the same mask, plus the scaled q and the mask it builds."""
    ours, sdpa = SDPA_EQUIVALENT[mask]
    q, k, v = (t.float() for t in qkv(1024, 1024))
    v = v[..., :D]  # CPU flash attention needs Dv == D (SDPA's math fallback would hold the scores itself)
    normalizer = attnorm.ScalableSoftmax(num_heads=H, learnable=True) if learnable else attnorm.ScalableSoftmax()
    fast = peak_allocated_bytes(lambda: attnorm.attention(q, k, v, normalizer, **ours))
    baseline = peak_allocated_bytes(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, **sdpa))
    built_mask = B * 1024 * 1024 if mask == "structured" else 0  # bool (B, 1, Lq, Lk)
    assert fast <= 1.1 * baseline + q.nbytes + built_mask + 2 * B * 1024 * 8
    materialised = peak_allocated_bytes(
        lambda: attnorm.attention(q, k, v, attnorm.Sparsemax(), return_weights=True, **ours)
    )
    assert materialised > B * H * 1024 * 1024 * 4  # the measurement does see score matrices


def test_errors_name_the_argument():
    q, k, v = qkv(4, 4)
    with pytest.raises(ValueError, match="is_causal"):
        attnorm.attention(q, k, v, attn_mask=torch.ones(4, 4, dtype=torch.bool), is_causal=True)
    with pytest.raises(ValueError, match="dim"):
        attnorm.attention(q, k, v, attnorm.Softmax(dim=-2))
    with pytest.raises(ValueError, match="heads"):
        attnorm.attention(q, k[:, :2], v[:, :2])
    with pytest.raises(ValueError, match="Lk"):
        attnorm.attention(q, k, v[..., :3, :])
    with pytest.raises(TypeError, match="attn_mask"):
        attnorm.attention(q, k, v, attn_mask=torch.ones(4, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="dropout_p"):
        attnorm.attention(q, k, v, dropout_p=1.0)
    with pytest.raises(TypeError, match="normalizer"):
        attnorm.attention(q, k, v, torch.softmax)
    with pytest.raises(ValueError, match="key_lengths"):
        attnorm.attention(q, k, v, "ssmax", attn_mask=key_padding_mask(torch.tensor([4, 4, 4])))
    for per_head in (attnorm.ScalableSoftmax(learnable=True, num_heads=H + 1), attnorm.Entmax(1.5, num_heads=H + 1)):
        with pytest.raises(ValueError, match=f"num_heads={H + 1}"):  # was a bare broadcast error from torch
            attnorm.attention(q, k, v, per_head)


@pytest.mark.parametrize("spec", ["sparsemax", "topk:k=3", "sa_softmax"])
def test_a_decoding_step_mask_that_allows_every_key_builds_nothing(spec):
    """causal_mask(Lk - 1) on one query row allows every key: no interval or bool mask is built."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.__name__)
            return func(*args, **(kwargs or {}))

    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 1, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 9, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    normalizer = attnorm.make(spec)
    with Ops() as ops:
        out = attnorm.attention(q, k, v, normalizer, attn_mask=causal_mask(9 - 1))
    built = [name for name in ops.names if name.split(".")[0] in ("arange", "ge", "lt", "le", "full", "minimum")]
    assert not built, built
    kr, vr = (t.repeat_interleave(2, dim=1) for t in (k, v))
    torch.testing.assert_close(out, normalizer(q @ kr.transpose(-2, -1) / math.sqrt(8)) @ vr)


@pytest.mark.parametrize("backend", [None, "triton"], ids=["default", "triton"])
@pytest.mark.parametrize("queries", [1, 17], ids=["decoding", "full"])
def test_half_precision_scores_are_not_rounded_before_a_top_k_selection(queries, backend):
    """bfloat16 q and k whose two scores, 1 and 1 + 2^-9, round to one bfloat16 value: every
    route (rows for decoding, blocked, fused) ranks them in float32, so top-1 keeps key 1.
    The rows routes once took the matmul's bfloat16 scores and kept key 0 (the lower index)."""
    from tests.conftest import DEVICE

    if backend == "triton":
        pytest.importorskip("triton")
    device = DEVICE if backend == "triton" else "cpu"
    q = torch.ones(1, 1, queries, 2, dtype=torch.bfloat16, device=device)
    k = torch.tensor([[1.0, 0.0], [1.0, 2.0**-9]], dtype=torch.bfloat16, device=device).reshape(1, 1, 2, 2)
    v = torch.eye(2, dtype=torch.bfloat16, device=device).reshape(1, 1, 2, 2)
    out = attnorm.attention(q, k, v, attnorm.TopKSoftmax(1, backend=backend), scale=1.0)
    expected = torch.tensor([0.0, 1.0], dtype=torch.bfloat16, device=device).expand(1, 1, queries, 2)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


SYNC_SPECS = ["softmax:temperature=0.5", "ssmax", "ssmax:learnable=true,num_heads=4", "sparsemax", "entmax:alpha=1.5",
              "topk:k=8", "sa_softmax"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host synchronisation is only observable on CUDA")
@pytest.mark.parametrize("lq", [1, 40], ids=["decoding", "prefill"])
@pytest.mark.parametrize("spec", SYNC_SPECS)
def test_attention_never_synchronises_with_the_host_on_cuda(spec, lq):
    """Every route attention() takes on CUDA, forward and backward, under ``set_sync_debug_mode("error")``: a
    learnable Scalable-Softmax's decoding step once made its key count a tensor from a Python number (a blocking
    host-to-device copy on every call)."""
    normalizer = attnorm.make(spec).cuda()
    q = torch.randn(2, 4, lq, 32, device="cuda", dtype=torch.bfloat16, requires_grad=lq > 1)
    k, v = (torch.randn(2, 4, 96, 32, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    mask = causal_mask(96 - lq)
    for _ in range(2):  # the first calls compile kernels and record replays: they may synchronise
        out = attnorm.attention(q, k, v, normalizer, attn_mask=mask)
        if q.requires_grad:
            out.sum().backward()
        torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = attnorm.attention(q, k, v, normalizer, attn_mask=mask)
        if q.requires_grad:
            out.sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("normalizer", ["softmax", "sparsemax", "topk:k=3"])
def test_head_dim_zero_takes_the_default_scale_like_sdpa(normalizer):
    """Every score is an empty sum (0): uniform weights, as SDPA gives; 0 ** -0.5 raised ZeroDivisionError."""
    q, k = torch.randn(1, 2, 5, 0), torch.randn(1, 2, 7, 0)
    v = torch.randn(1, 2, 7, 4)
    out = attnorm.attention(q, k, v, normalizer)
    expected = v.mean(-2, keepdim=True).expand(1, 2, 5, 4)
    if normalizer.startswith("topk"):
        expected = v[..., :3, :].mean(-2, keepdim=True).expand(1, 2, 5, 4)  # ties: the lowest indices win
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(attnorm.attention(q, k, v), torch.nn.functional.scaled_dot_product_attention(q, k, v))


@pytest.mark.parametrize("window,route", [(4, "blocked"), (48, "sdpa")])
@pytest.mark.parametrize("spec", ["softmax:temperature=0.5", "ssmax:s=0.6,bias=0.1,learnable=true,num_heads=3"])
def test_a_narrow_window_takes_the_blocked_route_on_the_cpu(spec, window, route, force_blocked, monkeypatch):
    """SDPA takes a sliding window as a dense bool mask and computes every score: on the CPU a logit scaling
    whose blocks reach at most a quarter of the scores (``BLOCKED_SHARE``) takes the blocked route, a wider
    window stays on SDPA; both give SDPA's float64 outputs and gradients (``s`` and ``bias`` included)."""
    attention_module = importlib.import_module("attnorm.attention")  # attnorm.attention is the function
    taken = []
    for name in ("scaled_sdpa", "blocked_attention"):
        original = getattr(attention_module, name)
        monkeypatch.setattr(attention_module, name,
                            lambda *args, _f=original, _n=name, **kwargs: taken.append(_n) or _f(*args, **kwargs))
    lq = lk = 96  # more than WINDOW_ROWS: a single block reaches every key
    q, k, v = (t.requires_grad_() for t in qkv(lq, lk))
    normalizer = attnorm.make(spec).double()
    mask = attnorm.sliding_window_mask(window) & causal_mask()
    cotangent = torch.randn(B, H, lq, D + 2, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    out = attnorm.attention(q, k, v, normalizer, attn_mask=mask)
    assert taken == [{"blocked": "blocked_attention", "sdpa": "scaled_sdpa"}[route]]
    params = tuple(normalizer.parameters())
    got = torch.autograd.grad((out * cotangent).sum(), (q, k, v, *params))

    keys, queries = torch.arange(lk), torch.arange(lq)[:, None]
    allowed = (keys <= queries) & (keys > queries - window)
    if params:  # s log n + bias per head and row, n the keys the window allows
        multiplier = normalizer.s.reshape(H, 1, 1) * allowed.sum(-1, keepdim=True).double().log()
        multiplier = multiplier + normalizer.bias.reshape(H, 1, 1)
    else:
        multiplier = torch.tensor(2.0, dtype=torch.float64)
    expected = torch.nn.functional.scaled_dot_product_attention(q * multiplier, k, v, attn_mask=allowed)
    wanted = torch.autograd.grad((expected * cotangent).sum(), (q, k, v, *params))
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)
    for actual, reference in zip(got, wanted, strict=True):
        torch.testing.assert_close(actual, reference, rtol=1e-9, atol=1e-11)


def _window_reference(q, k, v, window: int, multiplier) -> torch.Tensor:
    """float64 ``softmax(multiplier * q k^T / sqrt(D))`` over a causal window of ``window`` keys, then ``@ v``."""
    lq, lk = q.shape[-2], k.shape[-2]
    keys, queries = torch.arange(lk), torch.arange(lq)[:, None]
    allowed = (keys <= queries) & (keys > queries - window)
    scores = (q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]) * multiplier).masked_fill(~allowed, -math.inf)
    return torch.softmax(scores, -1) @ v


def test_the_blocked_route_differentiates_tensor_parameters_that_are_not_module_parameters(force_blocked):
    """``Softmax(temperature=T)`` with ``T`` requiring grad, and a tensor assigned to ``ScalableSoftmax.s``: the
    blocked route passed only ``normalizer.parameters()`` to its Function, so ``T`` and ``s`` got no gradient
    (None) where SDPA's route gave them theirs."""
    q, k, v = (t.requires_grad_() for t in qkv(96, 96))
    window = attnorm.sliding_window_mask(4)
    temperature = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
    out = attnorm.attention(q, k, v, attnorm.Softmax(temperature=temperature), attn_mask=window)
    got = torch.autograd.grad(out.sum(), (q, temperature))
    twin = temperature.detach().clone().requires_grad_()
    want = torch.autograd.grad(_window_reference(q, k, v, 4, 1 / twin).sum(), (q, twin))
    for actual, expected in zip(got, want, strict=True):
        torch.testing.assert_close(actual, expected, rtol=1e-9, atol=1e-10)

    # top-k took the blocked route before too: its T got no gradient there; the materialised route's autograd is
    # the yardstick (the row normalizer itself is checked against references in its own tests)
    topk = attnorm.TopKSoftmax(3, temperature=temperature)
    out = attnorm.attention(q, k, v, topk, attn_mask=window)
    (d_temperature,) = torch.autograd.grad(out.sum(), temperature)
    materialised, _ = attnorm.attention(q, k, v, topk, attn_mask=window, return_weights=True)
    torch.testing.assert_close(d_temperature, torch.autograd.grad(materialised.sum(), temperature)[0])

    normalizer = attnorm.ScalableSoftmax(num_heads=H).double()
    normalizer.s = torch.full((H, 1, 1), 0.8, dtype=torch.float64, requires_grad=True)
    out = attnorm.attention(q, k, v, normalizer, attn_mask=window)
    (d_s,) = torch.autograd.grad(out.sum(), normalizer.s)
    s = normalizer.s.detach().clone().requires_grad_()
    counts = torch.arange(1, 97, dtype=torch.float64).clamp(max=4).log()[:, None]
    (want_s,) = torch.autograd.grad(_window_reference(q, k, v, 4, s * counts).sum(), s)
    torch.testing.assert_close(d_s, want_s, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("spec", ["ssmax:s=0.6,bias=0.1,learnable=true,num_heads=3",
                                  "entmax:alpha=1.3,learnable=true,num_heads=3"])
def test_the_blocked_backward_differentiates_the_parameters_its_forward_used(spec, force_blocked):
    """``torch.func.functional_call`` swaps a module's parameters for one call: the blocked backward read the
    module's parameters again once they were swapped back, and every gradient came out wrong (dq 1.7 off).  It
    now differentiates the values its forward used; changing them in place before the backward raises."""
    q, k, v = (t.requires_grad_() for t in qkv(96, 96))
    window = attnorm.sliding_window_mask(4)
    module, twin = attnorm.make(spec).double(), attnorm.make(spec).double()
    with torch.no_grad():
        for parameter in twin.parameters():
            parameter.add_(0.4)
    swapped = {name: p.detach().clone().requires_grad_() for name, p in twin.named_parameters()}
    out = torch.func.functional_call(_Attend(module, window), {f"normalizer.{n}": p for n, p in swapped.items()},
                                     (q, k, v))
    got = torch.autograd.grad(out.sum(), (q, k, *swapped.values()))
    expected_out = attnorm.attention(q, k, v, twin, attn_mask=window)
    want = torch.autograd.grad(expected_out.sum(), (q, k, *twin.parameters()))
    torch.testing.assert_close(out, expected_out, rtol=0, atol=0)
    for actual, expected in zip(got, want, strict=True):
        torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12)

    if spec.startswith("ssmax"):  # s and bias are used as they are (entmax's alpha is computed from its logit)
        out = attnorm.attention(q, k, v, module, attn_mask=window)
        with torch.no_grad():
            module.s.add_(1.0)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.sum().backward()


class _Attend(torch.nn.Module):
    def __init__(self, normalizer, mask):
        super().__init__()
        self.normalizer, self.mask = normalizer, mask

    def forward(self, q, k, v):
        return attnorm.attention(q, k, v, self.normalizer, attn_mask=self.mask)


def test_under_autocast_the_blocked_route_returns_autocast_dtype_like_sdpa(force_blocked):
    """A narrow window (blocked route) returned float32 under CPU autocast where a wide one (SDPA) returned
    bfloat16; its backward recomputes the blocks under the forward's autocast."""
    q, k, v = (torch.randn(1, 2, 96, 16, requires_grad=True) for _ in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        narrow = attnorm.attention(q, k, v, "softmax:temperature=0.5", attn_mask=attnorm.sliding_window_mask(4))
        wide = attnorm.attention(q, k, v, "softmax:temperature=0.5", attn_mask=attnorm.sliding_window_mask(90))
        sparse = attnorm.attention(q, k, v, "sparsemax", attn_mask=attnorm.sliding_window_mask(4))
    assert narrow.dtype == wide.dtype == sparse.dtype == torch.bfloat16
    (dq,) = torch.autograd.grad(narrow.float().sum(), q)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reference = _window_reference(q, k, v, 4, 2.0)
    (want,) = torch.autograd.grad(reference.float().sum(), q)
    torch.testing.assert_close(dq, want, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("spec,mask", [("softmax:temperature=0.7", attnorm.sliding_window_mask(3)),
                                       ("ssmax:learnable=true,num_heads=3", attnorm.sliding_window_mask(3)),
                                       ("sparsemax", causal_mask()), ("entmax:alpha=1.5", causal_mask()),
                                       ("sa_softmax", None)])
def test_the_blocked_route_differentiates_its_gradients_again(spec, mask, force_blocked):
    """``create_graph=True`` (a gradient penalty, meta-learning): the blocked backward was ``@once_differentiable``
    and its gradients came back detached, so a penalty on them had no gradient (or a misleading error).  Its
    second derivatives now equal the materialised route's (plain autograd of the row ops, whose double backward
    ``tests/test_rules.py`` checks with gradgradcheck)."""
    q, k, v = (t.requires_grad_() for t in qkv(70, 70))  # more query rows than WINDOW_ROWS: the window blocks
    normalizer = attnorm.make(spec).double()
    wanted = (q, k, v, *normalizer.parameters())
    results = []
    for weights in (False, True):
        out = attnorm.attention(q, k, v, normalizer, attn_mask=mask, return_weights=weights)
        out = out[0] if weights else out
        assert (out.grad_fn.name() == "_BlockedAttentionBackward") != weights
        (dq,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
        results.append(torch.autograd.grad(dq.square().sum(), wanted))
    for blocked, materialised in zip(*results, strict=True):
        torch.testing.assert_close(blocked, materialised, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("make,change", [
    (lambda: attnorm.Entmax(alpha=1.5), lambda n: setattr(n, "alpha", 1.9)),
    (lambda: attnorm.TopKSoftmax(k=4), lambda n: setattr(n, "k", 12)),
    (lambda: attnorm.Softmax(temperature=0.5), lambda n: setattr(n, "temperature", 2.0)),
], ids=["entmax alpha", "topk k", "softmax T"])
def test_the_blocked_backward_differentiates_the_forward_even_after_a_hyperparameter_changes(make, change,
                                                                                            force_blocked):
    """A hyperparameter set between forward and backward (a schedule, or two forwards then one backward): the
    blocked backward called the module again and differentiated the new setting (dq 0.5-0.9 off, no error)."""
    q, k, v = (t.requires_grad_() for t in qkv(96, 96))
    window = attnorm.sliding_window_mask(4)
    normalizer = make()
    out = attnorm.attention(q, k, v, normalizer, attn_mask=window)
    change(normalizer)
    (got,) = torch.autograd.grad(out.sum(), q)
    reference, _ = attnorm.attention(q, k, v, make(), attn_mask=window, return_weights=True)  # plain autograd
    torch.testing.assert_close(got, torch.autograd.grad(reference.sum(), q)[0], rtol=1e-10, atol=1e-12)


def test_the_blocked_backward_takes_hooked_modules_as_their_forward_saw_them(force_blocked):
    """A hooked normalizer is called as a module: a tensor temperature that is not a parameter got no gradient,
    and under ``functional_call`` the backward differentiated the swapped-back parameters; a buffer changed in
    place before the backward now raises."""
    q, k, v = (t.requires_grad_() for t in qkv(96, 96))
    window = attnorm.sliding_window_mask(4)
    calls = []
    temperature = torch.tensor(0.5, dtype=torch.float64, requires_grad=True)
    hooked = attnorm.Softmax(temperature=temperature)
    hooked.register_forward_hook(lambda module, inputs, output: calls.append(1))
    out = attnorm.attention(q, k, v, hooked, attn_mask=window)
    assert calls, "the hook runs"
    (got,) = torch.autograd.grad(out.sum(), temperature)
    twin = temperature.detach().clone().requires_grad_()
    (want,) = torch.autograd.grad(_window_reference(q, k, v, 4, 1 / twin).sum(), twin)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)

    module = attnorm.ScalableSoftmax(s=0.5, learnable=True, num_heads=H).double()
    module.register_forward_pre_hook(lambda module, inputs: None)
    swapped = {"normalizer.s": torch.full((H, 1, 1), 0.9, dtype=torch.float64, requires_grad=True),
               "normalizer.bias": torch.full((H, 1, 1), 0.2, dtype=torch.float64, requires_grad=True)}
    out = torch.func.functional_call(_Attend(module, window), swapped, (q, k, v))
    got = torch.autograd.grad(out.sum(), (q, swapped["normalizer.s"]))
    s = swapped["normalizer.s"].detach().clone().requires_grad_()
    counts = torch.arange(1, 97, dtype=torch.float64).clamp(max=4).log()[:, None]
    want = torch.autograd.grad(_window_reference(q, k, v, 4, s * counts + 0.2).sum(), (q, s))
    for actual, expected in zip(got, want, strict=True):
        torch.testing.assert_close(actual, expected, rtol=1e-9, atol=1e-10)

    fixed = attnorm.ScalableSoftmax(num_heads=H).double()  # s and bias are buffers
    out = attnorm.attention(q, k, v, fixed, attn_mask=window)
    fixed.s.mul_(3)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_a_function_normalizer_keeps_the_materialised_route_under_a_narrow_window():
    """``Normalized(f)`` may close over a tensor that requires grad, which only plain autograd sees: a narrow
    window does not send it to the blocked route (whose Function would not differentiate it)."""
    q, k, v = (t.requires_grad_() for t in qkv(96, 96))
    a = torch.tensor(1.3, dtype=torch.float64, requires_grad=True)
    out = attnorm.attention(q, k, v, attnorm.Normalized(lambda x: torch.exp(a * x)),
                            attn_mask=attnorm.sliding_window_mask(4))
    (got,) = torch.autograd.grad(out.sum(), a)
    twin = a.detach().clone().requires_grad_()
    (want,) = torch.autograd.grad(_window_reference(q, k, v, 4, twin).sum(), twin)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)


class _DoubledSoftmax(attnorm.Softmax):
    """A subclass whose forward changes what it computes."""

    def forward(self, scores, mask=None, **options):
        return super().forward(2 * scores, mask, **options)


@pytest.mark.parametrize("mask", [{"is_causal": True}, {"attn_mask": attnorm.sliding_window_mask(4)}, {}])
def test_a_subclass_overriding_forward_is_called_as_a_module(mask):
    """The SDPA route computed the class's own softmax and ignored an overriding forward (here: scores doubled)."""
    q, k, v = (t.requires_grad_() for t in qkv(80, 80))
    out = attnorm.attention(q, k, v, _DoubledSoftmax(), **mask)
    reference = attnorm.attention(q, k, v, attnorm.Softmax(temperature=0.5), **mask)
    torch.testing.assert_close(out, reference, rtol=1e-10, atol=1e-12)


def test_a_function_normalizer_on_the_blocked_route_differentiates_what_its_function_closes_over(force_blocked):
    """``Normalized(lambda x: exp(w x))``: ``w`` is read by the function, not held by the module; the blocked
    route's Function did not know it, and ``w`` got no gradient at long sequences (None)."""
    q, k, v = (t.requires_grad_() for t in qkv(12, 12))
    w = torch.tensor(1.3, dtype=torch.float64, requires_grad=True)
    normalizer = attnorm.Normalized(lambda x: torch.exp(w * x))
    out = attnorm.attention(q, k, v, normalizer, is_causal=True)
    assert out.grad_fn.name() == "_BlockedAttentionBackward"
    (got,) = torch.autograd.grad(out.sum(), w)
    twin = w.detach().clone().requires_grad_()
    allowed = torch.ones(12, 12, dtype=torch.bool).tril()
    scores = torch.exp(twin * (q @ k.transpose(-2, -1)) / math.sqrt(D)).masked_fill(~allowed, 0.0)
    (want,) = torch.autograd.grad(((scores / scores.sum(-1, keepdim=True)) @ v).sum(), twin)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)


def test_a_module_attribute_set_between_forward_and_backward_raises_on_the_blocked_route(force_blocked):
    """A module called as such (an F/sum F normalizer, a hooked one) is recomputed in the backward from its
    attributes as they are then: one set after the forward gave the gradient of another function (dq 276 off)."""
    q, k, v = (t.requires_grad_() for t in qkv(12, 12))
    relu = attnorm.ReLUNormalized(power=1.0)
    out = attnorm.attention(q, k, v, relu, is_causal=True)
    relu.power = 1.0  # set again to the same value: not a change
    relu.train(False)
    out.sum().backward()
    out = attnorm.attention(q, k, v, relu, is_causal=True)
    relu.power = 3.0
    with pytest.raises(RuntimeError, match="power changed after the forward"):
        out.sum().backward()
    hooked = attnorm.TopKSoftmax(k=2, temperature=0.5)
    hooked.register_forward_hook(lambda module, inputs, output: output)
    out = attnorm.attention(q, k, v, hooked, is_causal=True)
    hooked.temperature = 3.0
    with pytest.raises(RuntimeError, match="temperature changed after the forward"):
        out.sum().backward()
