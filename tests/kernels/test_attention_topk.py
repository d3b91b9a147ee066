"""Fused exact top-k attention against a float64 attention materialised from the definition.

The reference builds the ``(Lq, Lk)`` scores in float64, ranks each row's allowed scores
with a stable descending sort (so among scores tied at the k-th value the lowest key
index wins), keeps ``min(k, n)`` of them (``max(1, ceil(k n - 1e-9))`` for a fraction),
takes the softmax of ``x / temperature`` over them and multiplies by ``v``; gradients
come from ``torch.autograd``.  Integer-valued q and k give exact ties at the k-th score.
Outputs are poisoned with NaN before the kernels run.  Masks and inputs are those of
``test_attention_self_adjusted``.
"""

from __future__ import annotations

import math

import pytest
import torch

import attnorm
from attnorm.kernels.rules import AttentionMask
from tests.conftest import slow_under_interpreter
from tests.kernels.test_attention_self_adjusted import (  # noqa: F401 (poisoned_outputs: an autouse fixture)
    MASKS,
    SQUARE,
    TOLERANCES,
    compare_with_reference,
    make_qkv,
    masked_scores,
    poisoned_outputs,
)

pytest.importorskip("triton")

from attnorm.kernels.triton import attention_launch  # noqa: E402
from attnorm.kernels.triton import attention_topk as fused  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

F64 = torch.float64
SCALE = 0.35


def kept_keys(x, allowed, k_keep, is_fraction):
    """Bool like ``x``: each row's ``min(k, n)`` largest allowed scores, ties to the lowest index."""
    n = allowed.sum(-1, keepdim=True)
    if is_fraction:
        count = torch.ceil(n.to(F64) * k_keep - 1e-9).long().clamp_min(1)
    else:
        count = torch.full_like(n, int(k_keep))
    count = torch.minimum(count, n)
    ranked = torch.where(allowed, x.detach(), -math.inf)
    rank = ranked.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1)
    return allowed & (rank < count)


