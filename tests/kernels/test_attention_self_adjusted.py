"""Fused Self-Adjusted Softmax attention against a float64 attention materialised from the definition.

The reference builds the ``(Lq, Lk)`` scores in float64, masks them, applies
``phi(x) softmax(x)`` over each row's allowed keys (``phi = x``, or min-max normalised
with ``low = min(min x, 0)``, ``high = max(max x, 0)``) and multiplies by ``v``;
gradients come from ``torch.autograd`` through it (``amin``/``amax`` share a gradient
among tied keys).  Every output is poisoned with NaN before the kernels run
(``launch.empty`` is patched), so an element a kernel forgets fails.
"""

from __future__ import annotations

import math

import pytest
import torch

import attnorm
from attnorm.kernels.rules import AttentionMask, attention_allowed

pytest.importorskip("triton")

from attnorm.kernels.triton import attention_self_adjusted as fused  # noqa: E402
from attnorm.kernels.triton import launch  # noqa: E402
from attnorm.routes.fused import _triton_handles_normalized_additive_self_adjusted  # noqa: E402
from tests.conftest import DEVICE, poisoned_empty  # noqa: E402

BROKEN_ON_OLD_TRITON = ("Triton < 3.9 breaks the normalized backward with an additive mask on CUDA (float64: no "
                        "compile; float32: wrong dk); attention() takes the blocked route there (routes/fused.py)")

# The interpreter evaluates masked-off lanes too (e.g. exp(-inf - -inf)); numpy warns about them.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

F64 = torch.float64
SCALE = 0.35

# Outputs are rounded to the input dtype; half-precision products feed tl.dot.
TOLERANCES = {
    torch.float64: {"atol": 1e-10, "rtol": 1e-9},
    torch.float32: {"atol": 2e-5, "rtol": 1e-4},
    torch.float16: {"atol": 1e-2, "rtol": 1e-2},
    torch.bfloat16: {"atol": 6e-2, "rtol": 5e-2},
}


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    monkeypatch.setattr(launch, "empty", poisoned_empty)


# ---- masks and inputs ------------------------------------------------------------------------


def _structured(structured: attnorm.StructuredMask, batch: int, lq: int, lk: int, device) -> AttentionMask:
    start, stop = structured.key_range(batch, lq, lk, device)
    return AttentionMask(start, stop)


MASKS = {
    "none": lambda b, lq, lk, d: AttentionMask(),
    "causal": lambda b, lq, lk, d: _structured(attnorm.causal_mask(), b, lq, lk, d),
    "bottom-right": lambda b, lq, lk, d: _structured(attnorm.causal_mask(lk - lq), b, lq, lk, d),
    "window": lambda b, lq, lk, d: _structured(attnorm.sliding_window_mask(5, lk - lq), b, lq, lk, d),
    "padding": lambda b, lq, lk, d: _structured(attnorm.key_padding_mask(torch.tensor([lk, 7])[:b]), b, lq, lk, d),
    "documents": lambda b, lq, lk, d: _structured(
        attnorm.document_mask(torch.tensor([0, 3, 17, 18])) & attnorm.causal_mask(), b, lq, lk, d
    ),
    "dense": lambda b, lq, lk, d: AttentionMask(
        dense=(torch.rand(b, 1, lq, lk, generator=torch.Generator().manual_seed(3)) > 0.4).to(d)
    ),
    "additive": lambda b, lq, lk, d: AttentionMask(
        additive=torch.where(
            torch.rand(lq, lk, generator=torch.Generator().manual_seed(4)) > 0.3,
            torch.randn(lq, lk, generator=torch.Generator().manual_seed(5)),
            -math.inf,
        ).to(d)
    ),
}
SQUARE = ("documents",)


def make_qkv(batch, heads, kv_heads, lq, lk, head_dim, value_dim, dtype, device, seed=0, integer=False):
    gen = torch.Generator().manual_seed(seed)

    def draw(*shape):
        if integer:  # small integers: exact scores, many of them tied
            return torch.randint(-2, 3, shape, generator=gen).to(F64)
        return torch.randn(*shape, generator=gen, dtype=F64)

    q = draw(batch, heads, lq, head_dim)
    k = draw(batch, kv_heads, lk, head_dim)
    v = draw(batch, kv_heads, lk, value_dim)
    return tuple(t.to(dtype=dtype, device=device) for t in (q, k, v))


