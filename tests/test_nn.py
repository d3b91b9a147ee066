"""attnorm.nn.MultiheadAttention and replace_multihead_attention against torch.nn.MultiheadAttention.

Reference: torch's own module with the same weights; with softmax the outputs,
returned weights and every gradient agree to float32 tolerance over the flag grid.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from torch import nn

import attnorm
from attnorm.nn import MultiheadAttention, replace_multihead_attention

E, HEADS, N, L, S = 16, 4, 3, 5, 7
TOL = {"rtol": 1e-5, "atol": 2e-6}

CONSTRUCTIONS = [
    dict(batch_first=batch_first, bias=bias, add_bias_kv=bias_kv, add_zero_attn=zero_attn, kdim=kdim, vdim=kdim)
    for batch_first, bias, bias_kv, zero_attn, kdim in itertools.product(
        [False, True], [True, False], [False, True], [False, True], [None, 10]
    )
]
MASKS = ["none", "padding", "bool", "both", "float", "per_head_float_and_padding", "causal_hint"]


def _pair(**settings):
    torch.manual_seed(0)
    reference = nn.MultiheadAttention(E, HEADS, **settings)
    ours = MultiheadAttention(E, HEADS, **settings)
    ours.load_state_dict(reference.state_dict())
    return reference, ours


def _inputs(settings, kind: str, unbatched: bool = False):
    generator = torch.Generator().manual_seed(1)
    kdim = settings.get("kdim") or E
    lk = L if kind == "causal_hint" else S

    def shaped(length, features):
        x = torch.randn(N, length, features, generator=generator)
        x = x if settings.get("batch_first") else x.transpose(0, 1)
        return (x[0] if settings.get("batch_first") else x[:, 0]) if unbatched else x

    query, key, value = shaped(L, E), shaped(lk, kdim), shaped(lk, settings.get("vdim") or E)
    padding = torch.zeros(N, lk, dtype=torch.bool)
    padding[0, -2:] = padding[2, -3:] = True  # True = ignore; key 0 always stays
    bool_mask = torch.rand(L, lk, generator=generator) < 0.3
    bool_mask[:, 0] = False
    kwargs = {}
    if kind in ("padding", "both"):
        kwargs["key_padding_mask"] = padding
    if kind in ("bool", "both"):
        kwargs["attn_mask"] = bool_mask
    if kind == "float":
        kwargs["attn_mask"] = torch.randn(L, lk, generator=generator)
    if kind == "per_head_float_and_padding":
        kwargs["attn_mask"] = torch.randn(N * HEADS, L, lk, generator=generator)
        kwargs["key_padding_mask"] = torch.where(padding, -torch.inf, 0.0)
    if kind == "causal_hint":
        kwargs["attn_mask"] = nn.Transformer.generate_square_subsequent_mask(L)
        kwargs["is_causal"] = True
    if unbatched and "key_padding_mask" in kwargs:
        kwargs["key_padding_mask"] = kwargs["key_padding_mask"][0]
    if unbatched and kwargs.get("attn_mask") is not None and kwargs["attn_mask"].dim() == 3:
        kwargs["attn_mask"] = kwargs["attn_mask"][:HEADS]
    return (query, key, value), kwargs


def _run(module, inputs, kwargs, need_weights, average):
    inputs = [x.clone().requires_grad_() for x in inputs]
    out, weights = module(*inputs, need_weights=need_weights, average_attn_weights=average, **kwargs)
    loss = out.square().sum() + (0 if weights is None else (weights * torch.linspace(0, 1, weights.shape[-1])).sum())
    grads = torch.autograd.grad(loss, [*inputs, *module.parameters()])
    return out, weights, grads


def _pairwise(settings: dict) -> bool:
    """Eight of the 32 constructions hold every pair of options (d = a xor b, e = a xor c): the default run's."""
    a, b, c, d, e = (settings["batch_first"], not settings["bias"], settings["add_bias_kv"], settings["add_zero_attn"],
                     settings["kdim"] is not None)
    return d == (a != b) and e == (a != c)


@pytest.mark.parametrize("settings", [
    pytest.param(s, id="-".join(f"{k}={v}" for k, v in s.items()), marks=() if _pairwise(s) else pytest.mark.slow)
    for s in CONSTRUCTIONS])
