"""Fused alpha-entmax / sparsemax attention (Triton) against a float64 materialised reference.

The reference is written here from the definition: float64 scores ``scale q k^T + additive``
masked by an allowed-key tensor built from each mask's own definition, alpha-entmax
by bisection (the ``entmax`` package's ``entmax_bisect``; ``sparsemax`` for the exact
check, ``torch.softmax`` for alpha = 1), rows with no allowed key set to zero, and
gradients of q, k, v and alpha by ``torch.autograd``.  Every output of the kernels is
poisoned with NaN before they run (``launch.empty`` is patched), so an element a
kernel forgets to write fails.  Shapes are tiny (blocks of 16 under the interpreter,
so 40 keys make three key blocks and tiles without support are skipped).
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

import entmax  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import attnorm  # noqa: E402
from attnorm.kernels.rules import AttentionMask  # noqa: E402
from attnorm.kernels.triton import attention_entmax, attention_launch, launch  # noqa: E402
from attnorm.kernels.triton.attention_entmax import (  # noqa: E402
    _gap_histogram,
    _histogram_floor,
    entmax_attention_backward,
    entmax_attention_forward,
)
from tests.conftest import fused_blocks, poisoned_empty, slow_under_interpreter  # noqa: E402

SCALE = 0.5
F64 = torch.float64
TOLERANCES = {  # (atol, rtol) for outputs and gradients
    torch.float64: (1e-9, 1e-8),
    torch.float32: (5e-5, 5e-4),
    torch.float16: (2e-2, 2e-2),
    torch.bfloat16: (8e-2, 5e-2),
}


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    monkeypatch.setattr(launch, "empty", poisoned_empty)


# ---- reference ---------------------------------------------------------------------------


def reference(q, k, v, keep, additive, scale, alpha, weights_only=False):
    """Float64 ``entmax_alpha(scale q k^T + additive) v`` over the allowed keys; ``alpha`` a float or ``(Hq,)``.

    ``weights_only``: the weights ``(B, Hq, Lq, Lk)`` instead (0 in rows with no allowed key).
    """
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = scale * q @ k.transpose(-1, -2)
    if additive is not None:
        scores = scores + additive.double()
    allowed = scores != -math.inf
    if keep is not None:
        allowed = allowed & keep
    # The limit of a row holding +inf scores: uniform over them, whatever alpha (no gradient reaches its scores).
    infinite = allowed & (scores == math.inf)
    posinf_row = infinite.any(-1, keepdim=True)
    # Finite fill: the package's bisection needs a finite max (rows with no allowed key are zeroed below).
    filled = torch.where(allowed, scores, torch.where(allowed.any(-1, keepdim=True), -1e30, 0.0))
    filled = torch.where(posinf_row, 0.0, filled)
    if isinstance(alpha, float) and alpha == 1:
        weights = torch.softmax(filled, -1)
    else:  # softmax for heads at alpha = 1 (the bisection divides by alpha - 1)
        softmax_head = (alpha == 1).view(1, -1, 1, 1)
        bisected = entmax.entmax_bisect(filled, torch.where(softmax_head, 1.5, alpha.view(1, -1, 1, 1)), dim=-1,
                                        n_iter=100)
        weights = torch.where(softmax_head, torch.softmax(filled, -1), bisected)
    uniform = infinite / infinite.sum(-1, keepdim=True).clamp_min(1)
    weights = torch.where(posinf_row, uniform.to(weights.dtype), weights) * allowed.any(-1, keepdim=True)
    return weights if weights_only else weights @ v


def inputs(batch, heads, kv_heads, lq, lk, dim, value_dim=None, dtype=torch.float32, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, lq, dim, generator=gen)
    k = torch.randn(batch, kv_heads, lk, dim, generator=gen)
    v = torch.randn(batch, kv_heads, lk, value_dim or dim, generator=gen)
    grad = torch.randn(batch, heads, lq, value_dim or dim, generator=gen)
    return [t.to(dtype).to(device) for t in (q, k, v, grad)]


def run_kernels(q, k, v, grad, mask, alpha=1.5, alpha_heads=None, alpha_grad=True):
    out, stats, _ = entmax_attention_forward(q, k, v, mask, SCALE, alpha, alpha_heads)
    dq, dk, dv, d_alpha, _, _ = entmax_attention_backward(q, k, v, out, grad, stats, mask, SCALE, alpha,
                                                          alpha_heads, alpha_grad)
    return out, stats, (dq, dk, dv), d_alpha


def run_reference(q, k, v, grad, keep, additive, alpha, alpha_heads=None):
    """Output, gradients of q, k, v and alpha per head (None for alpha = 1) of the reference."""
    leaves = [t.detach().double().cpu().requires_grad_() for t in (q, k, v)]
    heads = q.shape[1]
    if alpha_heads is not None:
        alpha_ref = alpha_heads.detach().double().cpu().requires_grad_()
    elif alpha == 1:
        alpha_ref = 1.0
    else:
        alpha_ref = torch.full((heads,), float(alpha), dtype=torch.float64, requires_grad=True)
    keep = None if keep is None else keep.cpu()
    additive = None if additive is None else additive.cpu()
    out = reference(*leaves, keep, additive, SCALE, alpha_ref)
    wrt = leaves + ([alpha_ref] if isinstance(alpha_ref, torch.Tensor) else [])
    grads = torch.autograd.grad(out, wrt, grad.double().cpu())
    return out, grads[:3], grads[3] if len(grads) > 3 else None


def assert_close(actual, expected, dtype):
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(actual.double().cpu(), expected.double(), atol=atol, rtol=rtol)


def check(q, k, v, grad, mask, keep, additive, alpha=1.5, alpha_heads=None):
    """Outputs and every gradient of the kernels equal the reference's (alpha's per head, summed)."""
    out, stats, grads, d_alpha = run_kernels(q, k, v, grad, mask, alpha, alpha_heads)
    expected_out, expected_grads, expected_alpha = run_reference(q, k, v, grad, keep, additive, alpha, alpha_heads)
    assert out.dtype == q.dtype and out.shape == expected_out.shape
    assert stats.shape == (*q.shape[:3], 3)
    assert stats.dtype == (torch.float64 if q.dtype == torch.float64 else torch.float32)
    assert_close(out, expected_out, q.dtype)
    for actual, expected, source in zip(grads, expected_grads, (q, k, v), strict=True):
        assert actual.dtype == source.dtype and actual.shape == source.shape
        assert_close(actual, expected, q.dtype)
    assert d_alpha.shape == (q.shape[1],) and d_alpha.dtype == stats.dtype  # the accumulation dtype
    if expected_alpha is None:
        assert torch.equal(d_alpha, torch.zeros_like(d_alpha))
    else:
        atol, rtol = TOLERANCES[q.dtype]
        torch.testing.assert_close(d_alpha.double().cpu(), expected_alpha, atol=max(atol, 1e-4) * 10,
                                   rtol=max(rtol, 1e-4) * 10)


# ---- masks, each with its allowed keys built from its definition -------------------------


def structured(mask, batch, lq, lk, device):
    start, stop = mask.key_range(batch, lq, lk, device)
    return AttentionMask(start, stop, None, None)


def rows_and_keys(lq, lk):
    return torch.arange(lq)[:, None], torch.arange(lk)[None, :]


def causal_case(batch, lq, lk, device, diagonal):
    i, j = rows_and_keys(lq, lk)
    return structured(attnorm.causal_mask(diagonal), batch, lq, lk, device), j <= i + diagonal, None


def window_case(batch, lq, lk, device):
    window, diagonal = 7, lk - lq
    i, j = rows_and_keys(lq, lk)
    keep = (j <= i + diagonal) & (j > i + diagonal - window)
    return structured(attnorm.sliding_window_mask(window, diagonal), batch, lq, lk, device), keep, None


def padding_case(batch, lq, lk, device, lengths=(40, 9), causal=False):
    lengths = torch.tensor(lengths[:batch])
    i, j = rows_and_keys(lq, lk)
    keep = (j < lengths[:, None, None, None]) & ((j <= i) if causal else True)
    mask = attnorm.key_padding_mask(lengths)
    if causal:
        mask = mask & attnorm.causal_mask()
    return structured(mask, batch, lq, lk, device), keep, None


def documents_case(batch, lq, lk, device, causal):
    bounds = torch.tensor([0, 5, 21, 22])
    document = torch.searchsorted(bounds, torch.arange(lk), right=True)
    keep = document[:, None] == document[None, :]
    mask = attnorm.document_mask(bounds)
    if causal:
        i, j = rows_and_keys(lq, lk)
        keep, mask = keep & (j <= i), mask & attnorm.causal_mask()
    return structured(mask, batch, lq, lk, device), keep, None


def dense_case(batch, lq, lk, device):
    keep = torch.rand(batch, 1, lq, lk, generator=torch.Generator().manual_seed(3)) > 0.4
    return AttentionMask(None, None, keep.to(device), None), keep, None


def additive_case(batch, lq, lk, device):
    gen = torch.Generator().manual_seed(4)
    additive = torch.where(torch.rand(lq, lk, generator=gen) > 0.3, torch.randn(lq, lk, generator=gen), -math.inf)
    return AttentionMask(None, None, None, additive.to(device)), None, additive


def combined_case(batch, lq, lk, device):
    """Key padding and causal intervals, a dense mask per head and an additive mask together."""
    mask, keep, _ = padding_case(batch, lq, lk, device, lengths=(30, 12), causal=True)
    gen = torch.Generator().manual_seed(5)
    dense = torch.rand(1, 2, lq, lk, generator=gen) > 0.2
    additive = 0.5 * torch.randn(batch, 1, lq, lk, generator=gen)
    return mask._replace(dense=dense.to(device), additive=additive.to(device)), keep & dense, additive


CASES = {  # name: (Lq, Lk, builder(batch, lq, lk, device) -> (mask, keep, additive))
    "none": (40, 33, lambda b, lq, lk, d: (AttentionMask(), None, None)),
    "causal": (40, 40, lambda b, lq, lk, d: causal_case(b, lq, lk, d, 0)),
    "causal-bottom-right": (20, 40, lambda b, lq, lk, d: causal_case(b, lq, lk, d, lk - lq)),
    "causal-top-left-rectangular": (40, 24, lambda b, lq, lk, d: causal_case(b, lq, lk, d, 0)),
    "sliding-window": (24, 40, window_case),
    "key-padding": (40, 40, padding_case),
    "documents": (40, 40, lambda b, lq, lk, d: documents_case(b, lq, lk, d, False)),
    "documents-causal": (40, 40, lambda b, lq, lk, d: documents_case(b, lq, lk, d, True)),
    "dense": (40, 40, dense_case),
    "additive": (40, 40, additive_case),
    "combined": (40, 40, combined_case),
}


# ---- tests -------------------------------------------------------------------------------


SPARSEMAX_MASKS = ("none", "causal-bottom-right", "combined")  # α = 2 under the others with -m slow
ONLY_SPARSEMAX = ("none", "combined")  # α = 1.5 under these with -m slow (4-5 s each interpreted)
MASK_CASES = [pytest.param(case, alpha, id=f"{case}-{alpha}",
                           marks=slow_under_interpreter(case in SPARSEMAX_MASKS if alpha == 2.0
                                                        else case not in ONLY_SPARSEMAX))
              for alpha in (2.0, 1.5) for case in CASES]


@pytest.mark.parametrize(("case", "alpha"), MASK_CASES)
def test_matches_reference_under_every_mask(case, alpha, device):
    lq, lk, build = CASES[case]
    batch = 2 if case in ("key-padding", "combined") else 1
    q, k, v, grad = inputs(batch, 2, 2, lq, lk, 16, device=device)
    mask, keep, additive = build(batch, lq, lk, device)
    check(q, k, v, grad, mask, keep, additive, alpha)


WEIGHTED_CASES = [pytest.param(case, alpha, id=f"{case}-{alpha}", marks=slow_under_interpreter(keep))
                  for case, alpha, keep in [("causal", 2.0, True), ("combined", 1.5, True), ("causal", 1.0, True),
                                            ("combined", 1.25, True), ("combined", 2.0, False),
                                            ("causal", 1.5, False), ("combined", 1.0, False),
                                            ("causal", 1.25, False)]]


@pytest.mark.parametrize(("case", "alpha"), WEIGHTED_CASES)
def test_weighted_values_stand_in_for_the_row_pass(case, alpha, device):
    """``forward(weighted=True)``'s ``W`` is ``sum g v / sum g`` with ``g = p^(2 - alpha)`` (float64, from the
    reference's weights), and the backward given ``W`` (``delta = dO . W``, no row pass) matches the reference."""
    lq, lk, build = CASES[case]
    batch = 2 if case == "combined" else 1
    q, k, v, grad = inputs(batch, 2, 1, lq, lk, 16, device=device, seed=11)  # GQA: two query heads share k, v
    mask, keep, additive = build(batch, lq, lk, device)
    out, stats, w = entmax_attention_forward(q, k, v, mask, SCALE, alpha, None, weighted=True)
    leaves = [t.double().cpu() for t in (q, k, v)]
    alpha_ref = 1.0 if alpha == 1 else torch.full((2,), alpha, dtype=torch.float64)
    p = reference(*leaves, None if keep is None else keep.cpu(), None if additive is None else additive.cpu(), SCALE,
                  alpha_ref, weights_only=True)
    g = p if alpha == 1 else p ** (2 - alpha) * (p > 0)  # (p > 0): 0 ** 0 is 1 for sparsemax
    total = g.sum(-1, keepdim=True)
    expected = (g @ leaves[2].repeat_interleave(2, 1)) / torch.where(total > 0, total, 1.0)
    assert w.shape == out.shape and w.dtype == stats.dtype
    assert_close(w, expected, q.dtype)
    dq, dk, dv, d_alpha, _, _ = entmax_attention_backward(q, k, v, out, grad, stats, mask, SCALE, alpha, None, False,
                                                          weighted=w)
    assert d_alpha is None
    _, expected_grads, _ = run_reference(q, k, v, grad, keep, additive, alpha)
    for actual, wanted in zip((dq, dk, dv), expected_grads, strict=True):
        assert_close(actual, wanted, q.dtype)


