"""attention() on the fused route: the torch.library ops, their autograd and the route's choice.

The kernels themselves are checked in depth in tests/kernels/test_attention_*.py; here
``backend="triton"`` forces the fused route (the interpreter on CPU) and the results
go through attention()'s own argument handling, compared with float64 formulas.
"""

from __future__ import annotations

import importlib
import math
import types

import entmax
import pytest
import torch

import attnorm
from attnorm.routes import fused
from tests.conftest import slow_under_interpreter

pytest.importorskip("triton")

B, H, HKV, LQ, LK, D = 2, 4, 2, 9, 13, 16
attention_module = importlib.import_module("attnorm.attention")


@pytest.fixture
def fused_calls(monkeypatch):
    """Counts the fused route's calls; tiny shapes are not treated as decoding."""
    calls = []
    original = fused.attention
    monkeypatch.setattr(attention_module, "DECODING_ROWS", 0)
    monkeypatch.setattr(fused, "attention", lambda *args: calls.append(1) or original(*args))
    return calls


def inputs(device, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, LQ, D, generator=gen, dtype=torch.float64)
    k = torch.randn(B, HKV, LK, D, generator=gen, dtype=torch.float64)
    v = torch.randn(B, HKV, LK, D, generator=gen, dtype=torch.float64)
    return (t.to(device=device, dtype=dtype).requires_grad_() for t in (q, k, v))