def masked_scores(q, k, mask: AttentionMask, scale):
    """Float64 scores ``(B, Hq, Lq, Lk)`` and the allowed keys, key/value heads repeated over their group."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, 1)
    x = scale * (q @ k.transpose(-1, -2))
    if mask.additive is not None:
        x = x + mask.additive.to(x)
    allowed = x != -math.inf
    keep = attention_allowed(mask, tuple(x.shape), x.device)
    if keep is not None:
        allowed = allowed & keep
    return x, allowed


def reference(q, k, v, mask: AttentionMask, scale, normalized):
    """``(phi(x) softmax(x)) v`` materialised in float64, differentiable in q, k, v."""
    x, allowed = masked_scores(q, k, mask, scale)
    any_allowed = allowed.any(-1, keepdim=True)
    weights = torch.softmax(torch.where(any_allowed, torch.where(allowed, x, -math.inf), 0.0), -1)
    weights = torch.where(allowed, weights, 0.0)
    xs = torch.where(allowed, x, 0.0)
    if normalized:
        low = torch.where(allowed, x, math.inf).amin(-1, keepdim=True).clamp(max=0)
        high = torch.where(allowed, x, -math.inf).amax(-1, keepdim=True).clamp(min=0)
        span = high - low
        phi = torch.where(span > 0, (xs - low) / torch.where(span > 0, span, 1.0), 0.0)
    else:
        phi = xs
    return torch.where(allowed, phi * weights, 0.0) @ v.repeat_interleave(q.shape[1] // k.shape[1], 1)


def run_fused(q, k, v, mask, scale, normalized, grad_out):
    out, stats, _ = fused.self_adjusted_attention_forward(q, k, v, mask, scale, normalized)
    grads = fused.self_adjusted_attention_backward(q, k, v, out, grad_out, stats, mask, scale, normalized)
    return out, stats, grads[:3]


def check(q, k, v, mask, normalized, scale=SCALE, seed=1):
    """Fused outputs and gradients equal the float64 reference's within the dtype's tolerance."""
    return compare_with_reference(
        q, k, v, lambda grad_out: run_fused(q, k, v, mask, scale, normalized, grad_out),
        lambda *leaves: reference(*leaves, mask, scale, normalized), fused.STATS, seed,
    )


def compare_with_reference(q, k, v, run, expected_of, stats_width: int, seed: int = 1):
    """``run(grad_out) -> (out, stats, (dq, dk, dv))`` against autograd of ``expected_of(q, k, v)`` in float64."""
    grad_out = torch.randn(*q.shape[:3], v.shape[-1], generator=torch.Generator().manual_seed(seed))
    grad_out = grad_out.to(q.dtype).to(F64)  # the reference gets the rounded gradient the kernels get
    out, stats, grads = run(grad_out.to(q))
    leaves = [t.detach().to(F64).requires_grad_() for t in (q, k, v)]
    expected = expected_of(*leaves)
    expected.backward(grad_out.to(expected.device))
    tol = TOLERANCES[q.dtype]
    assert out.dtype == q.dtype and stats.shape == (*q.shape[:3], stats_width)
    torch.testing.assert_close(out.to(F64), expected.detach(), **tol)
    for grad, leaf in zip(grads, leaves, strict=True):
        assert grad.shape == leaf.shape and grad.dtype == q.dtype
        torch.testing.assert_close(grad.to(F64), leaf.grad, **tol)
    return out, grads


# ---- tests -----------------------------------------------------------------------------------


@pytest.mark.parametrize("normalized", [True, False], ids=["normalized", "plain"])
@pytest.mark.parametrize("kind", list(MASKS))
def test_every_mask_kind_matches_reference(kind, normalized, device):
    old_triton = DEVICE == "cuda" and not _triton_handles_normalized_additive_self_adjusted()
    if kind == "additive" and normalized and old_triton:
        pytest.skip(BROKEN_ON_OLD_TRITON)
    lq = 18 if kind in SQUARE else 13
    q, k, v = make_qkv(2, 2, 1, lq, 18, 16, 16, torch.float32, device)
    check(q, k, v, MASKS[kind](2, lq, 18, device), normalized)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("normalized", [True, False], ids=["normalized", "plain"])
def test_dtypes(dtype, normalized, device):
    q, k, v = make_qkv(1, 2, 2, 20, 20, 16, 16, dtype, device)
    check(q, k, v, MASKS["causal"](1, 20, 20, device), normalized)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_plain_half_precision_gradients_take_p_from_the_unrounded_output(dtype, device):
    """Plain's ``ds = w (g (1 + x) - P)`` cancels where the weight sits on few keys, so ``P = rowsum(dO out)``
    from the rounded ``out`` left dq and dk 2-3x further from float64 than the other families' (float16,
    interpreted); from the forward's float32 output (``float_out``, what ``attnorm.attention`` asks for when a
    gradient will be taken) they are not.  Both against the float64 reference, relative to each gradient's
    largest value, and beside the same reference differentiated by PyTorch in the half dtype (FlashAttention's
    yardstick: twice that error).  On an H200 (bfloat16 operands rounded before the MMAs, which the interpreter
    reads as float32): bfloat16 1.16 % from the float32 output, 1.87 % from the rounded one, 1.80 % eager;
    float16 0.05 %, 0.22 %, 0.30 % (``scripts/half_precision_probe.py``)."""
    q, k, v = make_qkv(2, 2, 1, 24, 24, 32, 16, dtype, device, seed=3)
    q = q * 3  # peaked rows
    mask = MASKS["causal"](2, 24, 24, device)
    grad_out = torch.randn(2, 2, 24, 16, generator=torch.Generator().manual_seed(4)).to(dtype).to(device)
    leaves = [t.detach().to(F64).requires_grad_() for t in (q, k, v)]
    reference(*leaves, mask, SCALE, False).backward(grad_out.to(F64))
    half = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    reference(*half, mask, SCALE, False).backward(grad_out)
    out, stats, out_float = fused.self_adjusted_attention_forward(q, k, v, mask, SCALE, False, float_out=True)
    assert out_float.dtype == torch.float32 and out_float.shape == out.shape
    torch.testing.assert_close(out.to(F64), out_float.to(F64), rtol=torch.finfo(dtype).eps, atol=0)

    def worst(grads):
        return max(((g.to(F64) - leaf.grad).abs().max() / leaf.grad.abs().max()).item()
                   for g, leaf in zip(grads, leaves[:2], strict=True))

    exact = worst(fused.self_adjusted_attention_backward(q, k, v, out, grad_out, stats, mask, SCALE, False,
                                                         out_float=out_float)[:2])
    rounded = worst(fused.self_adjusted_attention_backward(q, k, v, out, grad_out, stats, mask, SCALE, False)[:2])
    eager = worst([t.grad for t in half[:2]])
    assert exact < eager  # at least as close as PyTorch in the dtype
    if dtype == torch.float16:
        assert exact < 1e-3 and rounded > 2 * exact  # interpreted: 0.05 % and 0.17 %
    else:
        assert rounded > exact  # interpreted (operands read as float32): 0.45 % and 2.1 %


@pytest.mark.parametrize(("head_dim", "value_dim"), [(20, 16), (32, 24)])
def test_head_dims_padded_to_powers_of_two(head_dim, value_dim, device):
    q, k, v = make_qkv(1, 2, 1, 17, 21, head_dim, value_dim, torch.float32, device)
    check(q, k, v, MASKS["bottom-right"](1, 17, 21, device), True)


def test_gqa_and_strided_inputs(device):
    """Four query heads on two key/value heads; q, k, v as transposed views (non-contiguous)."""
    q, k, v = make_qkv(2, 4, 2, 12, 19, 16, 16, torch.float32, device)
    q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    assert not q.is_contiguous()
    check(q, k, v, MASKS["padding"](2, 12, 19, device), True)


@pytest.mark.parametrize("normalized", [True, False], ids=["normalized", "plain"])
def test_ties_at_the_row_extremes(normalized, device):
    """Integer scores: many keys tie at the row min and max, whose gradient paths they share."""
    q, k, v = make_qkv(1, 2, 1, 16, 24, 16, 16, torch.float64, device, integer=True)
    check(q, k, v, MASKS["window"](1, 16, 24, device), normalized, scale=0.5)


def test_a_row_min_or_max_of_exactly_zero(device):
    """At ``min x = 0`` (``max x = 0``) ``min(x, 0)`` has a kink: the path through ``low`` (``high``)
    counts, as the reference's ``clamp`` has it (the first rule of this kernel did not count it)."""
    q = torch.tensor([[1.0, 0, 0, 0], [-1, 0, 0, 0], [2, 1, 0, 0]], dtype=F64)
    k = torch.tensor([[0.0, 0, 0, 0], [1, 0, 0, 0], [2, 0, 0, 0], [0, 1, 0, 0]], dtype=F64)  # key 0 scores 0
    v = torch.randn(4, 4, generator=torch.Generator().manual_seed(3), dtype=F64)
    q, k, v = (t.reshape(1, 1, *t.shape).to(device) for t in (q, k, v))
    # rows: [0, 1, 2, 0] (min 0, twice), [0, -1, -2, 0] (max 0, twice), [0, 2, 4, 1] (min 0 once)
    check(q, k, v, MASKS["none"](1, 3, 4, device), True, scale=1.0)


