"""Scalable-Softmax decoding under a bool mask: one Triton launch for the count, ``c`` and ``c q``, then SDPA.

:func:`attnorm.routes.decoding.ssmax_masked` (a left-padded batch's step: Hugging Face's
``(B, 1, 1, Lk)`` mask).  Every case is compared with float64 attention written from the
definition, ``softmax((s log n + bias) scale q k^T)`` over the allowed keys of each row, ``n``
their count, zero rows where none is allowed; the kernel's outputs are poisoned with NaN
first (``launch.empty``), and the route is checked to have been taken (or not).
"""

from __future__ import annotations

import math

import pytest
import torch

import attnorm
from attnorm.kernels.triton import launch
from attnorm.routes import decoding
from tests.conftest import DEVICE, poisoned_empty

TOLERANCE = {torch.float64: 1e-10, torch.float32: 2e-6, torch.float16: 4e-3, torch.bfloat16: 3e-2}


@pytest.fixture
def taken(monkeypatch):
    """Poisoned kernel outputs; yields a list that gets one item per call the route took."""
    monkeypatch.setattr(launch, "empty", poisoned_empty)
    calls = []
    real = decoding.ssmax_queries
    monkeypatch.setattr(decoding, "ssmax_queries", lambda *args: calls.append(1) or real(*args))
    return calls


