"""attnorm.override_sdpa against the real SDPA (softmax) and a float64 entmax-package reference.

The model under test is written here and calls ``F.scaled_dot_product_attention`` the
way nanoGPT-style code does (causal, grouped-query, masks, scale, dropout).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import attnorm

entmax = pytest.importorskip("entmax")


class TinyBlock(nn.Module):
    """Grouped-query self-attention calling SDPA directly."""

    def __init__(self, dim: int = 32, heads: int = 4, kv_heads: int = 2) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.head_dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x, **sdpa_kwargs):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.heads, -1).transpose(1, 2)  # (B, H, T, hd)
        k, v = self.kv(x).view(b, t, 2, self.kv_heads, -1).permute(2, 0, 3, 1, 4)  # (B, Hkv, T, hd) each
        y = F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **sdpa_kwargs)
        return self.out(y.transpose(1, 2).reshape(b, t, -1))


def _reference_entmax15(q, k, v, mask_allowed=None, additive=None, scale=None):
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1).double(), v.repeat_interleave(groups, 1).double()
    scores = q.double() @ k.transpose(-2, -1) * (scale or q.shape[-1] ** -0.5)
    if additive is not None:
        scores = scores + additive.double()
    if mask_allowed is not None:
        scores = scores.masked_fill(~mask_allowed, -torch.inf)
    return entmax.entmax15(scores, dim=-1) @ v


MASKS = ["causal", "bool", "float", "none"]


def _mask_kwargs(kind: str, t: int):
    generator = torch.Generator().manual_seed(3)
    if kind == "causal":
        return {"is_causal": True}
    if kind == "bool":
        allowed = torch.rand(2, 1, t, t, generator=generator) > 0.4
        allowed[..., 0] = True
        return {"attn_mask": allowed}
    if kind == "float":
        return {"attn_mask": torch.randn(1, 4, t, t, generator=generator), "scale": 0.3}
    return {}


@pytest.mark.parametrize("kind", MASKS)
def test_softmax_override_equals_sdpa_and_entmax_equals_reference(kind):
    torch.manual_seed(0)
    block, x = TinyBlock(), torch.randn(2, 9, 32)
    kwargs = _mask_kwargs(kind, 9)
    expected = block(x, **kwargs)
    with attnorm.override_sdpa("softmax"):
        got = block(x, **kwargs)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=2e-6)

    with attnorm.override_sdpa("entmax:alpha=1.5"):
        y = block(x, **kwargs)
    q, k, v = _qkv(block, x)
    allowed = kwargs.get("attn_mask") if kind == "bool" else None
    if kind == "causal":
        allowed = torch.ones(9, 9, dtype=torch.bool).tril()
    additive = kwargs.get("attn_mask") if kind == "float" else None
    attended = _reference_entmax15(q, k, v, allowed, additive, kwargs.get("scale")).float()
    reference = block.out(attended.transpose(1, 2).reshape(2, 9, -1))
    torch.testing.assert_close(y, reference, rtol=1e-5, atol=2e-6)
    assert (y - expected).abs().max() > 1e-3


def _qkv(block, x):
    b, t, _ = x.shape
    q = block.q(x).view(b, t, block.heads, -1).transpose(1, 2)
    k, v = block.kv(x).view(b, t, 2, block.kv_heads, -1).permute(2, 0, 3, 1, 4)
    return q, k, v


def test_gradients_flow_to_learnable_parameters_and_gqa_needs_the_flag():
    block, x = TinyBlock(), torch.randn(2, 6, 32)
    normalizer = attnorm.Entmax(alpha=1.4, learnable=True, num_heads=4)
    with attnorm.override_sdpa(normalizer):
        block(x, is_causal=True).sum().backward()
    assert normalizer.alpha_logit.grad.abs().sum() > 0 and block.q.weight.grad is not None
    q, k, v = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
    with attnorm.override_sdpa("sparsemax"), pytest.raises(RuntimeError, match="enable_gqa=True"):
        F.scaled_dot_product_attention(q, k, v)
    with attnorm.override_sdpa("softmax"):
        torch.manual_seed(0)
        dropped = F.scaled_dot_product_attention(q, q, q, dropout_p=0.5)
    assert torch.isfinite(dropped).all()


def test_compiled_model_inside_the_override_equals_eager():
    torch.manual_seed(0)
    block, x = TinyBlock(), torch.randn(2, 7, 32)
    with attnorm.override_sdpa("sparsemax"):
        expected = block(x, is_causal=True)
        compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
        got = compiled(x, is_causal=True)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