def test_fully_masked_rows_give_zeros(device):
    """Batch 1 has no key at all, and a dense mask empties one more row: zeros, never NaN."""
    q, k, v = make_qkv(2, 2, 2, 9, 16, 16, 16, torch.float32, device)
    lengths = attnorm.key_padding_mask(torch.tensor([16, 0])).key_range(2, 9, 16, device)
    dense = torch.ones(1, 1, 9, 16, dtype=torch.bool)
    dense[..., 4, :] = False
    mask = AttentionMask(*lengths, dense.to(device))
    for normalized in (True, False):
        out, (dq, dk, dv) = check(q, k, v, mask, normalized)
        assert (out[1] == 0).all() and (out[0, :, 4] == 0).all()
        assert (dq[1] == 0).all() and (dk[1] == 0).all() and (dv[1] == 0).all()


def test_all_equal_scores_have_no_span(device):
    """Zero queries: every score is 0, so ``high = low`` and the normalized factor (and output) is 0."""
    q, k, v = make_qkv(1, 1, 1, 5, 16, 16, 16, torch.float32, device)
    check(torch.zeros_like(q), k, v, AttentionMask(), True)


@pytest.mark.skipif(DEVICE == "cuda" and not _triton_handles_normalized_additive_self_adjusted(),
                    reason=BROKEN_ON_OLD_TRITON)
