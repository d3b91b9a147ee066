"""Softcap and sinks on the fused Triton attention kernels, against float64 formulas.

``attnorm.attention(..., softcap=, sinks=)`` with ``backend="triton"`` normalizers runs the
fused kernels (the interpreter on CPU); the blocked and materialised routes are made to
raise, so a call that left the fused route fails.  The reference is written here from
the definitions, in float64: scores ``scale q k^T``, capped with ``torch.tanh``, the
additive mask added, the mask applied, each head's sink appended as a last column that
is always allowed, the normalizer applied to the extended row (``torch.softmax``, the
``entmax`` package's sparsemax and bisection, Self-Adjusted's ``phi(x) softmax(x)``, a
stable sort for top-k), the sink's column dropped, then ``@ v``; Scalable-Softmax's ``n``
and top-k's fraction count the real allowed keys only.  Gradients of q, k, v, the sinks
and the learnable parameters come from ``torch.autograd`` through it.  Every buffer the
kernels allocate is poisoned with NaN first.

By default every family meets each modifier under a causal mask, and one family per
kernel path meets every mask; the other families' mask sweeps, and compiling every
modified kernel for sm_90 (no GPU needed), are slow tests.
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch

import attnorm

pytest.importorskip("triton")
entmax = pytest.importorskip("entmax")

from attnorm.kernels.triton import launch  # noqa: E402
from attnorm.routes.fused import _triton_handles_normalized_additive_self_adjusted  # noqa: E402
from tests.conftest import DEVICE, poisoned_empty, slow_under_interpreter  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter evaluates masked lanes

B, H, HKV, LQ, LK, D = 2, 2, 1, 16, 23, 16  # one query block, two key blocks of 16 (interpreted); GQA
SCALE = D**-0.5
SOFTCAP = 2.0
SINKS = (1.5, -0.5)
attention_module = importlib.import_module("attnorm.attention")


@pytest.fixture(autouse=True)
def fused_only(monkeypatch):
    """Poisoned kernel buffers; tiny shapes are not decoding; the blocked and materialised routes raise."""
    def elsewhere(*args, **kwargs):
        raise AssertionError("the call left the fused route")

    monkeypatch.setattr(launch, "empty", poisoned_empty)
    monkeypatch.setattr(attention_module, "DECODING_ROWS", 0)
    monkeypatch.setattr(attention_module, "blocked_attention", elsewhere)
    monkeypatch.setattr(attention_module, "materialised_attention", elsewhere)
    monkeypatch.setattr(attention_module, "scaled_sdpa", elsewhere)


# ---- normalizers: the module under test and its float64 definition ----------------------------


def _masked(x, allowed):
    """``x`` at -inf off ``allowed``; 0 in rows with nothing allowed (their weights are zeroed after)."""
    return torch.where(allowed.any(-1, keepdim=True), x.masked_fill(~allowed, -math.inf), 0.0)


def _softmax(x, allowed, multiplier):
    return torch.softmax(_masked(x * multiplier, allowed), -1)


def _entmax(alpha):
    def normalize(x, allowed, n, params):
        filled = torch.where(allowed, x, -1e30)
        if alpha == 2:
            return entmax.sparsemax(filled, -1)
        return entmax.entmax_bisect(filled, alpha, dim=-1, n_iter=100)

    return normalize


def _learnable_entmax(x, allowed, n, params):
    (alpha_logit,) = params
    alpha = (1 + torch.sigmoid(alpha_logit)).view(1, H, 1, 1)
    return entmax.entmax_bisect(torch.where(allowed, x, -1e30), alpha, dim=-1, n_iter=100)


def _ssmax(x, allowed, n, params):
    s, bias = params
    return _softmax(x, allowed, s * torch.log(n.clamp_min(1).double()) + bias)


def _self_adjusted(x, allowed, normalized):
    """``phi(x) softmax(x)``, ``phi = x`` or ``(x - low) / (high - low)`` (0 without a span).

    ``low = min(min x, 0)`` and ``high = max(max x, 0)`` over the allowed entries.
    """
    weights = _softmax(x, allowed, 1.0)
    if not normalized:
        return x * weights
    low = torch.where(allowed, x, math.inf).amin(-1, keepdim=True).clamp_max(0)
    high = torch.where(allowed, x, -math.inf).amax(-1, keepdim=True).clamp_min(0)
    span = high - low
    return torch.where(span > 0, (x - low) / torch.where(span > 0, span, 1.0), 0.0) * weights


def _top_k(keep, temperature):
    """softmax(x / T) over the ``keep`` largest allowed entries (ties: the lower index, so the sink loses them).

    A fraction ``keep < 1`` keeps ``max(1, ceil(keep n))`` with ``n`` the real allowed keys;
    never more than the allowed entries, the sink included.
    """
    def normalize(x, allowed, n, params):
        count = torch.ceil(n * keep - 1e-9).clamp_min(1) if keep < 1 else torch.full_like(n, keep)
        count = torch.minimum(count, allowed.sum(-1, keepdim=True))
        order = torch.argsort(torch.where(allowed, x, -math.inf).detach(), dim=-1, descending=True, stable=True)
        kept = allowed & (torch.argsort(order, dim=-1) < count)
        return _softmax(x, kept, 1 / temperature)

    return normalize


FAMILIES = {
    # name: (the normalizer on the fused route, reference(x, allowed, n, params) over the extended row)
    "sparsemax": (lambda: attnorm.Sparsemax(backend="triton"), _entmax(2)),
    "entmax15": (lambda: attnorm.Entmax(1.5, backend="triton"), _entmax(1.5)),
    "entmax_learnable": (
        lambda: attnorm.Entmax(1.3, learnable=True, num_heads=H, backend="triton"), _learnable_entmax
    ),
    "softmax_T": (lambda: attnorm.Softmax(temperature=0.6, backend="triton"),
                  lambda x, allowed, n, params: _softmax(x, allowed, 1 / 0.6)),
    "ssmax": (lambda: attnorm.ScalableSoftmax(s=0.5, bias=0.2, backend="triton"),
              lambda x, allowed, n, params: _softmax(x, allowed, 0.5 * torch.log(n.clamp_min(1).double()) + 0.2)),
    "ssmax_learnable": (lambda: attnorm.ScalableSoftmax(s=0.5, bias=0.2, learnable=True, num_heads=H,
                                                        backend="triton"), _ssmax),
    "ssmax_shared": (lambda: attnorm.ScalableSoftmax(s=0.5, bias=0.2, learnable=True, backend="triton"), _ssmax),
    "sa_plain": (lambda: attnorm.SelfAdjustedSoftmax(normalized=False, backend="triton"),
                 lambda x, allowed, n, params: _self_adjusted(x, allowed, False)),
    "sa_normalized": (lambda: attnorm.SelfAdjustedSoftmax(backend="triton"),
                      lambda x, allowed, n, params: _self_adjusted(x, allowed, True)),
    "topk_int": (lambda: attnorm.TopKSoftmax(3, temperature=0.7, backend="triton"), _top_k(3, 0.7)),
    "topk_frac": (lambda: attnorm.TopKSoftmax(0.3, temperature=0.7, backend="triton"), _top_k(0.3, 0.7)),
}

# ---- masks ------------------------------------------------------------------------------------------


def _bool_mask():
    mask = torch.rand(B, 1, LQ, LK, generator=torch.Generator().manual_seed(3)) > 0.4
    mask[:, :, 3] = False  # a row whose real keys are all masked
    return mask


def _additive_mask():
    gen = torch.Generator().manual_seed(4)
    additive = torch.where(torch.rand(LQ, LK, generator=gen) > 0.3, torch.randn(LQ, LK, generator=gen), -math.inf)
    additive[5] = -math.inf
    return additive


def _posinf_mask():
    """Additive, with +inf scores: in masked and inner key blocks, a row of them, one beside -inf."""
    additive = torch.zeros(LQ, LK, dtype=torch.float64)
    additive[1, [2, 20]] = math.inf
    additive[4] = math.inf
    additive[9, 0], additive[9, 5] = math.inf, -math.inf
    return additive


MASKS = {
    "none": lambda: None,
    "causal": lambda: attnorm.causal_mask(LK - LQ),
    "padding": lambda: attnorm.key_padding_mask(torch.tensor([17, 0])),  # batch 1: every real key masked
    "bool": _bool_mask,
    "additive": _additive_mask,
    "posinf": _posinf_mask,
}


def allowed_and_additive(attn_mask):
    """The mask as ``(allowed (B, H, LQ, LK) bool, additive or None)`` in float64, from its own definition."""
    if attn_mask is None:
        return torch.ones(B, H, LQ, LK, dtype=torch.bool), None
    if isinstance(attn_mask, attnorm.StructuredMask):
        return attn_mask.materialize(torch.Size([B, H, LQ, LK])).expand(B, H, LQ, LK), None
    if attn_mask.dtype == torch.bool:
        return attn_mask.expand(B, H, LQ, LK), None
    return torch.ones(B, H, LQ, LK, dtype=torch.bool), attn_mask.double()


# ---- reference -------------------------------------------------------------------------------------


def reference(normalize, params, q, k, v, attn_mask, softcap, sinks):
    """float64 ``normalize(extended row) [:, :LK] @ v`` (module docstring)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    x = SCALE * q @ k.transpose(-1, -2)
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)
    allowed, additive = allowed_and_additive(attn_mask)
    if additive is not None:
        x = x + additive
    allowed = allowed & (x != -math.inf)
    n = allowed.sum(-1, keepdim=True)  # the real allowed keys
    if sinks is not None:
        x = torch.cat([x, sinks.view(1, H, 1, 1).expand(B, H, LQ, 1)], -1)
        allowed = torch.cat([allowed, torch.ones(B, H, LQ, 1, dtype=torch.bool)], -1)
    infinite = allowed & (x == math.inf)  # a row holding +inf: uniform over those (the softmax/entmax rule)
    posinf_row = infinite.any(-1, keepdim=True)
    weights = normalize(torch.where(allowed & ~posinf_row, x, 0.0), allowed, n, params)
    uniform = infinite / infinite.sum(-1, keepdim=True).clamp_min(1)
    weights = torch.where(posinf_row, uniform.double(), weights) * allowed.any(-1, keepdim=True)
    return weights[..., :LK] @ v


