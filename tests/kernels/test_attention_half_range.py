"""float16's range in the fused kernels' products: factors such as 1 / T, 1 / span or a sink far above the keys.

The kernels round an operand of each ``tl.dot`` to the inputs' dtype.  In float16 (max 65504,
normal down to 6e-5) a score gradient carrying 1 / T or 1 / span overflowed to inf (NaN
gradients where the exact ones fit easily), and the Self-Adjusted forward's ``e x`` sank into
subnormals at a tiny spread or cancelled against a sink's max.  Each case here is compared
with float64 math written from the definitions, on the float16-rounded inputs, gradients by
autograd; the tolerances are float16's (the native CPU kernels, float32 inside, meet them too).
"""

from __future__ import annotations

import math

import pytest
import torch

import attnorm
from tests.conftest import DEVICE

L, D = 20, 16


def _causal_scores(q, k, scale, softcap=None):
    x = q @ k.transpose(-1, -2) * scale
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)
    allowed = torch.ones(x.shape[-2:], dtype=torch.bool, device=x.device).tril()
    return x.masked_fill(~allowed, -math.inf), allowed


def _softmax_weights(x, temperature=1.0, keep=None, sink=None):
    """softmax(x / T) over the allowed keys (the ``keep`` largest when given), a sink's weight dropped."""
    x = x / temperature
    if keep is not None:
        kth = x.topk(keep, -1).values[..., -1:]
        x = x.masked_fill(x < kth, -math.inf)
    if sink is None:
        return torch.softmax(x, -1)
    column = torch.full((*x.shape[:-1], 1), sink / temperature, dtype=x.dtype, device=x.device)
    return torch.softmax(torch.cat([x, column], -1), -1)[..., :-1]


def _self_adjusted_weights(x, allowed, normalized, sink=None):
    """softmax(x) phi(x): phi = x, or (x - low) / (high - low) with low, high over the keys and the sink, and 0."""
    w = _softmax_weights(x, sink=sink)
    finite = x.masked_fill(~allowed, 0.0)
    if not normalized:
        return w * finite
    extremes = [x.masked_fill(~allowed, math.inf).amin(-1, keepdim=True), x.amax(-1, keepdim=True)]
    if sink is not None:
        extremes = [torch.clamp(extremes[0], max=sink), torch.clamp(extremes[1], min=sink)]
    low, high = torch.clamp(extremes[0], max=0.0), torch.clamp(extremes[1], min=0.0)
    return w * (finite - low) / (high - low)


def _inputs(magnitude, seed=0, value_magnitude=1.0):
    generator = torch.Generator().manual_seed(seed)
    q, k = ((torch.randn(1, 1, L, D, generator=generator) * magnitude).half() for _ in range(2))
    v = (torch.randn(1, 1, L, D, generator=generator) * value_magnitude).half()
    return q.to(DEVICE), k.to(DEVICE), v.to(DEVICE)


def _compare(q, k, v, fused, weights_of, out_tol, grad_tol):
    """The fused call's output and q, k, v gradients (loss: sum of the output) against float64 autograd."""
    wide = [t.double().requires_grad_() for t in (q, k, v)]
    expected = weights_of(*wide[:2]) @ wide[2]
    expected.sum().backward()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with attnorm.use_backend("triton"):
        out = fused(*leaves)
    out.float().sum().backward()
    torch.testing.assert_close(out.double(), expected.detach(), rtol=0, atol=out_tol * expected.abs().max().item())
    for name, leaf, reference in zip("qkv", leaves, wide, strict=True):
        grad = leaf.grad.double()
        assert torch.isfinite(grad).all(), f"d{name} not finite"
        bound = grad_tol * reference.grad.abs().max().item()
        torch.testing.assert_close(grad, reference.grad, rtol=0, atol=bound, msg=f"d{name}")


@pytest.mark.parametrize("magnitude", [1e-2, 1e-3])
def test_self_adjusted_normalized_at_a_tiny_spread(magnitude):
    """The span 1 / (high - low) ~ 1e4..1e6 in the score gradients (inf, then NaN, in float16 before)."""
    q, k, v = _inputs(magnitude)
    scale = D ** -0.5

    def weights(q, k):
        x, allowed = _causal_scores(q, k, scale)
        return _self_adjusted_weights(x, allowed, normalized=True)

    fused = lambda q, k, v: attnorm.attention(q, k, v, attnorm.SelfAdjustedSoftmax(normalized=True), is_causal=True)
    _compare(q, k, v, fused, weights, out_tol=2e-3, grad_tol=3e-3)


@pytest.mark.parametrize("normalized", [False, True], ids=["plain", "normalized"])
@pytest.mark.parametrize("sink", [2.0, 8.0])
def test_self_adjusted_with_a_sink_far_above_the_keys(normalized, sink):
    """The sink is the row max: the forward's sums, relative to it, cancelled to 5 % of the output before."""
    q, k, v = _inputs(0.1, seed=1)
    scale = D ** -0.5

    def weights(q, k):
        x, allowed = _causal_scores(q, k, scale)
        return _self_adjusted_weights(x, allowed, normalized, sink=sink)

    sinks = torch.tensor([sink], device=DEVICE)
    fused = lambda q, k, v: attnorm.attention(q, k, v, attnorm.SelfAdjustedSoftmax(normalized=normalized),
                                              is_causal=True, sinks=sinks)
    _compare(q, k, v, fused, weights, out_tol=3e-3, grad_tol=3e-3)


@pytest.mark.parametrize("temperature", [1e-4, 3e-5])
def test_topk_at_a_small_temperature(temperature):
    """1 / T in the score gradients; q, k scaled by sqrt(T) so that the logits stay O(1)."""
    q, k, v = _inputs(math.sqrt(temperature), seed=2, value_magnitude=4.0)
    scale = D ** -0.5

    def weights(q, k):
        x, _ = _causal_scores(q, k, scale)
        return torch.stack([_softmax_weights(x[..., i:i + 1, :], temperature, keep=min(4, i + 1))
                            for i in range(L)], -2).squeeze(-3)

    fused = lambda q, k, v: attnorm.attention(q, k, v, attnorm.TopKSoftmax(4, temperature=temperature),
                                              is_causal=True)
    _compare(q, k, v, fused, weights, out_tol=2e-3, grad_tol=3e-3)


def test_softmax_with_softcap_at_a_small_temperature():
    """With a cap the kernel applies 1 / T to each row's logits itself (the fused entmax kernel at alpha 1)."""
    temperature = 3e-5
    q, k, v = _inputs(math.sqrt(temperature), seed=3, value_magnitude=4.0)
    scale = D ** -0.5

    def weights(q, k):
        x, _ = _causal_scores(q, k, scale, softcap=1.0)
        return _softmax_weights(x, temperature)

    fused = lambda q, k, v: attnorm.attention(q, k, v, attnorm.Softmax(temperature=temperature), is_causal=True,
                                              softcap=1.0)
    _compare(q, k, v, fused, weights, out_tol=2e-3, grad_tol=3e-3)