def test_posinf_rows_follow_the_limit(device):
    """A row with +inf scores (additive): normalized gives the mean of v over them, with no score gradient."""
    q, k, v = make_qkv(1, 1, 1, 3, 16, 16, 16, torch.float64, device)
    additive = torch.zeros(3, 16, dtype=F64)
    additive[1, [2, 9]] = math.inf
    mask = AttentionMask(additive=additive.to(device))
    grad_out = torch.ones(1, 1, 3, 16, dtype=F64, device=device)
    out, _, (dq, dk, dv) = run_fused(q, k, v, mask, SCALE, True, grad_out)
    torch.testing.assert_close(out[0, 0, 1], v[0, 0, [2, 9]].mean(0))
    assert (dq[0, 0, 1] == 0).all() and dk.isfinite().all() and dv.isfinite().all()
    plain = fused.self_adjusted_attention_forward(q, k, v, mask, SCALE, False)[0]
    infinite = torch.where(additive[1] == math.inf, math.inf, 0.0).to(v)
    torch.testing.assert_close(plain[0, 0, 1], infinite @ v[0, 0], equal_nan=True)  # +inf weights: inf, -inf or NaN


@pytest.mark.skipif(DEVICE == "cuda" and not _triton_handles_normalized_additive_self_adjusted(),
                    reason=BROKEN_ON_OLD_TRITON)