def on_device(attn_mask):
    """The mask the fused call gets: tensors on the kernels' device (structured masks move themselves)."""
    return attn_mask.to(DEVICE) if isinstance(attn_mask, torch.Tensor) else attn_mask


def check(family, attn_mask, softcap, sinks, dtype=torch.float32, tolerance=5e-4, seed=0, integer=False,
          summed_tolerance=None):
    """The fused route's output and gradients (q, k, v, sinks, parameters) equal the float64 reference's.

    The fused call runs on :data:`DEVICE` (CUDA when present), the reference on the CPU.
    ``integer``: q and k in {-1, 0, 1}, so scores are multiples of ``SCALE`` and tie (with the sinks too).
    ``summed_tolerance``: the tolerance of the sinks' and parameters' gradients (sums over rows), when not
    ``tolerance``.
    """
    build, normalize = FAMILIES[family]
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, LQ, D, generator=gen, dtype=torch.float64) * 2
    k = torch.randn(B, HKV, LK, D, generator=gen, dtype=torch.float64)
    if integer:
        q, k = q.clamp(-1, 1).round(), k.round().clamp(-1, 1)
    v = torch.randn(B, HKV, LK, D, generator=gen, dtype=torch.float64)
    cotangent = torch.randn(B, H, LQ, D, generator=gen, dtype=torch.float64)
    sinks = None if sinks is None else torch.tensor(sinks, dtype=torch.float64)
    normalizer = build().to(DEVICE)
    params = [p for p in normalizer.parameters() if p.requires_grad]
    leaves = [t.to(DEVICE, dtype).requires_grad_() for t in (q, k, v)]
    fused_sinks = None if sinks is None else sinks.float().to(DEVICE).requires_grad_()
    out = attnorm.attention(*leaves, normalizer, attn_mask=on_device(attn_mask), scale=SCALE, softcap=softcap,
                            sinks=fused_sinks)
    wrt = leaves + ([fused_sinks] if sinks is not None else []) + params
    got = torch.autograd.grad(out, wrt, cotangent.to(DEVICE, dtype))

    ref_leaves = [t.to(dtype).double().requires_grad_() for t in (q, k, v)]  # the inputs the kernels get
    ref_sinks = None if sinks is None else sinks.clone().requires_grad_()
    ref_params = [p.detach().double().cpu().requires_grad_() for p in params]
    expected = reference(normalize, ref_params, *ref_leaves, attn_mask, softcap, ref_sinks)
    ref_wrt = ref_leaves + ([ref_sinks] if sinks is not None else []) + ref_params
    wanted = torch.autograd.grad(expected, ref_wrt, cotangent.to(dtype).double())

    assert out.dtype == dtype
    torch.testing.assert_close(out.double().cpu(), expected.detach(), atol=tolerance, rtol=tolerance)
    names = ["q", "k", "v"] + (["sinks"] if sinks is not None else []) + [f"param{i}" for i in range(len(params))]
    for name, actual, reference_grad in zip(names, got, wanted, strict=True):
        assert torch.isfinite(actual).all(), name
        bound = tolerance if summed_tolerance is None or name in ("q", "k", "v") else summed_tolerance
        torch.testing.assert_close(actual.double().cpu(), reference_grad, atol=bound, rtol=bound,
                                   msg=lambda message, name=name: f"{name}: {message}")
    return out


