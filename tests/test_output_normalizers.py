"""Output normalizers: L2-normalised attention (Mongaras & Larson, arXiv 2507.23632) against float64 formulas.

The reference is the direct formula ``N_i / ||N_i||``, ``N_i = sum_j exp(s_ij) v_j`` over allowed keys,
in float64 without softmax: the tests prove the identity with ``o / ||o||`` (o = SDPA's output).
"""

from __future__ import annotations

import math

import pytest
import torch

import attnorm
from attnorm.normalizers.registry import register_kind

GENERATOR_SEED = 0


def l2_reference(q, k, v, scale, allowed=None, additive=None):
    """(out, weights) of ``N_i / ||N_i||`` in float64 with ``N_i = sum_j exp(s_ij) v_j``; zero where N_i = 0."""
    q, k, v = q.double(), k.double(), v.double()
    if k.shape[-3] != q.shape[-3]:
        groups = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(groups, -3), v.repeat_interleave(groups, -3)
    scores = scale * q @ k.transpose(-2, -1)
    if additive is not None:
        scores = scores + additive.double()
    exps = torch.exp(scores)  # moderate scores: no shift needed in float64
    if allowed is not None:
        exps = torch.where(allowed, exps, 0.0)
    numerator = exps @ v
    squared = numerator.square().sum(-1, keepdim=True)
    inverse = torch.where(squared > 0, 1 / torch.sqrt(torch.where(squared > 0, squared, 1.0)), 0.0)
    return numerator * inverse, exps * inverse


def qkv(*shape, heads_kv=None, dtype=torch.float64, seed=GENERATOR_SEED):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(*shape, generator=generator, dtype=torch.float64)
    kv_shape = list(shape)
    if heads_kv is not None:
        kv_shape[-3] = heads_kv
    k, v = (torch.randn(*kv_shape, generator=generator, dtype=torch.float64) for _ in range(2))
    return q.to(dtype), k.to(dtype), v.to(dtype)


def test_make_returns_an_output_normalizer_that_attention_accepts():
    module = attnorm.make("l2norm")
    assert isinstance(module, attnorm.OutputNormalizer) and isinstance(module, attnorm.L2NormAttention)
    assert attnorm.make(module) is module
    assert "l2norm" in attnorm.available()
    register_kind(attnorm.OutputNormalizer)  # idempotent
    with pytest.raises(TypeError, match="spec must be a string or a Normalizer or OutputNormalizer"):
        attnorm.make(3)


@pytest.mark.parametrize("mask_kind", ["none", "causal", "bool", "padding", "additive"])
def test_equals_the_direct_formula_in_float64(mask_kind):
    q, k, v = qkv(2, 3, 6, 5)
    allowed, options = None, {}
    if mask_kind == "causal":
        allowed, options = torch.ones(6, 6, dtype=torch.bool).tril(), {"is_causal": True}
    elif mask_kind == "bool":
        allowed = torch.rand(2, 1, 6, 6, generator=torch.Generator().manual_seed(1)) < 0.6
        allowed[0, 0, 2] = False  # a fully masked row
        options = {"attn_mask": allowed}
    elif mask_kind == "padding":
        options = {"attn_mask": attnorm.key_padding_mask(torch.tensor([4, 0]))}
        allowed = (torch.arange(6) < torch.tensor([4, 0])[:, None]).reshape(2, 1, 1, 6)
    additive = None
    if mask_kind == "additive":
        additive = torch.randn(6, 6, dtype=torch.float64).masked_fill(torch.eye(6, dtype=torch.bool), -math.inf)
        options = {"attn_mask": additive}
    expected, expected_weights = l2_reference(q, k, v, 5**-0.5, allowed, additive)
    out, weights = attnorm.attention(q, k, v, "l2norm", return_weights=True, **options)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(weights, expected_weights, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(attnorm.attention(q, k, v, "l2norm", **options), expected, rtol=1e-12, atol=1e-14)
    if mask_kind in ("bool", "padding"):
        empty = ~allowed.expand(2, 3, 6, 6).any(-1)
        assert empty.any() and (out[empty] == 0).all() and not out.isnan().any()


def test_gqa_zero_values_and_length_one():
    q, k, v = qkv(1, 4, 7, 3, heads_kv=2)
    expected, _ = l2_reference(q, k, v, 0.7)
    torch.testing.assert_close(attnorm.attention(q, k, v, "l2norm", scale=0.7), expected, rtol=1e-12, atol=1e-14)
    out = attnorm.attention(q, k, torch.zeros_like(v), "l2norm")
    assert torch.equal(out, torch.zeros_like(out))
    one = attnorm.attention(q[..., :1, :], k[..., :1, :], v[..., :1, :], "l2norm")
    torch.testing.assert_close(one, v[..., :1, :].repeat_interleave(2, -3) / v[..., :1, :].norm(dim=-1, keepdim=True)
                               .repeat_interleave(2, -3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_low_precision_and_extreme_scores_give_no_nan(dtype):
    q, k, v = qkv(1, 2, 5, 4, dtype=dtype)
    big = (q.float() * 1e3).to(dtype)
    out = attnorm.attention(big, k, v, "l2norm", is_causal=True)
    assert out.dtype == dtype and not out.isnan().any()
    torch.testing.assert_close(out.float().norm(dim=-1), torch.ones(1, 2, 5), rtol=0, atol=2e-2)


def test_gradients_are_finite_on_fully_masked_rows_and_match_the_formula():
    q, k, v = (t.requires_grad_(True) for t in qkv(1, 2, 4, 3))
    mask = torch.ones(4, 4, dtype=torch.bool).tril()
    mask[1] = False
    out = attnorm.attention(q, k, v, "l2norm", attn_mask=mask)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    expected = torch.autograd.grad(l2_reference(q, k, v, 3**-0.5, mask)[0].sum(), (q, k, v))
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert torch.autograd.gradcheck(lambda *t: attnorm.attention(*t, "l2norm", attn_mask=mask), (q, k, v))


def test_learnable_per_head_gain():
    q, k, v = qkv(2, 3, 5, 4)
    module = attnorm.L2NormAttention(heads=3, gain=2.0).double()
    expected, _ = l2_reference(q, k, v, 0.5)
    torch.testing.assert_close(module(q, k, v, scale=0.5), 2 * expected)
    module(q, k, v).sum().backward()
    assert module.gain.grad is not None and module.gain.grad.shape == (3,)
    assert [name for name, _ in module.named_parameters()] == ["gain"]
    with pytest.raises(ValueError, match="heads must be an int >= 1"):
        attnorm.L2NormAttention(heads=0)
    with pytest.raises(ValueError, match="gain has 3 heads"):
        module(*qkv(1, 2, 5, 4))


def test_hf_style_patch_uses_l2norm_through_attention():
    transformers = pytest.importorskip("transformers")
    from attnorm.integrations.transformers import patch

    config = transformers.LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 50, (1, 9))
    records = []
    with torch.no_grad(), patch(model, "l2norm", recorder=lambda *args: records.append(args)):
        logits = model(ids).logits
    assert not logits.isnan().any()
    _, query, key, value, weights = records[0]
    expected, expected_weights = l2_reference(query, key, value, 4**-0.5, torch.ones(9, 9, dtype=torch.bool).tril())
    torch.testing.assert_close(weights.double(), expected_weights, rtol=1e-4, atol=1e-5)
