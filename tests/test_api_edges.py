"""Edges of the public API found by an independent fuzz (2026-11-27), each against a reference written here.

Scalable-Softmax under a mask broadcast over the keys, nested ``override_sdpa`` blocks, 2-D
``q``/``k``/``v``, ``override_sdpa``'s head broadcasting, ``attnorm.nn.MultiheadAttention``'s
mask dtypes and query dims, a NaN sink, a NaN gain loaded into ``L2NormAttention``, and
Taylor order 0's gradient.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import attnorm
import attnorm.functional as AF


def _ssmax_reference(q, k, v, allowed, s=0.43, bias=0.0):
    """float64 Scalable-Softmax attention from the definition: n = allowed keys of each row, zero rows where none."""
    x = q.double() @ k.double().transpose(-1, -2) / math.sqrt(q.shape[-1])
    keep = allowed.expand(x.shape)
    n = keep.sum(-1, keepdim=True).clamp_min(1).double()
    weights = torch.softmax(((s * n.log() + bias) * x).masked_fill(~keep, -math.inf), -1).nan_to_num(0.0)
    return weights @ v.double()


def _qkv(*shape_q, lk=6, dv=3, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(*shape_q, generator=generator, dtype=torch.float64)
    k = torch.randn(*shape_q[:-2], lk, shape_q[-1], generator=generator, dtype=torch.float64)
    v = torch.randn(*shape_q[:-2], lk, dv, generator=generator, dtype=torch.float64)
    return q, k, v


@pytest.mark.parametrize("mask", [torch.tensor([[True], [True], [False], [True]]), torch.tensor([True]),
                                  torch.tensor([[[[True], [False], [True], [True]]]])],
                         ids=["rows", "one", "4d"])
def test_ssmax_counts_the_keys_a_key_broadcast_mask_allows(mask):
    q, k, v = _qkv(1, 1, 4, 8)
    expected = _ssmax_reference(q, k, v, mask)
    torch.testing.assert_close(attnorm.attention(q, k, v, "ssmax", attn_mask=mask), expected)
    with attnorm.override_sdpa("ssmax"):
        torch.testing.assert_close(F.scaled_dot_product_attention(q, k, v, attn_mask=mask), expected)


def test_the_innermost_override_applies_and_explicit_calls_are_left_alone():
    q, k, v = _qkv(1, 2, 4, 8)
    softmax = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(8), -1) @ v
    ssmax = _ssmax_reference(q, k, v, torch.ones(1, dtype=torch.bool))
    with attnorm.override_sdpa("sparsemax"):
        with attnorm.override_sdpa("softmax"):
            torch.testing.assert_close(F.scaled_dot_product_attention(q, k, v), softmax)
        with attnorm.override_sdpa("ssmax"):
            torch.testing.assert_close(F.scaled_dot_product_attention(q, k, v), ssmax)
        torch.testing.assert_close(attnorm.attention(q, k, v, "ssmax"), ssmax)
        torch.testing.assert_close(attnorm.attention(q, k, v), softmax)
        compiled = torch.compile(lambda q, k, v: attnorm.attention(q, k, v, "ssmax"), backend="aot_eager",
                                 fullgraph=True)
        torch.testing.assert_close(compiled(q, k, v), ssmax)


@pytest.mark.parametrize("spec", ["softmax", "sparsemax", "entmax:alpha=1.5", "topk:k=2", "sa_softmax", "relu"])
def test_two_dim_inputs_work_as_in_sdpa(spec):
    q, k, v = _qkv(5, 4, lk=7)
    normalizer = attnorm.make(spec)
    expected_w = normalizer((q @ k.transpose(-1, -2) / 2.0).unsqueeze(0)).squeeze(0)  # one head, dim -1
    out, weights = attnorm.attention(q, k, v, spec, return_weights=True)
    assert out.shape == (5, 3) and weights.shape == (5, 7)
    torch.testing.assert_close(weights, expected_w)
    torch.testing.assert_close(out, expected_w @ v)
    causal = attnorm.attention(q, k, v, spec, is_causal=True)
    torch.testing.assert_close(causal, attnorm.attention(q[None], k[None], v[None], spec, is_causal=True)[0])
    if spec == "softmax":
        torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v))


@pytest.mark.parametrize("shapes", [((3, 5, 4), (1, 3, 4)), ((2, 4, 6, 8), (2, 1, 7, 8)), ((2, 1, 5, 8), (2, 3, 6, 8))],
                         ids=["key-head-1", "key-head-1-4d", "query-head-1"])
def test_override_sdpa_broadcasts_heads_as_sdpa_does(shapes):
    q_shape, k_shape = shapes
    generator = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(shape, generator=generator) for shape in (q_shape, k_shape, k_shape))
    expected = F.scaled_dot_product_attention(q, k, v)
    with attnorm.override_sdpa("softmax"):
        torch.testing.assert_close(F.scaled_dot_product_attention(q, k, v), expected)
    q, k = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 6, 8)
    with attnorm.override_sdpa("softmax"), pytest.raises(RuntimeError, match="enable_gqa"):
        F.scaled_dot_product_attention(q, k, k)


def test_multihead_attention_rejects_what_torch_rejects():
    layer = attnorm.nn.MultiheadAttention(8, 2)
    x = torch.randn(3, 2, 8)
    with pytest.raises(TypeError, match="key_padding_mask"):
        layer(x, x, x, key_padding_mask=torch.zeros(2, 3, dtype=torch.uint8))
    with pytest.raises(TypeError, match="attn_mask"):
        layer(x, x, x, attn_mask=torch.zeros(3, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="4-D query"):
        layer(x[None], x[None], x[None])


def test_a_nan_sink_number_is_refused_and_minus_inf_means_none():
    x = torch.randn(2, 5, dtype=torch.float64)
    for function in (AF.softmax, AF.sparsemax, AF.self_adjusted_softmax):
        with pytest.raises(ValueError, match="sink"):
            function(x, sink=float("nan"))
    torch.testing.assert_close(AF.softmax(x, sink=-math.inf), torch.softmax(x, -1))


def test_a_nan_gain_is_not_loaded_and_the_module_keeps_its_gain():
    module = attnorm.L2NormAttention(heads=2, gain=1.5)
    with pytest.raises(ValueError, match="gain"):
        module.load_state_dict({"gain": torch.tensor([1.0, math.nan])})
    torch.testing.assert_close(module.gain.detach(), torch.full((2,), 1.5))
    module.load_state_dict({"gain": torch.tensor([0.5, 2.0])})
    torch.testing.assert_close(module.gain.detach(), torch.tensor([0.5, 2.0]))


def test_taylor_order_zero_is_uniform_with_a_zero_gradient():
    x = torch.randn(2, 5, dtype=torch.float64, requires_grad=True)
    for weights in (AF.taylor_softmax(x, 0), attnorm.TaylorSoftmax(0)(x)):
        torch.testing.assert_close(weights, torch.full((2, 5), 0.2, dtype=torch.float64))
        (grad,) = torch.autograd.grad((weights * torch.randn(2, 5, dtype=torch.float64)).sum(), x)
        torch.testing.assert_close(grad, torch.zeros_like(x))


def _materialised(spec, q, k, v, additive=None):
    """float64 attention written out: the normalizer over the whole scores (its own module, not attention())."""
    x = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if additive is not None:
        x = x + additive
    return attnorm.make(spec)(x) @ v


@pytest.mark.parametrize("spec", ["sparsemax", "entmax:alpha=1.5", "sa_softmax"])
def test_the_blocked_route_under_torch_func_and_tracing(force_blocked, spec):
    q, k, v = _qkv(1, 2, 5, 4, lk=6, dv=4, seed=3)
    attend = lambda q: attnorm.attention(q, k, v, spec)  # noqa: E731
    torch.testing.assert_close(torch.func.vmap(attend)(q[None])[0], _materialised(spec, q, k, v))
    expected = torch.func.grad(lambda q: _materialised(spec, q, k, v).sum())(q)
    torch.testing.assert_close(torch.func.grad(lambda q: attend(q).sum())(q), expected)
    expected = torch.func.jacrev(lambda q: _materialised(spec, q, k, v))(q)
    torch.testing.assert_close(torch.func.jacrev(attend)(q), expected)
    with torch.no_grad():
        traced = torch.jit.trace(attend, (q,), check_trace=False)
    torch.testing.assert_close(traced(q), attend(q))


@pytest.mark.parametrize("mask", ["none", "causal", "window"])
def test_the_blocked_route_key_gradients_take_batched_gradients(force_blocked, mask):
    """The blocked backward adds each query block's key and value gradients into its key range; with a batched
    incoming gradient (``jacobian(vectorize=True)``) a range of every key took no in-place add ("Batching rule
    not implemented for aten::alias"), a partial one (causal, window) did."""
    q, k, v = _qkv(1, 2, 5, 4, lk=5, dv=3, seed=6)
    structured = {"none": None, "causal": attnorm.causal_mask(),
                  "window": attnorm.sliding_window_mask(2) & attnorm.causal_mask()}[mask]
    attend = lambda q, k, v: attnorm.attention(q, k, v, "sparsemax", attn_mask=structured)  # noqa: E731
    vectorized = torch.autograd.functional.jacobian(attend, (q, k, v), vectorize=True)
    looped = torch.autograd.functional.jacobian(attend, (q, k, v))
    for got, want in zip(vectorized, looped, strict=True):
        torch.testing.assert_close(got, want)


def test_the_blocked_route_backward_takes_batched_gradients(force_blocked):
    q, k, v = _qkv(1, 2, 5, 4, lk=6, dv=4, seed=4)
    additive = torch.randn(1, 1, 5, 6, dtype=torch.float64)
    inputs = (q, additive)
    jacobian = torch.autograd.functional.jacobian(
        lambda q, a: attnorm.attention(q, k, v, "sparsemax", attn_mask=a), inputs, vectorize=True)
    expected = torch.autograd.functional.jacobian(lambda q, a: _materialised("sparsemax", q, k, v, a), inputs)
    for got, want in zip(jacobian, expected, strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("spec", ["softmax", "ssmax", "sparsemax", "topk:k=2", "sa_softmax", "entmax:alpha=1.3"])
@pytest.mark.parametrize("mask", ["is_causal", "padding", "window", "causal_bottom_right"])
def test_no_query_rows_under_a_structured_mask_give_an_empty_output(spec, mask):
    """No query rows (an empty chunk of a chunked prefill): SDPA gives an empty output; structured masks raised
    (``reshape(-1, 0)`` in ``key_range``) for softmax and Scalable-Softmax, and under a window for all."""
    q = torch.randn(1, 2, 0, 8, requires_grad=True)
    k, v = torch.randn(1, 2, 5, 8, requires_grad=True), torch.randn(1, 2, 5, 8)
    kwargs = {"is_causal": {"is_causal": True}, "padding": {"attn_mask": attnorm.key_padding_mask(torch.tensor([3]))},
              "window": {"attn_mask": attnorm.sliding_window_mask(2)},
              "causal_bottom_right": {"attn_mask": attnorm.causal_mask(5)}}[mask]
    out = attnorm.attention(q, k, v, spec, **kwargs)
    assert out.shape == F.scaled_dot_product_attention(q, k, v, is_causal=True).shape == (1, 2, 0, 8)
    out.sum().backward()
    assert q.grad.shape == q.shape and torch.equal(k.grad, torch.zeros_like(k))