MODIFIERS = {"softcap": (SOFTCAP, None), "sinks": (None, SINKS), "both": (SOFTCAP, SINKS)}
SWEPT_BY_DEFAULT = ("sparsemax", "softmax_T", "sa_normalized", "topk_frac")  # a family per kernel; others: slow


def mask_sweep():
    for family in FAMILIES:
        for mask in ("none", "padding", "bool", "additive"):
            if family.startswith("ssmax") and mask == "additive":
                continue  # Scalable-Softmax's n under an additive mask: the blocked route
            marks = () if family in SWEPT_BY_DEFAULT else pytest.mark.slow
            yield pytest.param(family, mask, marks=marks, id=f"{family}-{mask}")


def modifier_grid():
    """Both modifiers together for every family; each alone for a family per kernel (the rest: slow)."""
    for family in FAMILIES:
        for modifier in MODIFIERS:
            fast = family != "ssmax_shared" and (modifier == "both" or family in SWEPT_BY_DEFAULT)
            marks = slow_under_interpreter(fast) if family != "ssmax_shared" else pytest.mark.slow
            yield pytest.param(family, modifier, marks=marks, id=f"{family}-{modifier}")


@pytest.mark.parametrize("family,modifier", list(modifier_grid()))
def test_each_modifier_under_a_causal_mask(family, modifier):
    check(family, MASKS["causal"](), *MODIFIERS[modifier])


