"""The SDPA route does not keep the scaled queries ``c q`` for its backward.

With a per-row multiplier ``c`` (Scalable-Softmax) folded into ``q``, SDPA would save
``c q`` while the multiplication keeps ``q`` for ``c``'s gradient: two query-sized
tensors per layer where softmax keeps one.  ``attnorm.routes.sdpa`` saves ``q`` and ``c``
and recomputes ``c q`` in the backward; these tests count what a forward leaves held.
"""

from __future__ import annotations

import math

import torch

import attnorm

B, H, L, D, LAYERS = 1, 2, 256, 32, 3


def held_bytes_after_forward(spec: str) -> tuple[int, torch.Tensor, list[torch.Tensor]]:
    """Bytes torch's CPU allocator still holds once a small stack of attention layers ran forward."""
    gen = torch.Generator().manual_seed(0)
    normalizer = attnorm.make(spec)
    x = torch.randn(B, H, L, D, generator=gen, requires_grad=True)
    weights = [(torch.randn(D, D, generator=gen) / math.sqrt(D)).requires_grad_() for _ in range(LAYERS)]
    kept = []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as profiler:
        h = x
        for weight in weights:
            h = attnorm.attention(h @ weight, h, h, normalizer, is_causal=True)
        kept.append(h)
    events = profiler.profiler.kineto_results.events()
    held = sum(event.nbytes() for event in events if event.name() == "[memory]")
    return held, h, [x, *weights, *normalizer.parameters()]


def test_learnable_scalable_softmax_keeps_no_more_than_softmax():
    query_bytes = B * H * L * D * 4
    softmax_held, _, _ = held_bytes_after_forward("softmax")
    ssmax_held, out, inputs = held_bytes_after_forward(f"ssmax:learnable=true,num_heads={H}")
    # Without recomputation: + one scaled query per layer.  Allowed: the per-row multipliers.
    assert ssmax_held < softmax_held + query_bytes / 2, (ssmax_held, softmax_held, query_bytes)
    grads = torch.autograd.grad(out.square().sum(), inputs)
    assert all(torch.isfinite(g).all() for g in grads)


def test_recomputed_queries_give_the_float64_gradients():
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, H, 12, 8, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3))
    normalizer = attnorm.ScalableSoftmax(s=0.5, bias=0.2, learnable=True, num_heads=H).double()
    out = attnorm.attention(q, k, v, normalizer, is_causal=True)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v, normalizer.s, normalizer.bias))
    s, bias = (p.detach().clone().requires_grad_() for p in (normalizer.s, normalizer.bias))
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    allowed = torch.ones(12, 12, dtype=torch.bool).tril()
    multiplier = s * torch.log(allowed.sum(-1, keepdim=True).double()) + bias
    scores = (multiplier * (q2 @ k2.transpose(-2, -1)) / math.sqrt(8)).masked_fill(~allowed, -math.inf)
    expected = torch.softmax(scores, -1) @ v2
    torch.testing.assert_close(out, expected)
    for got, want in zip(grads, torch.autograd.grad(expected.square().sum(), (q2, k2, v2, s, bias)), strict=True):
        torch.testing.assert_close(got, want)


def test_queries_modified_in_place_after_the_forward_raise():
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(B, H, 6, 8, generator=gen, requires_grad=True) for _ in range(3))
    queries = q * 1.0
    out = attnorm.attention(queries, k, v, attnorm.ScalableSoftmax(learnable=True), is_causal=True)
    queries.add_(1.0)
    try:
        out.sum().backward()
    except RuntimeError as error:
        assert "modified" in str(error)
    else:
        raise AssertionError("the backward used queries modified after the forward")