@pytest.mark.parametrize("case", ["causal", "sliding-window", "combined"])
def test_key_blocks_of_32_with_backward_steps_of_16(case, blocks_of_32, launched_kernels, device):
    """Blocks of 32 (CUDA's 64, scaled down): the backward kernels then step 16 keys (rows, dq) or queries (dk/dv)."""
    lq, lk, build = CASES[case]
    batch = 2 if case == "combined" else 1
    q, k, v, grad = inputs(batch, 2, 1, lq, lk, 16, device=device)
    mask, keep, additive = build(batch, lq, lk, device)
    check(q, k, v, grad, mask, keep, additive, 1.5)
    blocks = {name: (kwargs["BLOCK_M"], kwargs["BLOCK_N"]) for name, kwargs in launched_kernels.items()}
    assert blocks["_entmax_attention_forward_kernel"] == (32, 32)
    assert blocks["_entmax_attention_rows_kernel"] == blocks["_entmax_attention_dq_kernel"] == (32, 16)
    assert blocks["_entmax_attention_dkdv_kernel"] == (16, 32)


@pytest.mark.parametrize("alpha", [1.5, 1.3])
def test_whole_block_backward_steps_where_four_warps_run(alpha, blocks_of_32, launched_kernels, monkeypatch, device):
    """Where the 4-warp options run (narrow_cuda: CUDA, 2-byte inputs, head dims up to 64) the row and dq kernels
    step the forward's whole block of keys for a constant alpha (1, 1.5, 2), half a block for a runtime alpha;
    dk/dv steps whole query blocks for every alpha (its half blocks were the configuration of a wrong dk on an
    H200); patched on here."""
    monkeypatch.setattr(attention_entmax, "narrow_cuda", lambda shape, q: True)
    lq, lk, build = CASES["causal"]
    q, k, v, grad = inputs(1, 2, 1, lq, lk, 16, device=device)
    mask, keep, additive = build(1, lq, lk, device)
    check(q, k, v, grad, mask, keep, additive, alpha)
    blocks = {name: (kwargs["BLOCK_M"], kwargs["BLOCK_N"]) for name, kwargs in launched_kernels.items()}
    step = 32 if alpha == 1.5 else 16
    assert blocks["_entmax_attention_rows_kernel"] == blocks["_entmax_attention_dq_kernel"] == (32, step)
    assert blocks["_entmax_attention_dkdv_kernel"] == (32, 32)


