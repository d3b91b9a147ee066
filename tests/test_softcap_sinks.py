"""attention(softcap=..., sinks=...) against float64 formulas (Gemma 2's soft-capping, gpt-oss's sinks).

A sink is a virtual key per head with score ``sinks[h]`` and value 0: the reference
appends that score to every row, normalises the extended row with the normalizer's
independent reference, and drops the sink's weight.  Scalable-Softmax's ``n`` and top-k's
fraction count the real allowed keys only.
"""

from __future__ import annotations

import math

import entmax
import pytest
import torch

import attnorm

B, H, LQ, LK, D = 2, 3, 6, 7, 8


@pytest.fixture(params=["materialised", "blocked"])
def route(request):
    if request.param == "blocked":
        request.getfixturevalue("force_blocked")
    return request.param


def inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, LQ, D, generator=gen, dtype=torch.float64) * 3
    k = torch.randn(B, H, LK, D, generator=gen, dtype=torch.float64)
    v = torch.randn(B, H, LK, D, generator=gen, dtype=torch.float64)
    return q, k, v


def causal_allowed() -> torch.Tensor:
    return torch.ones(LQ, LK, dtype=torch.bool).tril(LK - LQ)


def softmax_with_sink(scores, allowed, sink, multiplier):
    """exp(c x_j) / (exp(c sink) + sum_allowed exp(c x_i))."""
    logits = torch.where(allowed, multiplier * scores, -math.inf)
    top = torch.maximum(logits.amax(-1, keepdim=True), multiplier * sink)
    exps = torch.exp(logits - top)
    return exps / (torch.exp(multiplier * sink - top) + exps.sum(-1, keepdim=True))


REFERENCES = {
    "softmax:temperature=0.5": lambda x, allowed, sink: softmax_with_sink(x, allowed, sink, 2.0),
    "ssmax:s=0.6,bias=0.1": lambda x, allowed, sink: softmax_with_sink(
        x, allowed, sink, 0.6 * torch.log(allowed.sum(-1, keepdim=True).double()) + 0.1
    ),
    "sparsemax": lambda x, allowed, sink: _extended(entmax.sparsemax, x, allowed, sink),
    "entmax:alpha=1.5": lambda x, allowed, sink: _extended(entmax.entmax15, x, allowed, sink),
    "sa_softmax": lambda x, allowed, sink: _extended(_self_adjusted, x, allowed, sink),
    "topk:k=0.3,temperature=0.7": lambda x, allowed, sink: _top_fraction_with_sink(x, allowed, sink, 0.3, 0.7),
}


def _top_fraction_with_sink(x, allowed, sink, fraction, temperature):
    """softmax(x / T) over the max(1, ceil(fraction n)) largest of the n real keys and the sink (last: loses ties)."""
    count = torch.ceil(allowed.sum(-1, keepdim=True) * fraction - 1e-9).clamp_min(1)
    extended = torch.cat([torch.where(allowed, x, -math.inf), sink.expand(*x.shape[:-1], 1)], dim=-1)
    order = torch.argsort(extended.detach(), dim=-1, descending=True, stable=True)
    kept = torch.argsort(order, dim=-1) < count
    return torch.softmax(torch.where(kept, extended / temperature, -math.inf), dim=-1)[..., :-1]


def _self_adjusted(x, dim=-1):
    """(x - low) / (high - low) softmax(x), low = min(min x, 0), high = max(max x, 0), over finite entries."""
    finite = torch.isfinite(x)
    safe = torch.where(finite, x, 0.0)  # keeps -inf out of the factor's gradient
    low = torch.where(finite, safe, math.inf).amin(dim, keepdim=True).clamp_max(0)
    high = torch.where(finite, safe, -math.inf).amax(dim, keepdim=True).clamp_min(0)
    factor = torch.where(finite, (safe - low) / (high - low), 0.0)
    return factor * torch.softmax(x, dim)


def _extended(normalize, x, allowed, sink):
    extended = torch.cat([torch.where(allowed, x, -math.inf), sink.expand(*x.shape[:-1], 1)], dim=-1)
    return normalize(extended, dim=-1)[..., :-1]