def _reference(q, k, v, mask, s, bias, scale=None):
    """float64 Scalable-Softmax attention from the definition; ``s``/``bias`` numbers or per-head tensors."""
    q, k, v = (t.double() for t in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    x = scale * q @ k.transpose(-1, -2)
    allowed = mask.expand(x.shape)
    n = allowed.sum(-1, keepdim=True).clamp_min(1).double()
    s, bias = (p.double() if isinstance(p, torch.Tensor) else p for p in (s, bias))
    weights = torch.softmax(((s * n.log() + bias) * x).masked_fill(~allowed, -math.inf), -1).nan_to_num(0.0)
    return weights @ v


def _inputs(batch=3, heads=4, kv_heads=4, lq=1, lk=37, dim=16, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, lq, dim, generator=generator)
    k, v = (torch.randn(batch, kv_heads, lk, dim, generator=generator) for _ in range(2))
    return (t.to(DEVICE, dtype) for t in (q, k, v))


def _left_padded(lengths, lk):
    """Hugging Face's (B, 1, 1, Lk) bool mask of a left-padded batch: row b attends its last lengths[b] keys."""
    lengths = torch.tensor(lengths)
    return (torch.arange(lk) >= (lk - lengths)[:, None]).reshape(len(lengths), 1, 1, lk).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_a_left_padded_step_takes_one_launch_and_matches_the_definition(taken, dtype):
    q, k, v = _inputs(dtype=dtype)
    mask = _left_padded([37, 20, 1], 37)
    out = attnorm.attention(q, k, v, attnorm.ScalableSoftmax(s=0.6, bias=0.1, backend="triton"), attn_mask=mask)
    assert taken and out.dtype == dtype
    torch.testing.assert_close(out.double(), _reference(q, k, v, mask, 0.6, 0.1), atol=TOLERANCE[dtype],
                               rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("shape, lk", [((3, 1, 1, 29), 29), ((3, 4, 1, 29), 29), ((1, 1, 1, 29), 29), ((29,), 29),
                                       ((3, 1, 5, 29), 29), ((1, 4, 5, 1), 1), ((3, 1, 5, 1), 29), ((1,), 29)],
                         ids=["padded", "per-head", "shared", "keys-only", "rows", "one-key", "key-broadcast",
                              "one-element"])
def test_every_mask_broadcast_and_fully_masked_rows(taken, shape, lk):
    lq = shape[-2] if len(shape) > 1 else 1
    q, k, v = _inputs(lq=lq, lk=lk, seed=1)
    generator = torch.Generator().manual_seed(2)
    mask = (torch.rand(shape, generator=generator) < 0.6).to(DEVICE)
    mask.reshape(-1, shape[-1])[0] = False  # one fully masked row: zeros
    out = attnorm.attention(q, k, v, attnorm.ScalableSoftmax(s=1.3, bias=-0.2, backend="triton"), attn_mask=mask)
    assert taken
    torch.testing.assert_close(out.double(), _reference(q, k, v, mask, 1.3, -0.2), atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("per_head", [True, False], ids=["per-head", "one"])
def test_learnable_parameters_are_read_in_place_without_a_gradient(taken, per_head):
    heads = 4
    module = attnorm.ScalableSoftmax(learnable=True, num_heads=heads if per_head else None, backend="triton").to(DEVICE)
    with torch.no_grad():
        module.s.copy_(torch.linspace(0.3, 1.5, module.s.numel()).reshape(module.s.shape))
        module.bias.copy_(torch.linspace(-0.5, 0.5, module.bias.numel()).reshape(module.bias.shape))
    q, k, v = _inputs(heads=heads, kv_heads=2, seed=3)  # grouped-query attention too
    mask = _left_padded([37, 9, 0], 37)
    with torch.no_grad():
        out = attnorm.attention(q, k, v, module, attn_mask=mask, scale=0.2)
    assert taken
    expected = _reference(q, k, v, mask, module.s.detach(), module.bias.detach(), scale=0.2)
    torch.testing.assert_close(out.double(), expected, atol=2e-6, rtol=2e-6)


def test_a_learnable_step_without_a_mask_takes_the_kernel_and_a_numbers_step_does_not(taken):
    heads = 4
    module = attnorm.ScalableSoftmax(learnable=True, num_heads=heads, backend="triton").to(DEVICE)
    with torch.no_grad():
        module.s.copy_(torch.tensor([0.3, 0.8, 1.2, 2.0]).reshape(heads, 1, 1))
        module.bias.copy_(torch.tensor([0.1, -0.2, 0.0, 0.4]).reshape(heads, 1, 1))
    q, k, v = _inputs(heads=heads, kv_heads=2, lk=41, seed=10)
    everything = torch.ones(1, dtype=torch.bool, device=DEVICE)
    with torch.no_grad():
        out = attnorm.attention(q, k, v, module)
        causal_step = attnorm.attention(q, k, v, module, attn_mask=attnorm.causal_mask(40))  # the last row's keys
    assert len(taken) == 2
    expected = _reference(q, k, v, everything, module.s.detach(), module.bias.detach())
    torch.testing.assert_close(out.double(), expected, atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(causal_step, out)
    numbers = attnorm.ScalableSoftmax(s=0.6, bias=0.1, backend="triton")
    torch.testing.assert_close(attnorm.attention(q, k, v, numbers).double(),
                               _reference(q, k, v, everything, 0.6, 0.1), atol=2e-6, rtol=2e-6)
    assert len(taken) == 2  # a number multiplier is SDPA's scale: nothing to launch before it


def test_odd_head_dims_and_strided_queries(taken):
    q, k, v = _inputs(lk=50, dim=80, seed=4)
    q = q.transpose(0, 1).contiguous().transpose(0, 1)  # same values, batch and head strides swapped
    mask = _left_padded([50, 3, 17], 50)
    module = attnorm.ScalableSoftmax(s=0.9, backend="triton")
    out = attnorm.attention(q, k, v, module, attn_mask=mask)
    assert taken
    torch.testing.assert_close(out.double(), _reference(q, k, v, mask, 0.9, 0.0), atol=2e-6, rtol=2e-6)


def test_calls_that_need_a_gradient_or_another_mask_keep_the_sdpa_route(taken):
    q, k, v = _inputs(seed=5)
    mask = _left_padded([37, 20, 5], 37)
    module = attnorm.ScalableSoftmax(s=0.6, backend="triton")
    leaf = q.clone().requires_grad_()
    out = attnorm.attention(leaf, k, v, module, attn_mask=mask)
    out.sum().backward()
    torch.testing.assert_close(out.double(), _reference(q, k, v, mask, 0.6, 0.0), atol=2e-6, rtol=2e-6)
    assert leaf.grad is not None and torch.isfinite(leaf.grad).all()
    additive = torch.zeros(mask.shape, device=DEVICE).masked_fill(~mask, -math.inf)
    torch.testing.assert_close(attnorm.attention(q, k, v, module, attn_mask=additive), out.detach())
    reference_backend = attnorm.ScalableSoftmax(s=0.6, backend="reference")  # not Triton: the SDPA route
    torch.testing.assert_close(attnorm.attention(q, k, v, reference_backend, attn_mask=mask), out.detach())
    assert not taken


def test_the_kernel_agrees_with_the_sdpa_route_it_replaces(taken, monkeypatch):
    q, k, v = _inputs(seed=6, dtype=torch.float16)
    mask = _left_padded([37, 30, 2], 37)
    module = attnorm.ScalableSoftmax(s=0.7, bias=0.05, backend="triton")
    fast = attnorm.attention(q, k, v, module, attn_mask=mask)
    assert taken
    monkeypatch.setattr(decoding, "ssmax_masked", lambda *args: None)
    torch.testing.assert_close(fast, attnorm.attention(q, k, v, module, attn_mask=mask), atol=1e-3, rtol=1e-3)


def test_the_op_writes_both_outputs(taken):
    from attnorm.kernels.decoding_ops import ssmax_queries

    q, _, _ = _inputs(lq=2, seed=7)
    generator = torch.Generator().manual_seed(8)
    mask = (torch.rand(3, 1, 2, 37, generator=generator) < 0.3).to(DEVICE)
    mask[1, 0, 1] = False
    s = torch.tensor([0.5, 1.0, 1.5, 2.0], device=DEVICE).reshape(4, 1, 1)
    scaled, attends = ssmax_queries(q, mask, s, -0.25)
    n = mask.expand(3, 4, 2, 37).sum(-1, keepdim=True)
    expected = ((s.double() * n.clamp_min(1).double().log() - 0.25) * q.double()).float()
    torch.testing.assert_close(scaled, expected, atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(attends, n > 0)
    assert not attends[1, :, 1].any()


def test_the_op_passes_opcheck_is_forward_only_and_compiles():
    from attnorm.kernels.decoding_ops import ssmax_queries

    q, _, _ = _inputs(seed=9, dtype=torch.float16)
    mask = _left_padded([37, 4, 0], 37)
    s = torch.full((4, 1, 1), 0.8, device=DEVICE)
    torch.library.opcheck(torch.ops.attnorm.ssmax_queries_fwd, (q, mask, 1.0, s, 0.1, None, 37),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    scaled, _ = ssmax_queries(q.clone().requires_grad_(), mask, s, 0.1)
    with pytest.raises(RuntimeError, match="forward only"):
        scaled.float().sum().backward()
    compiled = torch.compile(lambda q: ssmax_queries(q, mask, s, 0.1), fullgraph=True, backend="aot_eager")
    for got, expected in zip(compiled(q), ssmax_queries(q, mask, s, 0.1), strict=True):
        torch.testing.assert_close(got, expected)