@pytest.mark.parametrize("alpha", [1.0, 1.25, 1.75])
def test_other_alphas(alpha, device):
    q, k, v, grad = inputs(1, 2, 2, 24, 40, 16, device=device)
    mask, keep, additive = causal_case(1, 24, 40, device, 16)
    check(q, k, v, grad, mask, keep, additive, alpha)


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["gqa", "mqa"])
def test_grouped_query_heads_with_alpha_per_head(kv_heads, device):
    q, k, v, grad = inputs(1, 4, kv_heads, 40, 40, 16, device=device, seed=1)
    mask, keep, additive = causal_case(1, 40, 40, device, 0)
    alpha_heads = torch.tensor([1.5, 2.0, 1.3, 1.8], device=device)
    check(q, k, v, grad, mask, keep, additive, alpha=1.5, alpha_heads=alpha_heads)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("alpha", [2.0, 1.5])
def test_dtypes(dtype, alpha, device):
    q, k, v, grad = inputs(1, 2, 2, 40, 40, 16, dtype=dtype, device=device, seed=2)
    mask, keep, additive = causal_case(1, 40, 40, device, 0)
    check(q, k, v, grad, mask, keep, additive, alpha)


@pytest.mark.parametrize(("dim", "value_dim"), [(16, 16), (24, 24), (64, 64), (24, 40)])
def test_head_dims(dim, value_dim, device):
    q, k, v, grad = inputs(1, 2, 1, 20, 24, dim, value_dim, device=device, seed=3)
    mask, keep, additive = causal_case(1, 20, 24, device, 4)
    check(q, k, v, grad, mask, keep, additive, 1.5)