@pytest.mark.parametrize("spec", list(REFERENCES))
def test_sinks_match_the_extended_row_formula(spec, route):
    q, k, v = (t.requires_grad_() for t in inputs())
    sinks = torch.tensor([0.3, 1.5, -2.0], dtype=torch.float64, requires_grad=True)  # not 0: a kink of SA
    allowed = causal_allowed()
    out = attnorm.attention(q, k, v, spec, attn_mask=attnorm.causal_mask(LK - LQ), sinks=sinks)
    scores = q @ k.transpose(-2, -1) / math.sqrt(D)
    weights = REFERENCES[spec](scores, allowed, sinks.view(H, 1, 1))
    expected = weights @ v
    torch.testing.assert_close(out, expected, rtol=1e-9, atol=1e-10)
    cotangent = torch.randn_like(out)
    got = torch.autograd.grad((out * cotangent).sum(), (q, k, v, sinks))
    wanted = torch.autograd.grad((expected * cotangent).sum(), (q, k, v, sinks))
    for name, actual, reference in zip("qkvs", got, wanted, strict=True):
        torch.testing.assert_close(actual, reference, rtol=1e-8, atol=1e-9, msg=name)


def test_a_zero_sink_with_softmax_is_softmax_one(route):
    q, k, v = inputs()
    out = attnorm.attention(q, k, v, "softmax", sinks=torch.zeros(H, dtype=torch.float64))
    exps = torch.exp(q @ k.transpose(-2, -1) / math.sqrt(D))
    torch.testing.assert_close(out, exps / (1 + exps.sum(-1, keepdim=True)) @ v)


def test_a_row_with_no_allowed_key_and_a_sink_gives_zeros(route):
    q, k, v = (t.requires_grad_() for t in inputs())
    mask = torch.ones(LQ, LK, dtype=torch.bool)
    mask[2] = False
    out = attnorm.attention(q, k, v, "ssmax", attn_mask=mask, sinks=torch.ones(H, dtype=torch.float64))
    assert (out[:, :, 2] == 0).all() and torch.isfinite(out).all()
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and (q.grad[:, :, 2] == 0).all()


@pytest.mark.parametrize("spec", ["softmax", "ssmax", "sparsemax", "topk:k=3"])
def test_softcap_caps_the_scaled_scores_before_the_mask(spec, route):
    q, k, v = (t.requires_grad_() for t in inputs())
    additive = torch.zeros(LQ, LK, dtype=torch.float64).masked_fill(~causal_allowed(), -math.inf)
    out = attnorm.attention(q, k, v, spec, attn_mask=additive, softcap=1.5)
    capped = 1.5 * torch.tanh((q @ k.transpose(-2, -1) / math.sqrt(D)) / 1.5) + additive
    expected = attnorm.make(spec)(capped) @ v  # the row normalizers are checked against references elsewhere
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    got = torch.autograd.grad(out.sum(), (q, k))
    wanted = torch.autograd.grad(expected.sum(), (q, k))
    for actual, reference in zip(got, wanted, strict=True):
        torch.testing.assert_close(actual, reference, rtol=1e-8, atol=1e-9)


def test_softcap_matches_the_formula_for_softmax():
    q, k, v = inputs()
    out = attnorm.attention(q, k, v, softcap=2.0, is_causal=True)
    capped = 2.0 * torch.tanh(q @ k.transpose(-2, -1) / math.sqrt(D) / 2.0)
    expected = torch.softmax(capped.masked_fill(~torch.ones(LQ, LK, dtype=torch.bool).tril(), -math.inf), -1) @ v
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize(
    "kwargs,error",
    [({"softcap": 0.0}, "softcap"), ({"softcap": math.inf}, "softcap"), ({"sinks": torch.zeros(2)}, "sinks")],
)
def test_bad_modifiers_name_the_argument(kwargs, error):
    q, k, v = inputs()
    with pytest.raises(ValueError, match=error):
        attnorm.attention(q, k, v, **kwargs)