def reference(normalize, q, k, v, allowed):
    """normalize(scale q k^T over allowed keys) v in float64, zero rows where nothing is allowed."""
    q, k, v = q.double(), k.double().repeat_interleave(H // HKV, 1), v.double().repeat_interleave(H // HKV, 1)
    scores = (q @ k.transpose(-2, -1) / math.sqrt(D)).masked_fill(~allowed, -math.inf)
    empty = ~allowed.any(-1, keepdim=True)
    weights = normalize(torch.where(empty, 0.0, scores))
    return torch.where(empty, 0.0, weights) @ v


def self_adjusted(x):
    finite = torch.isfinite(x)
    safe = torch.where(finite, x, 0.0)
    low = torch.where(finite, safe, math.inf).amin(-1, keepdim=True).clamp_max(0)
    high = torch.where(finite, safe, -math.inf).amax(-1, keepdim=True).clamp_min(0)
    return torch.where(finite, (safe - low) / (high - low), 0.0) * torch.softmax(x, -1)


CASES = {
    "sparsemax": (lambda: attnorm.Sparsemax(backend="triton"), lambda x: entmax.sparsemax(x, -1)),
    "entmax15": (lambda: attnorm.Entmax(1.5, backend="triton"), lambda x: entmax.entmax15(x, -1)),
    "sa_softmax": (lambda: attnorm.SelfAdjustedSoftmax(backend="triton"), self_adjusted),
    "top3": (lambda: attnorm.TopKSoftmax(3, temperature=0.7, backend="triton"), lambda x: top_k(x, 3, 0.7)),
    "top30%": (lambda: attnorm.TopKSoftmax(0.3, backend="triton"), lambda x: top_k(x, 0.3, 1.0)),
}


def top_k(x, keep, temperature):
    """softmax(x / T) over the `keep` largest allowed scores (a fraction of the allowed count when < 1)."""
    n = torch.isfinite(x).sum(-1, keepdim=True)
    count = torch.ceil(n * keep - 1e-9).clamp_min(1) if keep < 1 else torch.full_like(n, keep)
    rank = torch.argsort(torch.argsort(-x, dim=-1, stable=True), dim=-1)  # 0 for the largest
    kept = (rank < torch.minimum(count, n)) & torch.isfinite(x)
    return torch.softmax((x / temperature).masked_fill(~kept, -math.inf), -1).nan_to_num(0.0)
MASKS = {
    "causal_bottom_right": lambda: attnorm.causal_mask(LK - LQ),
    "window&padding": lambda: attnorm.sliding_window_mask(5, LK - LQ) & attnorm.key_padding_mask(torch.tensor([13, 6])),
    "bool": lambda: torch.rand(B, 1, LQ, LK, generator=torch.Generator().manual_seed(3)) > 0.4,
}


# Top-k's two forms take alternate masks by default (3 s a case interpreted); the rest with -m slow.
ROUTE_CASES = [pytest.param(case, mask, id=f"{case}-{mask}", marks=slow_under_interpreter(
                   not case.startswith("top") or (mask == "window&padding") == (case == "top30%")))
               for case in CASES for mask in MASKS]


@pytest.mark.parametrize(("case", "mask"), ROUTE_CASES)
def test_fused_route_matches_float64_formulas(case, mask, device, fused_calls):
    build, normalize = CASES[case]
    q, k, v = inputs(device)
    attn_mask = MASKS[mask]()
    attn_mask = attn_mask.to(device) if isinstance(attn_mask, torch.Tensor) else attn_mask
    assert fused.supports(build(), q, k, v, 0.0, None)
    out = attnorm.attention(q, k, v, build(), attn_mask=attn_mask)
    assert fused_calls
    if isinstance(attn_mask, torch.Tensor):
        allowed = attn_mask.cpu()
    else:
        allowed = attn_mask.materialize(torch.Size([B, H, LQ, LK]))
    qd, kd, vd = (t.detach().cpu().double().requires_grad_() for t in (q, k, v))
    expected = reference(normalize, qd, kd, vd, allowed.expand(B, H, LQ, LK))
    torch.testing.assert_close(out.detach().cpu().double(), expected.detach(), rtol=2e-4, atol=2e-4)
    cotangent = torch.randn(expected.shape, dtype=torch.float64)
    got = torch.autograd.grad(out, (q, k, v), cotangent.to(device=device, dtype=out.dtype))
    wanted = torch.autograd.grad(expected, (qd, kd, vd), cotangent)
    for name, actual, reference_grad in zip("qkv", got, wanted, strict=True):
        torch.testing.assert_close(actual.cpu().double(), reference_grad, rtol=5e-4, atol=5e-4, msg=name)


def test_learnable_alpha_gets_its_gradient(device, fused_calls):
    q, k, v = inputs(device, torch.float64)
    normalizer = attnorm.Entmax(1.4, learnable=True, num_heads=H, backend="triton").to(device).double()
    out = attnorm.attention(q, k, v, normalizer, is_causal=True)
    assert fused_calls
    (got,) = torch.autograd.grad(out.sum(), normalizer.alpha_logit)
    blocked = attnorm.Entmax(1.4, learnable=True, num_heads=H, backend="reference").to(device).double()
    expected_out = attnorm.attention(q, k, v, blocked, is_causal=True, return_weights=True)[0]
    (expected,) = torch.autograd.grad(expected_out.sum(), blocked.alpha_logit)
    torch.testing.assert_close(out, expected_out, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(got, expected, rtol=1e-7, atol=1e-9)


def test_fully_masked_rows_give_zero_outputs_and_gradients(device, fused_calls):
    q, k, v = inputs(device)
    mask = torch.ones(B, 1, LQ, LK, dtype=torch.bool, device=device)
    mask[:, :, 3] = False
    out = attnorm.attention(q, k, v, attnorm.Sparsemax(backend="triton"), attn_mask=mask)
    assert fused_calls
    assert (out[:, :, 3] == 0).all() and torch.isfinite(out).all()
    (dq,) = torch.autograd.grad(out.sum(), q)
    assert (dq[:, :, 3] == 0).all() and torch.isfinite(dq).all()


def test_route_choice(device):
    """CPU tensors on the default backend never take the fused kernels; ``backend="triton"`` (on ``device``:
    CUDA when present, else the interpreter) takes them for every family it has, unless dropout or alpha > 2."""
    cpu = [t.detach() for t in inputs("cpu")]
    assert not fused.supports(attnorm.Sparsemax(), *cpu, 0.0, None)  # CPU, auto: blocked or materialised
    assert not fused.supports_scaled_softmax(attnorm.Softmax(), None, *cpu, 0.0, None, modified=True)  # CPU, auto
    q, k, v = (t.detach() for t in inputs(device))
    assert not fused.supports(attnorm.Sparsemax(backend="triton"), q, k, v, 0.1, None)  # dropout: not fused
    assert not fused.supports(attnorm.Entmax(3.0, backend="triton"), q, k, v, 0.0, None)  # alpha > 2
    assert not fused.supports(attnorm.Softmax(backend="triton"), q, k, v, 0.0, None)  # SDPA's
    assert fused.supports(attnorm.Entmax(1.2, backend="triton"), q, k, v, 0.0, None)
    # softcap or sinks: SDPA cannot apply them, so logit scalings take the fused softmax
    softmax = attnorm.Softmax(temperature=0.5, backend="triton")
    assert fused.supports_scaled_softmax(softmax, None, q, k, v, 0.0, None, modified=True)
    assert not fused.supports_scaled_softmax(softmax, None, q, k, v, 0.0, None, modified=False)


def test_normalized_self_adjusted_with_an_additive_mask_needs_triton_3_9_on_cuda(monkeypatch):
    """Triton < 3.9 breaks that backward (routes/fused.py): on CUDA such calls leave the fused route, in every
    dtype; the plain variant, no additive mask, the CPU (interpreter) and newer Tritons keep it."""
    def query(dtype, device):  # what the rule reads of q; Triton's own availability is patched below
        return types.SimpleNamespace(ndim=4, dtype=dtype, device=torch.device(device), shape=(B, H, LQ, D))

    k, v = torch.zeros(B, H, LK, D), torch.zeros(B, H, LK, D)
    additive = torch.zeros(LQ, LK)
    normalized = attnorm.SelfAdjustedSoftmax(backend="triton")
    plain = attnorm.SelfAdjustedSoftmax(normalized=False, backend="triton")
    monkeypatch.setattr(fused, "_runs_triton", lambda normalizer, q: True)
    cuda64, cuda32, cpu64 = query(torch.float64, "cuda"), query(torch.float32, "cuda"), query(torch.float64, "cpu")
    for compiles in (False, True):
        monkeypatch.setattr(fused, "_triton_handles_normalized_additive_self_adjusted",
                            lambda compiles=compiles: compiles)
        assert fused.supports(normalized, cuda64, k, v, 0.0, additive) is compiles
        assert fused.supports(normalized, cuda32, k, v, 0.0, additive) is compiles
        assert fused.supports(plain, cuda64, k, v, 0.0, additive)
        assert fused.supports(plain, cuda32, k, v, 0.0, additive)
        assert fused.supports(normalized, cuda64, k, v, 0.0, None)
        assert fused.supports(normalized, cpu64, k, v, 0.0, additive)  # the interpreter compiles nothing


def test_ops_pass_opcheck(device):
    q, k, v = (t.detach() for t in inputs(device))
    start, stop = attnorm.causal_mask(LK - LQ).key_range(B, LQ, LK, device)
    args = (q, k, v, start, stop, None, None, D**-0.5)
    torch.library.opcheck(torch.ops.attnorm.entmax_attention_fwd, (*args, 1.5, None),
                          test_utils=("test_schema", "test_faketensor"))
    sinks, rows = torch.randn(H, 1, device=device), torch.rand(B, H, LQ, device=device)
    torch.library.opcheck(torch.ops.attnorm.entmax_attention_fwd, (*args, 1.0, None, 3.0, sinks, rows),
                          test_utils=("test_schema", "test_faketensor"))
    out, stats, _ = torch.ops.attnorm.entmax_attention_fwd(*args, 1.0, None, 3.0, sinks, rows)
    torch.library.opcheck(torch.ops.attnorm.entmax_attention_bwd,
                          (q, k, v, out, torch.ones_like(out), stats, *args[3:], 1.0, None, False, 3.0, sinks, rows),
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(torch.ops.attnorm.self_adjusted_attention_fwd, (*args, True),
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(torch.ops.attnorm.self_adjusted_attention_fwd, (*args, True, 3.0, sinks),
                          test_utils=("test_schema", "test_faketensor"))
    out, stats, _ = torch.ops.attnorm.self_adjusted_attention_fwd(*args, True, 3.0, sinks)
    torch.library.opcheck(torch.ops.attnorm.self_adjusted_attention_bwd,
                          (q, k, v, out, torch.ones_like(out), stats, *args[3:], True, 3.0, sinks),
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(torch.ops.attnorm.topk_attention_fwd, (*args, 3.0, False, 1.0),
                          test_utils=("test_schema", "test_faketensor"))
    out, stats, out_float = torch.ops.attnorm.topk_attention_fwd(*args, 0.3, True, 0.7, 3.0, sinks)
    assert out_float.numel() == 0  # not asked for (and float32 has no other)
    torch.library.opcheck(torch.ops.attnorm.topk_attention_bwd,
                          (q, k, v, out, torch.ones_like(out), stats, *args[3:], 0.3, True, 0.7, 3.0, sinks),
                          test_utils=("test_schema", "test_faketensor"))
    half = (q.bfloat16(), k.bfloat16(), v.bfloat16(), *args[3:])  # half precision: the float32 output for delta
    torch.library.opcheck(torch.ops.attnorm.topk_attention_fwd, (*half, 3.0, False, 1.0, None, None, True),
                          test_utils=("test_schema", "test_faketensor"))
    out, stats, out_float = torch.ops.attnorm.topk_attention_fwd(*half, 3.0, False, 1.0, None, None, True)
    assert out_float.dtype == torch.float32 and out_float.shape == out.shape
    torch.library.opcheck(torch.ops.attnorm.topk_attention_bwd,
                          (*half[:3], out, torch.ones_like(out), stats, *args[3:], 3.0, False, 1.0, None, None,
                           out_float), test_utils=("test_schema", "test_faketensor"))


def test_fused_route_compiles_without_graph_breaks(device, fused_calls):
    q, k, v = (t.detach() for t in inputs(device))
    normalizer = attnorm.Sparsemax(backend="triton")
    run = lambda q, k, v: attnorm.attention(q, k, v, normalizer, is_causal=True)
    explanation = torch._dynamo.explain(run)(q, k, v)
    assert explanation.graph_break_count == 0
    compiled = torch.compile(run, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), run(q, k, v))
    assert fused_calls


def test_softcap_and_sinks_compile_without_graph_breaks(device, fused_calls):
    q, k, v = (t.detach() for t in inputs(device))
    sinks = torch.linspace(-1, 1, H, device=device, requires_grad=True)
    normalizer = attnorm.Sparsemax(backend="triton")
    run = lambda q, k, v, sinks: attnorm.attention(q, k, v, normalizer, is_causal=True, softcap=5.0, sinks=sinks)
    explanation = torch._dynamo.explain(run)(q, k, v, sinks)
    assert explanation.graph_break_count == 0
    compiled = torch.compile(run, backend="aot_eager", fullgraph=True)
    out = compiled(q, k, v, sinks)
    expected = run(q, k, v, sinks)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(torch.autograd.grad(out.sum(), sinks), torch.autograd.grad(expected.sum(), sinks))
    assert fused_calls


def test_decoding_shapes_take_the_row_kernels_and_match_the_last_rows_of_a_full_run(device):
    q, k, v = (t.detach() for t in inputs(device))
    normalizer = attnorm.Sparsemax(backend="triton")
    full = attnorm.attention(q[:, :, :1].expand(B, H, LK, D).contiguous(), k, v, normalizer, is_causal=True)
    last = attnorm.attention(q[:, :, :1], k, v, normalizer, attn_mask=attnorm.causal_mask(LK - 1))
    torch.testing.assert_close(last, full[:, :, -1:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mask", ["window&padding", "documents&causal"])
def test_logit_scalings_under_structured_masks_take_the_fused_softmax(mask, device, monkeypatch):
    """ssmax (learnable per head: gradients of s and bias) and softmax/T on the alpha = 1 kernel, no dense mask."""
    calls = []
    original = fused.scaled_softmax
    monkeypatch.setattr(fused, "scaled_softmax", lambda *args: calls.append(1) or original(*args))
    monkeypatch.setattr(attention_module, "DECODING_ROWS", 0)
    lq = lk = LK
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(B, h, lq, D, generator=gen, dtype=torch.float64) for h in (H, HKV, HKV))
    q, k, v = (t.to(device).requires_grad_() for t in (q, k, v))
    attn_mask = {
        "window&padding": attnorm.sliding_window_mask(5) & attnorm.key_padding_mask(torch.tensor([13, 6])),
        "documents&causal": attnorm.document_mask(torch.tensor([0, 4, 5, 11])) & attnorm.causal_mask(),
    }[mask]
    allowed = attn_mask.materialize(torch.Size([B, H, lq, lk])).expand(B, H, lq, lk)
    normalizer = attnorm.ScalableSoftmax(s=0.4, bias=0.3, learnable=True, num_heads=H, backend="triton")
    normalizer = normalizer.double().to(device)
    out = attnorm.attention(q, k, v, normalizer, attn_mask=attn_mask)
    assert calls
    params = (q, k, v, normalizer.s, normalizer.bias)
    got = torch.autograd.grad(out.sum(), params)

    s, bias = (p.detach().clone().requires_grad_() for p in (normalizer.s, normalizer.bias))
    kr, vr = k.repeat_interleave(H // HKV, 1), v.repeat_interleave(H // HKV, 1)
    multiplier = s * torch.log(allowed.sum(-1, keepdim=True).clamp_min(1).double().to(device)) + bias
    logits = (multiplier * (q @ kr.transpose(-2, -1)) / math.sqrt(D)).masked_fill(~allowed.to(device), -math.inf)
    weights = torch.softmax(logits, -1).nan_to_num(0.0)
    expected = weights @ vr
    torch.testing.assert_close(out, expected, rtol=1e-9, atol=1e-10)
    wanted = torch.autograd.grad(expected.sum(), (q, k, v, s, bias))
    for name, actual, reference_grad in zip(("q", "k", "v", "s", "bias"), got, wanted, strict=True):
        torch.testing.assert_close(actual, reference_grad, rtol=1e-8, atol=1e-9, msg=name)
    plain = attnorm.attention(q, k, v, attnorm.Softmax(temperature=0.5, backend="triton"), attn_mask=attn_mask)
    logits = (2 * (q @ kr.transpose(-2, -1)) / math.sqrt(D)).masked_fill(~allowed.to(device), -1e300)
    softmax = torch.softmax(logits, -1)
    torch.testing.assert_close(plain, softmax * allowed.any(-1, keepdim=True).to(device) @ vr, rtol=1e-9, atol=1e-10)


def test_the_entmax_forward_keeps_w_only_for_a_backward_without_alpha_gradient():
    """``attention_ops._keeps_weighted``: W (the backward's delta without a row pass) is kept when a gradient will be
    taken and alpha's is not wanted; inference and a learnable alpha (its gradient needs the row pass) keep none."""
    from attnorm.kernels import attention_ops

    q, k, v = torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 5, 4), torch.zeros(1, 2, 5, 4)
    wanted = q.clone().requires_grad_()
    alpha = torch.full((2,), 1.5, requires_grad=True)
    sinks = torch.zeros(2, 1, requires_grad=True)
    assert attention_ops._keeps_weighted(wanted, k, v, None, None, None)
    assert attention_ops._keeps_weighted(q, k, v, None, sinks, None)  # a sink's gradient goes through delta too
    assert not attention_ops._keeps_weighted(q, k, v, None, None, None)  # nothing to differentiate
    assert not attention_ops._keeps_weighted(wanted, k, v, alpha, None, None)
    assert attention_ops._keeps_weighted(wanted, k, v, alpha.detach(), None, None)  # fixed per-head alphas
    with torch.no_grad():
        assert not attention_ops._keeps_weighted(wanted, k, v, None, None, None)


@pytest.mark.parametrize("dtype, sink_dtype, tolerance", [
    (torch.bfloat16, torch.bfloat16, 0.01), (torch.float64, torch.float32, 1e-12)])
@pytest.mark.parametrize("spec", ["softmax:temperature=0.1", "ssmax:s=2.0"])
def test_a_sink_logit_is_the_sink_times_the_multiplier_at_the_computing_precision(
        device, fused_calls, monkeypatch, dtype, sink_dtype, tolerance, spec):
    """The fused softmax's sink logit ``c sinks[h]`` was computed in the sinks' dtype: a bfloat16 sink of
    8.625 over T = 0.1 came out 86.0 instead of 86.25 (outputs 0.126 off where the reference backend's
    were 0.003), and float32 sinks with float64 q lost float64's digits (1e-8)."""
    gen = torch.Generator().manual_seed(0)
    q = (4 * torch.randn(1, 1, 1, D, generator=gen, dtype=torch.float64)).expand(B, H, LQ, D)  # scores ~ 30
    k, v = (torch.randn(B, HKV, LK, D, generator=gen, dtype=torch.float64) for _ in range(2))
    q, k, v = (t.to(device=device, dtype=dtype) for t in (q, k, v))
    scores = q.double() @ k.double().repeat_interleave(H // HKV, 1).transpose(-2, -1) / math.sqrt(D)
    sinks = torch.full((H,), scores.amax().item() + 0.1, dtype=torch.float64).to(device=device, dtype=sink_dtype)
    multiplier = 10.0 if spec.startswith("softmax") else 2.0 * math.log(LK)
    logits = multiplier * torch.cat([scores, sinks.double().reshape(1, H, 1, 1).expand(B, H, LQ, 1)], -1)
    expected = torch.softmax(logits, -1)[..., :LK] @ v.double().repeat_interleave(H // HKV, 1)
    normalizer = attnorm.make(spec)
    normalizer.backend = "triton"
    scaled_calls, original = [], fused.scaled_softmax
    monkeypatch.setattr(fused, "scaled_softmax", lambda *args: scaled_calls.append(1) or original(*args))
    out = attnorm.attention(q, k, v, normalizer, sinks=sinks)
    assert scaled_calls == [1] and out.dtype == dtype
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=tolerance)