@pytest.mark.parametrize(("lq", "lk", "diagonal"), [(1, 20, 19), (1, 1, 0), (20, 1, None)])
def test_single_query_or_key(lq, lk, diagonal, device):
    q, k, v, grad = inputs(2, 2, 1, lq, lk, 16, device=device, seed=4)
    if diagonal is None:
        mask, keep, additive = AttentionMask(), None, None
    else:
        mask, keep, additive = causal_case(2, lq, lk, device, diagonal)
    check(q, k, v, grad, mask, keep, additive, 1.5)


def test_sparsemax_weights_are_exact(device):
    """With v = I the output is the weights: float64 sparsemax to rounding, exact zeros off the support."""
    q, k, _, grad = inputs(1, 2, 2, 24, 16, 16, dtype=torch.float64, device=device, seed=5)
    v = torch.eye(16, dtype=torch.float64, device=device).expand(1, 2, 16, 16)
    out, _, _ = entmax_attention_forward(q, k, v, AttentionMask(), SCALE, 2.0, None)
    expected = entmax.sparsemax(SCALE * q.cpu() @ k.cpu().transpose(-1, -2), -1)
    torch.testing.assert_close(out.cpu(), expected, atol=1e-14, rtol=0)
    assert torch.equal(out.cpu() == 0, expected == 0)
    assert (expected == 0).float().mean() > 0.5  # sparse enough that whole tiles are skipped