@pytest.mark.parametrize("normalized", [True, False], ids=["normalized", "plain"])
def test_special_scores_are_classified_per_row_in_every_key_block(normalized, device, blocks_of_16):
    """+inf, NaN and -inf scores in masked and inner key blocks (three blocks of 16 keys): a NaN row is NaN
    (also beside +inf, in either order), a +inf row follows the limit, the finite rows match the reference."""
    q, k, v = make_qkv(1, 1, 1, 8, 48, 16, 16, torch.float32, device, seed=9)
    additive = torch.zeros(8, 48, dtype=torch.float32)
    additive[1, [5, 30]] = math.inf
    additive[2, 33] = math.nan
    additive[3, 3], additive[3, 40] = math.inf, math.nan
    additive[4, 2], additive[4, 44] = math.nan, math.inf
    additive[5, :20] = additive[5, 21:] = -math.inf  # one key
    additive[6] = -math.inf  # no key
    additive[7, :16] = -math.inf
    mask = AttentionMask(additive=additive.to(device))
    grad_out = torch.randn(1, 1, 8, 16, generator=torch.Generator().manual_seed(2)).to(device)
    grad_out[:, :, 1:5] = 0  # the special rows add nothing to dk and dv
    out, stats, (dq, dk, dv) = run_fused(q, k, v, mask, SCALE, normalized, grad_out)
    assert out[0, 0, 2:5].isnan().all() and not out[0, 0, [0, 5, 6, 7]].isnan().any()
    states = stats[0, 0, :, 6].tolist()
    assert states == [1, 2, 0, 0, 0, 1, 0, 1], states
    assert stats[0, 0, 1, 1].item() == pytest.approx(math.log(2))  # uniform over its two +inf keys
    if normalized:
        torch.testing.assert_close(out[0, 0, 1], v[0, 0, [5, 30]].mean(0))
    else:  # +inf weights: inf, -inf or NaN
        infinite = torch.where(additive[1] == math.inf, math.inf, 0.0).to(v)
        torch.testing.assert_close(out[0, 0, 1], infinite @ v[0, 0], equal_nan=True)
    assert (out[0, 0, 6] == 0).all()
    rows = [0, 5, 6, 7]
    leaves = [t.detach().double().requires_grad_() for t in (q[:, :, rows], k, v)]
    expected = reference(*leaves, AttentionMask(additive=additive[rows].double().to(device)), SCALE, normalized)
    expected.backward(grad_out[:, :, rows].double())
    tol = TOLERANCES[torch.float32]
    torch.testing.assert_close(out[:, :, rows].double(), expected.detach(), **tol)
    torch.testing.assert_close(dq[:, :, rows].double(), leaves[0].grad, **tol)
    torch.testing.assert_close(dk.double(), leaves[1].grad, **tol)
    if normalized:  # plain: the +inf row's infinite weights times its zero dO make dv NaN, as autograd has it
        torch.testing.assert_close(dv.double(), leaves[2].grad, **tol)


@pytest.mark.parametrize("normalized", [True, False], ids=["normalized", "plain"])
def test_decoding_equals_last_row_of_full_causal(normalized, device):
    """One query against a long key cache equals the last row of the full causal run."""
    q, k, v = make_qkv(1, 2, 1, 40, 40, 16, 16, torch.float32, device)
    full = fused.self_adjusted_attention_forward(q, k, v, MASKS["causal"](1, 40, 40, device), SCALE, normalized)[0]
    last = q[:, :, -1:]
    one = fused.self_adjusted_attention_forward(last, k, v, MASKS["bottom-right"](1, 1, 40, device), SCALE,
                                                normalized)[0]
    torch.testing.assert_close(one, full[:, :, -1:], atol=1e-6, rtol=1e-5)
    check(last, k, v, AttentionMask(), normalized)


def test_block_size_is_a_patchable_constant(blocks_of_32, device):
    """32-row blocks (one query block, two key blocks) give the same results as the default."""
    q, k, v = make_qkv(1, 2, 1, 20, 40, 16, 16, torch.float32, device)
    check(q, k, v, MASKS["bottom-right"](1, 20, 40, device), True)


def test_deterministic(device):
    q, k, v = make_qkv(1, 2, 1, 20, 20, 16, 16, torch.float32, device)
    mask = MASKS["causal"](1, 20, 20, device)
    grad_out = torch.randn(1, 2, 20, 16, generator=torch.Generator().manual_seed(2)).to(device)
    first = run_fused(q, k, v, mask, SCALE, True, grad_out)
    second = run_fused(q, k, v, mask, SCALE, True, grad_out)
    for a, b in zip([first[0], first[1], *first[2]], [second[0], second[1], *second[2]], strict=True):
        assert torch.equal(a, b)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("kind", list(MASKS))
def test_larger_grid(kind, head_dim, dtype, device):
    lq = 70 if kind in SQUARE else 50
    q, k, v = make_qkv(2, 4, 2, lq, 70, head_dim, head_dim, dtype, device)
    for normalized in (True, False):
        check(q, k, v, MASKS[kind](2, lq, 70, device), normalized, scale=head_dim**-0.5)