def test_a_cap_far_above_the_scores_keeps_their_relative_precision():
    """float64 scores of ~1e-10 under a cap of 5: ``cap tanh(x / cap)`` is ``x`` to 1e-21 relative, so Self-Adjusted's
    ``(x - low) / (high - low)`` follows the scores.  A tanh written as ``1 - exp(-2|u|)`` cancels here (an error of
    ``cap eps`` ~ 1e-15, all of such a score): every output was off, relatively ~1, before the fused tiles took the
    row kernels' series."""
    build, normalize = FAMILIES["sa_normalized"]
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(B, H, LQ, D, generator=gen, dtype=torch.float64) * 1e-10
    k, v = (torch.randn(B, HKV, LK, D, generator=gen, dtype=torch.float64) for _ in range(2))
    out = attnorm.attention(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), build(), attn_mask=MASKS["causal"](),
                            scale=SCALE, softcap=5.0)
    expected = reference(normalize, [], q, k, v, MASKS["causal"](), 5.0, None)
    torch.testing.assert_close(out.cpu(), expected, atol=1e-10 * expected.abs().max().item(), rtol=1e-9)


def test_a_float64_learnable_alpha_gets_a_float64_gradient(monkeypatch):
    """A float64 module's learnable per-head alpha on the fused route: every gradient (alpha's logit included)
    within 1e-10 of the float64 reference (``entmax_bisect``'s alpha gradient); alpha's was rounded to float32
    (2.5e-8 off)."""
    build = lambda: attnorm.Entmax(1.3, learnable=True, num_heads=H, backend="triton").double()  # noqa: E731
    monkeypatch.setitem(FAMILIES, "entmax_learnable_float64", (build, _learnable_entmax))
    check("entmax_learnable_float64", MASKS["causal"](), None, None, dtype=torch.float64, tolerance=1e-10)