def test_softmax_equals_torch_module(settings):
    reference, ours = _pair(**settings)
    assert list(ours.state_dict()) == list(reference.state_dict())
    for kind, need_weights, average, unbatched in itertools.product(MASKS, [True, False], [True, False], [False, True]):
        if unbatched and kind == "per_head_float_and_padding":
            continue
        inputs, kwargs = _inputs(settings, kind, unbatched)
        expected = _run(reference, inputs, kwargs, need_weights, average)
        got = _run(ours, inputs, kwargs, need_weights, average)
        case = f"{kind} need_weights={need_weights} average={average} unbatched={unbatched}"
        torch.testing.assert_close(got[0], expected[0], **TOL, msg=lambda m, case=case: f"{case}: output {m}")
        if need_weights:
            torch.testing.assert_close(got[1], expected[1], **TOL, msg=lambda m, case=case: f"{case}: weights {m}")
        else:
            assert got[1] is None and expected[1] is None
        for mine, theirs in zip(got[2], expected[2], strict=True):
            torch.testing.assert_close(mine, theirs, **TOL, msg=lambda m, case=case: f"{case}: gradient {m}")


def test_dropout_in_training_matches_torch_under_the_same_seed():
    reference, ours = _pair(dropout=0.3, batch_first=True)
    inputs, kwargs = _inputs({"batch_first": True}, "padding")
    for need_weights in (True, False):
        torch.manual_seed(5)
        expected = reference(*inputs, need_weights=need_weights, **kwargs)
        torch.manual_seed(5)
        got = ours(*inputs, need_weights=need_weights, **kwargs)
        if need_weights:  # the weights after dropout, as torch returns them
            torch.testing.assert_close(got[1], expected[1], **TOL)
            torch.testing.assert_close(got[0], expected[0], **TOL)
        else:  # SDPA draws its own dropout mask: only the statistics match
            assert got[0].shape == expected[0].shape and torch.isfinite(got[0]).all()


@pytest.mark.parametrize("spec", ["entmax:alpha=1.5", "sparsemax", "ssmax", "topk:k=2"])
def test_other_normalizers_differ_and_stay_finite(spec):
    reference, _ = _pair(batch_first=True)
    ours = replace_multihead_attention(copy.deepcopy(reference), spec)
    assert isinstance(ours, MultiheadAttention)
    inputs, kwargs = _inputs({"batch_first": True}, "both")
    expected, _ = reference(*inputs, **kwargs)
    got, weights = ours(*inputs, average_attn_weights=False, **kwargs)
    assert torch.isfinite(got).all() and (got - expected).abs().max() > 1e-3
    if spec != "ssmax":
        assert (weights == 0).any()  # sparse normalizers put exact zeros
    weights.sum().backward()


def test_replace_in_transformer_encoder_keeps_weights_and_skips_the_fused_path():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(E, HEADS, dim_feedforward=32, dropout=0.0, batch_first=True)
    encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False).eval()
    x = torch.randn(N, S, E)
    padding = torch.zeros(N, S, dtype=torch.bool)
    padding[1, -3:] = True
    with torch.no_grad():
        expected = encoder(x, src_key_padding_mask=padding)  # torch's fused inference path
    state = copy.deepcopy(encoder.state_dict())
    replace_multihead_attention(encoder, "softmax")
    assert all(isinstance(block.self_attn, MultiheadAttention) for block in encoder.layers)
    assert set(encoder.state_dict()) == set(state)
    with torch.no_grad():
        got = encoder(x, src_key_padding_mask=padding)
        torch.testing.assert_close(got[~padding], expected[~padding], **TOL)
        for block in encoder.layers:
            block.self_attn.normalizer = attnorm.Entmax(alpha=1.5)
        sparse = encoder(x, src_key_padding_mask=padding)
    assert torch.isfinite(sparse).all() and (sparse - expected)[~padding].abs().max() > 1e-3


def test_learnable_normalizer_trains_and_errors():
    module = MultiheadAttention(E, HEADS, normalizer=attnorm.ScalableSoftmax(learnable=True, num_heads=HEADS))
    assert {"normalizer.s", "normalizer.bias"} <= set(dict(module.named_parameters()))
    (query, _, _), _ = _inputs({}, "none")
    out, _ = module(query, query, query)
    out.sum().backward()
    assert module.normalizer.s.grad is not None
    with pytest.raises(RuntimeError, match="is_causal hint"):
        module(query, query, query, is_causal=True)
    with pytest.raises(ValueError, match="no torch.nn.MultiheadAttention"):
        replace_multihead_attention(nn.Linear(2, 2), "softmax")