@pytest.mark.parametrize("alpha", [2.0, 1.5])
def test_rows_without_allowed_keys_give_zeros(alpha, device):
    """Key length 0 in batch 1 and a dense row with no key: zero output, zero and finite gradients."""
    q, k, v, grad = inputs(2, 2, 2, 24, 24, 16, device=device, seed=6)
    mask, keep, _ = padding_case(2, 24, 24, device, lengths=(24, 0))
    dense = torch.ones(1, 1, 24, 24, dtype=torch.bool)
    dense[..., 3, :] = False
    mask = mask._replace(dense=dense.to(device))
    out, _, (dq, dk, dv), d_alpha = run_kernels(q, k, v, grad, mask, alpha)
    for t in (out, dq, dk, dv, d_alpha):
        assert torch.isfinite(t).all()
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.equal(out[:, :, 3], torch.zeros_like(out[:, :, 3]))
    for t in (dq[1], dk[1], dv[1], dq[:, :, 3]):
        assert torch.equal(t, torch.zeros_like(t))
    check(q, k, v, grad, mask, keep & dense, None, alpha)


def test_key_blocks_outside_every_interval_are_never_read(blocks_of_16, device):
    """Batch 1 may attend only keys < 12: its key blocks from 16 on (blocks of 16) hold NaN, which must not leak."""
    q, k, v, grad = inputs(2, 2, 1, 24, 48, 16, device=device, seed=13)
    k[1, :, 16:] = math.nan
    v[1, :, 16:] = math.nan
    mask, keep, _ = padding_case(2, 24, 48, device, lengths=(48, 12))
    out, _, (dq, dk, dv), d_alpha = run_kernels(q, k, v, grad, mask, 1.5)
    for t in (out, dq, dk[:, :, :16], dv[:, :, :16], d_alpha):
        assert torch.isfinite(t).all()
    assert torch.equal(dk[1, :, 16:], torch.zeros_like(dk[1, :, 16:]))
    assert torch.equal(dv[1, :, 16:], torch.zeros_like(dv[1, :, 16:]))
    expected_out, _, _ = run_reference(q, k.nan_to_num(), v.nan_to_num(), grad, keep, None, 1.5)
    assert_close(out, expected_out, q.dtype)