def reference(q, k, v, mask, scale, k_keep, is_fraction, temperature):
    """``softmax(x / temperature over the kept keys) v`` materialised in float64, differentiable in q, k, v."""
    x, allowed = masked_scores(q, k, mask, scale)
    kept = kept_keys(x, allowed, k_keep, is_fraction)
    logits = torch.where(kept, x / temperature, -math.inf)
    weights = torch.softmax(torch.where(kept.any(-1, keepdim=True), logits, 0.0), -1)
    weights = torch.where(kept, weights, 0.0)
    return weights @ v.repeat_interleave(q.shape[1] // k.shape[1], 1)


def run_fused(q, k, v, mask, scale, k_keep, is_fraction, temperature, grad_out):
    out, stats, _ = fused.topk_attention_forward(q, k, v, mask, scale, k_keep, is_fraction, temperature)
    grads = fused.topk_attention_backward(q, k, v, out, grad_out, stats, mask, scale, k_keep, is_fraction,
                                          temperature)
    return out, stats, grads[:3]


def check(q, k, v, mask, k_keep, is_fraction=False, temperature=1.0, scale=SCALE, seed=1):
    """Fused outputs and gradients equal the float64 reference's within the dtype's tolerance."""
    return compare_with_reference(
        q, k, v, lambda grad_out: run_fused(q, k, v, mask, scale, k_keep, is_fraction, temperature, grad_out),
        lambda *leaves: reference(*leaves, mask, scale, k_keep, is_fraction, temperature), fused.STATS, seed,
    )


@pytest.mark.parametrize("kind", list(MASKS))
def test_every_mask_kind_matches_reference(kind, device):
    lq = 18 if kind in SQUARE else 13
    q, k, v = make_qkv(2, 2, 1, lq, 18, 16, 16, torch.float32, device)
    check(q, k, v, MASKS[kind](2, lq, 18, device), 3)


@pytest.mark.slow  # attention_launch.SKIP_EMPTY_TILES is off by default (slower on an H200)
@pytest.mark.parametrize("kind", ["causal", "documents"])
def test_skipping_tiles_without_kept_keys_changes_no_bit(kind, blocks_of_16, monkeypatch, device):
    """``attention_launch.SKIP_EMPTY_TILES`` (off by default) skips the backward's products of tiles keeping no key;
    what it skips adds only zeros, so both give the same bits, and the reference's values."""
    q, k, v = make_qkv(1, 2, 1, 40, 40, 16, 16, torch.float32, device, seed=4)
    mask = MASKS[kind](1, 40, 40, device)
    grad_out = torch.randn(1, 2, 40, 16, generator=torch.Generator().manual_seed(5)).to(device)
    plain = run_fused(q, k, v, mask, SCALE, 3, False, 1.0, grad_out)
    monkeypatch.setattr(attention_launch, "SKIP_EMPTY_TILES", True)
    skipped = run_fused(q, k, v, mask, SCALE, 3, False, 1.0, grad_out)
    for a, b in zip([plain[0], *plain[2]], [skipped[0], *skipped[2]], strict=True):
        assert torch.equal(a, b)
    check(q, k, v, mask, 3)


@pytest.mark.parametrize("kind", ["causal", "padding", "dense"])
def test_fraction_of_allowed_keys(kind, device):
    q, k, v = make_qkv(2, 1, 1, 18, 18, 16, 16, torch.float32, device)
    check(q, k, v, MASKS[kind](2, 18, 18, device), 0.3, is_fraction=True, temperature=0.6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_precision_gradients_take_delta_from_the_unrounded_output(dtype, device):
    """Rows whose weight sits on one or two keys: ``ds = p (dP - delta)`` cancels, so ``delta = rowsum(dO out)``
    from the output rounded to bfloat16's 8 bits left ~1 % of ``dP`` in ``ds``; from the forward's float32 output
    (``float_out``, what ``attnorm.attention`` asks for when a gradient will be taken) the gradients keep the
    accuracy of the other families.  Both against the float64 reference, relative to each gradient's largest value."""
    q, k, v = make_qkv(2, 2, 1, 24, 24, 32, 16, dtype, device, seed=3)
    mask = MASKS["causal"](2, 24, 24, device)
    grad_out = torch.randn(2, 2, 24, 16, generator=torch.Generator().manual_seed(4)).to(dtype).to(device)
    leaves = [t.detach().to(F64).requires_grad_() for t in (q, k, v)]
    reference(*leaves, mask, 1.0, 2, False, 1.0).backward(grad_out.to(F64))
    out, stats, out_float = fused.topk_attention_forward(q, k, v, mask, 1.0, 2, False, 1.0, float_out=True)
    assert out_float.dtype == torch.float32 and out_float.shape == out.shape
    # out is out_float rounded (within one unit: the interpreter truncates to bfloat16)
    torch.testing.assert_close(out.to(F64), out_float.to(F64), rtol=torch.finfo(dtype).eps, atol=0)

    def worst(grads):
        return max(((g.to(F64) - leaf.grad).abs().max() / leaf.grad.abs().max()).item()
                   for g, leaf in zip(grads, leaves[:2], strict=True))

    exact = fused.topk_attention_backward(q, k, v, out, grad_out, stats, mask, 1.0, 2, False, 1.0,
                                          out_float=out_float)[:2]
    rounded = fused.topk_attention_backward(q, k, v, out, grad_out, stats, mask, 1.0, 2, False, 1.0)[:2]
    bound = 6e-3 if dtype == torch.bfloat16 else 1e-3
    assert worst(exact) < bound  # about the rounding of the gradients themselves (bfloat16: 0.4 %)
    if dtype == torch.bfloat16:  # float16's 11 bits leave little to cancel: both within the bound there
        assert worst(rounded) > bound


# Each k in one dtype by default, alternating; the other dtype of each with -m slow (2-4 s a case interpreted).
TIE_CASES = [pytest.param(k_keep, is_fraction, dtype, id=f"{k_keep}-{is_fraction}-{dtype}",
                          marks=slow_under_interpreter((index + (dtype == torch.float64)) % 2 == 0))
             for index, (k_keep, is_fraction) in enumerate([(1, False), (4, False), (7, False), (0.45, True)])
             for dtype in (torch.float32, torch.float64)]


@pytest.mark.parametrize(("k_keep", "is_fraction", "dtype"), TIE_CASES)
def test_ties_at_the_kth_score_keep_the_lowest_index(k_keep, is_fraction, dtype, device):
    """Integer q, k: scores tie often, across key blocks too; the kept set is the stable sort's."""
    q, k, v = make_qkv(1, 2, 1, 16, 40, 16, 16, dtype, device, integer=True)
    x, allowed = masked_scores(q.to(F64), k.to(F64), AttentionMask(), SCALE)
    kept = kept_keys(x, allowed, k_keep, is_fraction)
    kth = torch.where(kept, x, math.inf).amin(-1, keepdim=True)
    assert ((x == kth) & ~kept).any()  # some rows leave tied keys out
    check(q, k, v, AttentionMask(), k_keep, is_fraction)


@pytest.mark.parametrize("radix_bits", [2, 8])
def test_digit_width(radix_bits, monkeypatch, device):
    monkeypatch.setattr(fused, "RADIX_BITS", radix_bits)
    q, k, v = make_qkv(1, 1, 1, 16, 24, 16, 16, torch.float32, device, integer=True)
    check(q, k, v, MASKS["causal"](1, 16, 24, device), 5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64], ids=str)
def test_dtypes(dtype, device):
    q, k, v = make_qkv(1, 2, 2, 20, 20, 16, 16, dtype, device)
    check(q, k, v, MASKS["causal"](1, 20, 20, device), 4, temperature=0.8)


@pytest.mark.parametrize(("head_dim", "value_dim"), [(20, 16), (32, 24)])
def test_head_dims_padded_to_powers_of_two(head_dim, value_dim, device):
    q, k, v = make_qkv(1, 2, 1, 17, 21, head_dim, value_dim, torch.float32, device)
    check(q, k, v, MASKS["bottom-right"](1, 17, 21, device), 5)


def test_gqa_and_strided_inputs(device):
    q, k, v = make_qkv(1, 4, 2, 12, 19, 16, 16, torch.float32, device)
    q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    check(q, k, v, MASKS["window"](1, 12, 19, device), 2)


def test_k_beyond_the_allowed_keys_is_softmax_attention(device):
    q, k, v = make_qkv(1, 2, 1, 16, 20, 16, 16, torch.float32, device)
    mask = MASKS["causal"](1, 16, 20, device)
    out, _, _ = fused.topk_attention_forward(q, k, v, mask, SCALE, 1000, False, 1.0)
    x, allowed = masked_scores(q.to(F64), k.to(F64), mask, SCALE)
    expected = torch.softmax(torch.where(allowed, x, -math.inf), -1) @ v.to(F64).repeat_interleave(2, 1)
    torch.testing.assert_close(out.to(F64), expected, **TOLERANCES[torch.float32])
    check(q, k, v, mask, 1000)


def test_fully_masked_rows_give_zeros(device):
    q, k, v = make_qkv(2, 2, 2, 9, 16, 16, 16, torch.float32, device)
    lengths = attnorm.key_padding_mask(torch.tensor([16, 0])).key_range(2, 9, 16, device)
    dense = torch.ones(1, 1, 9, 16, dtype=torch.bool)
    dense[..., 4, :] = False
    out, (dq, dk, dv) = check(q, k, v, AttentionMask(*lengths, dense.to(device)), 3)
    assert (out[1] == 0).all() and (out[0, :, 4] == 0).all()
    assert (dq[1] == 0).all() and (dk[1] == 0).all() and (dv[1] == 0).all()


def test_posinf_rows_keep_their_first_infinite_keys(device):
    """Three +inf scores (additive) and k = 2: uniform over the first two, no score gradient."""
    q, k, v = make_qkv(1, 1, 1, 3, 20, 16, 16, torch.float64, device)
    additive = torch.zeros(3, 20, dtype=F64)
    additive[1, [4, 11, 17]] = math.inf
    mask = AttentionMask(additive=additive.to(device))
    grad_out = torch.randn(1, 1, 3, 16, dtype=F64, device=device)
    out, _, (dq, dk, dv) = run_fused(q, k, v, mask, SCALE, 2, False, 1.0, grad_out)
    torch.testing.assert_close(out[0, 0, 1], v[0, 0, [4, 11]].mean(0))
    assert (dq[0, 0, 1] == 0).all() and dk.isfinite().all()
    finite_rows = [0, 2]
    expected_dv = torch.zeros(20, 16, dtype=F64, device=device)
    expected_dv[[4, 11]] = grad_out[0, 0, 1] / 2
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    rest = reference(leaves[0][:, :, finite_rows], leaves[1], leaves[2], AttentionMask(), SCALE, 2, False, 1.0)
    rest.backward(grad_out[:, :, finite_rows])
    torch.testing.assert_close(dv[0, 0], expected_dv + leaves[2].grad[0, 0])
    torch.testing.assert_close(dk, leaves[1].grad)


def test_decoding_equals_last_row_of_full_causal(device):
    q, k, v = make_qkv(1, 1, 1, 36, 36, 16, 16, torch.float32, device)
    full, _, _ = fused.topk_attention_forward(q, k, v, MASKS["causal"](1, 36, 36, device), SCALE, 6, False, 1.0)
    last = q[:, :, -1:]
    one, _, _ = fused.topk_attention_forward(last, k, v, MASKS["bottom-right"](1, 1, 36, device), SCALE, 6, False, 1.0)
    torch.testing.assert_close(one, full[:, :, -1:], atol=1e-6, rtol=1e-5)
    check(last, k, v, AttentionMask(), 0.1, is_fraction=True)


def test_block_size_is_a_patchable_constant(blocks_of_32, device):
    q, k, v = make_qkv(1, 1, 1, 20, 40, 16, 16, torch.float32, device, integer=True)
    check(q, k, v, MASKS["bottom-right"](1, 20, 40, device), 5)


def test_deterministic(device):
    q, k, v = make_qkv(1, 1, 1, 17, 20, 16, 16, torch.float32, device, integer=True)
    mask = MASKS["bottom-right"](1, 17, 20, device)
    grad_out = torch.randn(1, 1, 17, 16, generator=torch.Generator().manual_seed(2)).to(device)
    first = run_fused(q, k, v, mask, SCALE, 3, False, 1.0, grad_out)
    second = run_fused(q, k, v, mask, SCALE, 3, False, 1.0, grad_out)
    for a, b in zip([first[0], first[1], *first[2]], [second[0], second[1], *second[2]], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    ("k_keep", "is_fraction", "temperature", "message"),
    [(0, False, 1.0, "k_keep"), (2.5, False, 1.0, "k_keep"), (1.0, True, 1.0, "k_keep"),
     (2, False, 0.0, "temperature")],
)
def test_rejects_bad_parameters(k_keep, is_fraction, temperature, message, device):
    q, k, v = make_qkv(1, 1, 1, 2, 4, 16, 16, torch.float32, device)
    with pytest.raises(ValueError, match=message):
        fused.topk_attention_forward(q, k, v, AttentionMask(), SCALE, k_keep, is_fraction, temperature)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("kind", list(MASKS))
def test_larger_grid(kind, head_dim, dtype, device):
    lq = 70 if kind in SQUARE else 50
    q, k, v = make_qkv(2, 4, 2, lq, 70, head_dim, head_dim, dtype, device)
    check(q, k, v, MASKS[kind](2, lq, 70, device), 9, scale=head_dim**-0.5)
    check(q, k, v, MASKS[kind](2, lq, 70, device), 0.06, is_fraction=True, temperature=0.7, scale=head_dim**-0.5)