def test_one_learnable_multiplier_shared_by_every_row():
    """Scalable-Softmax with one learnable ``s`` and no mask: ``c`` is a 0-dim tensor."""
    check("ssmax_shared", MASKS["none"](), SOFTCAP, SINKS)


@pytest.mark.parametrize("family,mask", list(mask_sweep()))
def test_softcap_and_sinks_under_every_mask(family, mask):
    if family == "sa_normalized" and mask == "additive" and DEVICE == "cuda" \
            and not _triton_handles_normalized_additive_self_adjusted():
        pytest.skip("Triton < 3.9 breaks the normalized Self-Adjusted backward with an additive mask on CUDA: "
                    "attention() takes the blocked route there (routes/fused.py)")
    check(family, MASKS[mask](), SOFTCAP, SINKS)


@pytest.mark.parametrize("family", ["topk_int", "topk_frac"])
def test_top_k_ties_between_keys_and_the_sink_go_to_the_keys(family):
    out = check(family, MASKS["causal"](), None, (2 * SCALE, SCALE), integer=True)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("family", ["sparsemax", "ssmax"])
def test_a_fully_masked_row_attends_only_its_sink(family):
    out = check(family, MASKS["bool"](), SOFTCAP, SINKS)
    assert (out[:, :, 3] == 0).all()


@pytest.mark.parametrize("family", ["sparsemax", "softmax_T", *(pytest.param(f, marks=pytest.mark.slow)
                                                            for f in ("entmax15", "entmax_learnable"))])
def test_posinf_rows_are_uniform_over_their_infinite_keys(family):
    """+inf additive scores with both modifiers on the entmax kernel: a row holding +inf is uniform over its +inf
    keys (the sink, finite, gets nothing) and gives no gradient to its scores, the sink or the parameters."""
    out = check(family, MASKS["posinf"](), SOFTCAP, SINKS)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("family,dtype", [("entmax15", torch.float16), ("ssmax_learnable", torch.bfloat16),
                                          ("sa_normalized", torch.float16), ("topk_frac", torch.bfloat16)])
def test_half_precision(family, dtype):
    """An H200 (Triton 3.6, 2026-11-26) once gave the capped entmax-kernel dk 90 % wrong here; whole dk/dv
    blocks mended it (H200, 2026-11-27, 346fb76)."""
    check(family, MASKS["bool"](), SOFTCAP, SINKS, dtype=dtype, tolerance=5e-2)