@pytest.mark.slow  # attention_launch.SKIP_EMPTY_TILES is off by default (slower on an H200)
@pytest.mark.parametrize("alpha", [2.0, 1.5])
@pytest.mark.parametrize("case", ["causal", "documents-causal"])
def test_skipping_tiles_without_support_changes_no_bit(case, alpha, blocks_of_16, monkeypatch, device):
    """``attention_launch.SKIP_EMPTY_TILES`` (off by default) skips the products of tiles where no row has
    support; what it skips adds only zeros, so both give the same bits, and the reference's values."""
    lq, lk, build = CASES[case]
    q, k, v, grad = inputs(1, 2, 1, lq, lk, 16, device=device, seed=21)
    mask, keep, additive = build(1, lq, lk, device)
    plain = run_kernels(q, k, v, grad, mask, alpha)
    monkeypatch.setattr(attention_launch, "SKIP_EMPTY_TILES", True)
    skipped = run_kernels(q, k, v, grad, mask, alpha)
    for a, b in zip([plain[0], *plain[2], plain[3]], [skipped[0], *skipped[2], skipped[3]], strict=True):
        assert torch.equal(a, b)
    check(q, k, v, grad, mask, keep, additive, alpha)


@pytest.mark.parametrize("alpha", [2.0, "per-head",
                                   *(pytest.param(a, marks=pytest.mark.slow) for a in (1.5, 1.25, 1.0))])
def test_posinf_rows_are_uniform_over_their_infinite_keys(alpha, device):
    """+inf scores (additive) in masked and inner key blocks: such a row's weights are uniform over its +inf keys
    (also where a mask hides one of them, and in a row whose allowed keys are all +inf), its scores and alpha get
    no gradient, ``dv`` takes its ``dO / count``; the other rows match the reference; a NaN beside +inf is NaN."""
    q, k, v, grad = inputs(1, 2, 2, 24, 40, 16, device=device, seed=17)
    mask, keep, _ = causal_case(1, 24, 40, device, 16)
    additive = torch.zeros(24, 40)
    additive[1, [2, 17, 33]] = math.inf  # three key blocks of 16; key 33 is past row 1's causal limit (17)
    additive[6, 0] = math.inf  # a single +inf key
    additive[9, :] = math.inf  # every allowed key +inf
    additive[20, [5, 36]] = math.inf  # both inside row 20's range (keys <= 36)
    mask = mask._replace(additive=additive.to(device))
    alpha_heads = torch.tensor([1.0, 1.5], device=device) if alpha == "per-head" else None
    alpha = 1.5 if alpha == "per-head" else alpha
    check(q, k, v, grad, mask, keep, additive, alpha, alpha_heads)
    out, _, (dq, dk, dv), d_alpha = run_kernels(q, k, v, grad, mask, alpha, alpha_heads)
    torch.testing.assert_close(out[0, :, 1], v[0, :, [2, 17]].mean(1))
    torch.testing.assert_close(out[0, :, 6], v[0, :, 0])
    assert torch.equal(dq[0, :, [1, 6, 9, 20]], torch.zeros_like(dq[0, :, [1, 6, 9, 20]]))
    additive[20, 9] = math.nan  # NaN beside +inf: the row is NaN
    out, _, (dq, _, _), d_alpha = run_kernels(q, k, v, grad, mask._replace(additive=additive.to(device)), alpha,
                                              alpha_heads)
    assert out[0, :, 20].isnan().all() and dq[0, :, 20].isnan().all()
    assert torch.isfinite(out[0, :, :20]).all() and torch.isfinite(dq[0, :, :20]).all()


@triton.jit
def _floor_kernel(Z, OUT, power, BLOCK_M: tl.constexpr, N: tl.constexpr):
    rows = tl.arange(0, BLOCK_M)
    z = tl.load(Z + rows[:, None] * N + tl.arange(0, N)[None, :])
    tl.store(OUT + rows, _histogram_floor(_gap_histogram(z, BLOCK_M), power, tl.float32))


def _threshold(z, power):
    """Float64 root of ``sum [z - tau]_+^p = 1`` per row, by bisection on [-1, 0]."""
    low, high = torch.full(z.shape[:1], -1.0, dtype=F64), torch.zeros(z.shape[:1], dtype=F64)
    for _ in range(200):
        middle = (low + high) / 2
        above = (z - middle[:, None]).clamp_min(0).pow(power).sum(1) >= 1
        low, high = torch.where(above, middle, low), torch.where(above, high, middle)
    return low


@pytest.mark.parametrize("alpha", [2.0, 1.5, 1.25, 1.7])
def test_histogram_floor_is_a_lower_bound_within_a_bin(alpha, device):
    """The first pass's gap histogram bounds tau from below, by at most a bin (1/16) and the margin: random rows,
    scores on the bin edges (ties with them), one key, equal keys, keys below -1, a single dominant key."""
    gen = torch.Generator().manual_seed(9)
    n = 64
    z = torch.randn(16, n, generator=gen, dtype=F64) * torch.linspace(0.05, 3, 16, dtype=F64)[:, None]
    z[4] = torch.randint(-20, 1, (n,), generator=gen).to(F64) / 16  # on the edges
    z[5] = -math.inf
    z[5, 7] = 0.0  # one key
    z[6] = 0.0  # every key equal
    z[7] = -2.0 - torch.rand(n, generator=gen, dtype=F64)  # all far below the max, but the max itself
    z[8] = torch.where(torch.rand(n, generator=gen) < 0.5, -math.inf, z[8])  # masked keys
    z = z - z.amax(1, keepdim=True).clamp_min(-1e30)  # each row's max at 0
    z[7, 3] = 0.0
    z[9] = -torch.randint(1, 24, (n,), generator=gen).to(F64) / 16 + 1e-3  # just above the edges: a tight bound
    z[9, 0] = 0.0
    z = (z * (alpha - 1)).to(torch.float32)  # the kernel's z = (alpha - 1)(s - m)
    power = 1 / (alpha - 1)
    out = torch.full((16,), math.nan, device=device)
    _floor_kernel[(1,)](z.to(device), out, power, 16, n)
    tau = _threshold(z.double().cpu(), power)
    floor = out.double().cpu()
    assert (floor <= tau).all(), (floor - tau)
    assert (floor >= tau - 1 / 16 - 1e-5).all(), (tau - floor)
    # The bound itself, from its definition: every key of (-1, 0] moved down to its bin's lower edge.
    zd = z.double()
    inside = (zd > -1) & (zd <= 0)
    lower = torch.where(inside, -(torch.floor(-zd * 16) + 1) / 16, -math.inf)
    expected = _threshold(lower, power)
    expected = torch.where(expected > -1, expected - (1 + expected.abs()) * 2.0**-20, -1.0)  # the margin
    assert torch.allclose(floor, expected, rtol=0, atol=1e-6), (floor - expected)


@pytest.mark.parametrize("alpha", [2.0, pytest.param(1.5, marks=pytest.mark.slow)])
def test_histogram_floor_saves_threshold_passes_and_changes_no_result(alpha, monkeypatch, device):
    """With ``HISTOGRAM_FLOOR`` off the search starts from Hoelder's bound alone: the same reference results,
    and (counted under the interpreter, where the pass is a Python call) more threshold passes."""
    fused_blocks(monkeypatch, 64)  # a GPU's blocks: one query block, eight key blocks
    q, k, v, grad = inputs(1, 2, 1, 64, 512, 16, device=device, seed=23)
    mask, keep, additive = AttentionMask(), None, None
    calls = []
    original = attention_entmax._newton_sums

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    if device == "cpu":
        monkeypatch.setattr(attention_entmax, "_newton_sums", counted)
    passes = {}
    for floor in (True, False):
        monkeypatch.setattr(attention_entmax, "HISTOGRAM_FLOOR", floor)
        calls.clear()
        check(q, k, v, grad, mask, keep, additive, alpha)
        passes[floor] = len(calls)
    if device == "cpu":
        assert passes[True] < passes[False], passes