@pytest.mark.parametrize("family", ["ssmax_learnable", "entmax15"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
def test_half_precision_sums_over_rows_take_delta_from_unrounded_weights(family, dtype):
    """The sinks' and a learnable multiplier's gradients sum ``G s`` and ``g delta`` over rows, so a rounding of
    ``delta = dO . W`` adds up: with ``W``'s weights rounded to the input's 2-byte dtype the multiplier's
    gradient here was 0.0027 off in float16 (interpreter) and 0.056 off (of 0.053) in bfloat16 (H200)."""
    if dtype == torch.bfloat16 and DEVICE != "cuda":
        pytest.skip("off CUDA the kernels read bfloat16 as float32 (attention_launch.dot_operands): nothing rounds")
    check(family, MASKS["bool"](), SOFTCAP, SINKS, dtype=dtype, tolerance=5e-2, summed_tolerance=1e-3)


COMPILE_PROGRAM = r"""
import torch

import attnorm
from attnorm.kernels.rules import AttentionMask
from attnorm.kernels.triton import attention_entmax, attention_self_adjusted, attention_topk

B, H, HKV, L, D = 2, 4, 2, 40, 32
for dtype in (torch.float32, torch.float16, torch.float64):
    q, k, v = (torch.randn(B, h, L, D).to(dtype) for h in (H, HKV, HKV))
    start, stop = attnorm.causal_mask().key_range(B, L, L, "cpu")
    dense = torch.ones(B, 1, L, L, dtype=torch.bool)
    for mask in (AttentionMask(start, stop), AttentionMask(dense=dense, additive=torch.zeros(L, L))):
        for softcap, sinks, rows in ((None, None, None), (5.0, None, None), (None, torch.randn(H, 1), None),
                                     (5.0, torch.randn(H, 1), torch.rand(B, H, L))):
            out, stats, _ = attention_entmax.entmax_attention_forward(q, k, v, mask, 0.3, 1.5, None, softcap, sinks,
                                                                   rows)
            attention_entmax.entmax_attention_backward(q, k, v, out, out, stats, mask, 0.3, 1.5, None, True,
                                                       softcap, sinks, rows)
            for normalized in (True, False):
                out, stats, _ = attention_self_adjusted.self_adjusted_attention_forward(q, k, v, mask, 0.3,
                                                                                        normalized, softcap, sinks)
                attention_self_adjusted.self_adjusted_attention_backward(q, k, v, out, out, stats, mask, 0.3,
                                                                         normalized, softcap, sinks)
            for keep, fraction in ((3.0, False), (0.3, True)):
                out, stats, _ = attention_topk.topk_attention_forward(q, k, v, mask, 0.3, keep, fraction, 0.7,
                                                                      softcap, sinks)
                attention_topk.topk_attention_backward(q, k, v, out, out, stats, mask, 0.3, keep, fraction, 0.7,
                                                       softcap, sinks)
assert len(compiled) == 11, sorted(compiled)
"""


@pytest.mark.slow
def test_modified_kernels_compile_for_nvidia_gpus(tmp_path):
    """The kernels, without and with softcap, sinks and the logit multiplier, compile to a cubin for sm_90 (no GPU).

    The stand-in driver and the compile-instead-of-launch patch are test_triton_compile's.
    """
    import os
    import subprocess
    import sys

    import triton

    from tests.kernels.test_triton_compile import PROGRAM

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        pytest.skip("triton's NVIDIA backend (ptxas) is not installed")
    setup = PROGRAM[: PROGRAM.index("from attnorm.kernels import triton as kernels")]
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    result = subprocess.run([sys.executable, "-c", setup + COMPILE_PROGRAM, "90"], env=env, capture_output=True,
                            text=True, timeout=1800)
    assert result.returncode == 0, result.stderr[-4000:]