def test_nan_scores_give_nan_rows(device):
    q, k, v, grad = inputs(1, 2, 2, 24, 24, 16, device=device, seed=7)
    q[0, 1, 5, 0] = math.nan
    out, _, (dq, _, _), d_alpha = run_kernels(q, k, v, grad, AttentionMask(), 1.5)
    assert out[0, 1, 5].isnan().all() and dq[0, 1, 5].isnan().all() and d_alpha[1].isnan()
    rest = torch.ones(out.shape[:3], dtype=torch.bool)
    rest[0, 1, 5] = False
    assert torch.isfinite(out[rest]).all() and torch.isfinite(dq[rest]).all() and torch.isfinite(d_alpha[0])


def test_backward_is_deterministic(device):
    q, k, v, grad = inputs(1, 4, 2, 40, 40, 16, device=device, seed=8)
    mask, _, _ = causal_case(1, 40, 40, device, 0)
    out, stats, _ = entmax_attention_forward(q, k, v, mask, SCALE, 1.5, None)
    first = entmax_attention_backward(q, k, v, out, grad, stats, mask, SCALE, 1.5, None, True)
    second = entmax_attention_backward(q, k, v, out, grad, stats, mask, SCALE, 1.5, None, True)
    for a, b in zip(first[:4], second[:4], strict=True):
        assert torch.equal(a, b)


def test_no_score_sized_allocation(monkeypatch, device):
    """Every buffer the kernels allocate is O(L): none has both an Lq and an Lk axis."""
    shapes = []
    poisoned = launch.empty

    def recording(shape, dtype, dev):
        shapes.append(tuple(shape))
        return poisoned(shape, dtype, dev)

    monkeypatch.setattr(launch, "empty", recording)
    q, k, v, grad = inputs(1, 2, 2, 40, 24, 16, device=device, seed=9)
    run_kernels(q, k, v, grad, AttentionMask(), 1.5)
    assert shapes and all(not (40 in shape and 24 in shape) for shape in shapes)


def test_without_alpha_gradient_returns_none(device):
    q, k, v, grad = inputs(1, 2, 2, 16, 16, 16, device=device)
    *_, d_alpha = run_kernels(q, k, v, grad, AttentionMask(), 2.0, alpha_grad=False)
    assert d_alpha is None


@pytest.mark.parametrize("alpha", [0.5, 2.5, math.nan])
def test_alpha_outside_the_supported_range_raises(alpha, device):
    q, k, v, _ = inputs(1, 1, 1, 4, 4, 16, device=device)
    with pytest.raises(ValueError, match="alpha"):
        entmax_attention_forward(q, k, v, AttentionMask(), SCALE, alpha, None)


@pytest.mark.slow
@pytest.mark.parametrize("alpha", [2.0, 1.3])
@pytest.mark.parametrize("dim", [80, 128])
@pytest.mark.parametrize("case", ["causal", "sliding-window", "combined"])
def test_larger_problems(case, dim, alpha, device):
    lq, lk = 130, 130
    batch = 2 if case == "combined" else 1
    q, k, v, grad = inputs(batch, 4, 2, lq, lk, dim, device=device, seed=10)
    if case == "causal":
        mask, keep, additive = causal_case(batch, lq, lk, device, 0)
    elif case == "sliding-window":
        mask, keep, additive = window_case(batch, lq, lk, device)
    else:
        mask, keep, additive = padding_case(batch, lq, lk, device, lengths=(130, 77), causal=True)
        dense = torch.rand(1, 4, lq, lk, generator=torch.Generator().manual_seed(11)) > 0.2
        mask, keep = mask._replace(dense=dense.to(device)), keep & dense
    check(q, k, v, grad, mask, keep, additive, alpha)


@pytest.mark.slow
def test_head_dim_256(device):
    q, k, v, grad = inputs(1, 2, 1, 40, 40, 256, device=device, seed=12)
    mask, keep, additive = causal_case(1, 40, 40, device, 0)
    check(q, k, v, grad, mask, keep, additive, 1.5)
