"""Packed sequences: attention() under ``document_mask(cu_seqlens)`` equals each document alone.

Several documents share one row; ``document_mask(cu_seqlens)`` (``& causal_mask()`` for
causal training) keeps every query inside its own document, so the packed result must
equal :func:`attnorm.attention` run on each document separately, for every normalizer
(``n`` counted per document: Scalable-Softmax, sigmoid, fractional top-k).  The
separately-run results are the ones tests/test_attention.py checks against float64
references; softmax and Scalable-Softmax are also checked here against the formula
itself.  Each comparison runs on the default routes and with the blocked route forced
(one query row per block), and the fused route with the Triton backend.
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch

import attnorm

attention_module = importlib.import_module("attnorm.attention")

B, H, HKV, D = 2, 4, 2, 8  # grouped-query attention: two query heads per key head

# id -> (cu_seqlens, packed length); positions at or past the last bound form one more document
PACKINGS = {
    "3+1+5+2": ([0, 3, 4, 9], 11),
    "1+1+1": ([0, 1, 2, 3], 3),
    "one_document": ([0], 6),
    "empty_documents_4+3": ([0, 4, 4, 7, 7], 7),
    "17+1+2": ([0, 17, 18], 20),  # a document longer than attention's decoding rows
}


def per_head_ssmax() -> attnorm.ScalableSoftmax:
    normalizer = attnorm.ScalableSoftmax(learnable=True, num_heads=H).double()
    with torch.no_grad():
        normalizer.s.copy_(torch.tensor([0.3, 0.6, 0.9, 1.4], dtype=torch.float64).view(H, 1, 1))
        normalizer.bias.copy_(torch.tensor([0.0, 0.2, -0.1, 0.5], dtype=torch.float64).view(H, 1, 1))
    return normalizer


def per_head_entmax() -> attnorm.Entmax:
    normalizer = attnorm.Entmax(alpha=1.5, learnable=True, num_heads=H).double()
    with torch.no_grad():
        normalizer.alpha_logit.copy_(torch.tensor([-1.0, 0.0, 0.5, 1.5], dtype=torch.float64).view(H, 1, 1))
    return normalizer


SPECS = {
    "softmax": lambda: attnorm.make("softmax"),
    "softmax_T0.7": lambda: attnorm.make("softmax:temperature=0.7"),
    "ssmax": lambda: attnorm.make("ssmax:s=0.6,bias=0.1"),
    "ssmax_learnable_per_head": per_head_ssmax,
    "sa_softmax": lambda: attnorm.make("sa_softmax"),
    "sa_softmax_plain": lambda: attnorm.make("sa_softmax:normalized=false"),
    "sparsemax": lambda: attnorm.make("sparsemax"),
    "entmax1.5": lambda: attnorm.make("entmax:alpha=1.5"),
    "entmax1.3": lambda: attnorm.make("entmax:alpha=1.3"),
    "entmax_learnable_per_head": per_head_entmax,
    "topk3": lambda: attnorm.make("topk:k=3"),
    "topk0.4": lambda: attnorm.make("topk:k=0.4,temperature=2.0"),
    "relu": lambda: attnorm.make("relu"),
    "relu2": lambda: attnorm.make("relu2"),
    "softplus": lambda: attnorm.make("softplus"),
    "sigmoid": lambda: attnorm.make("sigmoid"),
    "softmax1": lambda: attnorm.make("softmax1"),
    "taylor": lambda: attnorm.make("taylor"),
    "taylor_linear": lambda: attnorm.make("taylor:linear=true"),
    "l2norm_gain_per_head": lambda: attnorm.L2NormAttention(heads=H, gain=1.5).double(),
}
GRADIENT_SPECS = ["softmax", "ssmax_learnable_per_head", "sparsemax", "entmax_learnable_per_head", "sa_softmax"]


@pytest.fixture(params=["default_routes", "blocked", "blocks_of_4"])
def route(request, monkeypatch):
    """The default routes, or the blocked route forced with one query row per block, or with blocks of four
    rows that straddle documents (on the CPU each block computes the keys of its rows' documents only)."""
    if request.param == "blocked":
        request.getfixturevalue("force_blocked")
    if request.param == "blocks_of_4":
        monkeypatch.setattr(attention_module, "block_rows", lambda q, k, v: min(4, q.shape[-2]))
    return request.param


def documents(cu_seqlens: list[int], length: int) -> list[tuple[int, int]]:
    """Non-empty ``(start, stop)`` spans: one per pair of bounds, plus the positions past the last."""
    bounds = [*cu_seqlens, length]
    return [(start, stop) for start, stop in zip(bounds, bounds[1:], strict=False) if stop > start]


def packed_mask(cu_seqlens: list[int], causal: bool) -> attnorm.StructuredMask:
    mask = attnorm.document_mask(torch.tensor(cu_seqlens))
    return mask & attnorm.causal_mask() if causal else mask


def qkv(length: int, dtype=torch.float64, seed: int = 0, requires_grad: bool = False):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, length, D, generator=generator, dtype=torch.float64)
    k = torch.randn(B, HKV, length, D, generator=generator, dtype=torch.float64)
    v = torch.randn(B, HKV, length, D + 2, generator=generator, dtype=torch.float64)
    return tuple(t.to(dtype).requires_grad_(requires_grad) for t in (q, k, v))


def separately(normalizer, q, k, v, spans, causal: bool, **options):
    """attention() on each document alone, outputs concatenated along the query axis."""
    outs = [
        attnorm.attention(q[..., a:b, :], k[..., a:b, :], v[..., a:b, :], normalizer, is_causal=causal, **options)
        for a, b in spans
    ]
    return torch.cat(outs, dim=-2)


def registered_kind(name: str) -> type:
    try:
        return type(attnorm.make(name))
    except ValueError:  # a required argument: top-k's k
        return type(attnorm.make(name, k=1))


def test_every_registered_normalizer_is_covered():
    covered = {type(build()) for build in SPECS.values()}
    registered = {registered_kind(name) for name in attnorm.available()}
    assert registered <= covered, f"packed tests miss {sorted(kind.__name__ for kind in registered - covered)}"


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("spec", list(SPECS))
def test_packed_equals_each_document_alone(spec, causal, route):
    normalizer = SPECS[spec]()
    for name, (cu_seqlens, length) in PACKINGS.items():
        q, k, v = qkv(length)
        spans = documents(cu_seqlens, length)
        packed = attnorm.attention(q, k, v, normalizer, attn_mask=packed_mask(cu_seqlens, causal))
        expected = separately(normalizer, q, k, v, spans, causal)
        torch.testing.assert_close(packed, expected, rtol=1e-12, atol=1e-12, msg=f"packing {name}")


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("spec", list(SPECS))
def test_packed_weights_are_block_diagonal(spec, causal):
    normalizer = SPECS[spec]()
    cu_seqlens, length = PACKINGS["3+1+5+2"]
    q, k, v = qkv(length)
    mask = packed_mask(cu_seqlens, causal)
    _, weights = attnorm.attention(q, k, v, normalizer, attn_mask=mask, return_weights=True)
    expected = torch.zeros_like(weights)
    for a, b in documents(cu_seqlens, length):
        _, alone = attnorm.attention(q[..., a:b, :], k[..., a:b, :], v[..., a:b, :], normalizer, is_causal=causal,
                                     return_weights=True)
        expected[..., a:b, a:b] = alone
    torch.testing.assert_close(weights, expected, rtol=1e-12, atol=1e-12)


def scaled_softmax_formula(q, k, v, cu_seqlens, length, causal, s, bias):
    """Float64 ``softmax((s_h log n + bias_h) q k^T / sqrt(D)) v`` per document, ``n`` its allowed keys per row."""
    k, v = k.repeat_interleave(H // HKV, dim=1), v.repeat_interleave(H // HKV, dim=1)
    out = torch.empty(B, H, length, v.shape[-1], dtype=torch.float64)
    for a, b in documents(cu_seqlens, length):
        scores = q[..., a:b, :] @ k[..., a:b, :].transpose(-2, -1) / math.sqrt(D)  # (B, H, n, n)
        rows = torch.arange(b - a)
        allowed = rows[None, :] <= rows[:, None] if causal else torch.ones(b - a, b - a, dtype=torch.bool)
        n = allowed.sum(-1, keepdim=True).double()  # (n, 1)
        multiplier = s.view(H, 1, 1) * torch.log(n) + bias.view(H, 1, 1)  # (H, n, 1)
        weights = torch.softmax((multiplier * scores).masked_fill(~allowed, -math.inf), dim=-1)
        out[..., a:b, :] = weights @ v[..., a:b, :]
    return out


FORMULAS = {  # id -> (normalizer, s per head, bias per head); softmax is s log n + bias with s = 0, bias = 1 / T
    "softmax_T0.7": (lambda: attnorm.make("softmax:temperature=0.7"), [0.0] * H, [1 / 0.7] * H),
    "ssmax": (lambda: attnorm.make("ssmax:s=0.6,bias=0.1"), [0.6] * H, [0.1] * H),
    "ssmax_learnable_per_head": (per_head_ssmax, [0.3, 0.6, 0.9, 1.4], [0.0, 0.2, -0.1, 0.5]),
}


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("spec", list(FORMULAS))
def test_packed_softmax_and_ssmax_match_the_float64_formula(spec, causal, route):
    build, s, bias = FORMULAS[spec]
    s, bias = torch.tensor(s, dtype=torch.float64), torch.tensor(bias, dtype=torch.float64)
    for name, (cu_seqlens, length) in PACKINGS.items():
        q, k, v = qkv(length, seed=1)
        expected = scaled_softmax_formula(q, k, v, cu_seqlens, length, causal, s, bias)
        packed = attnorm.attention(q, k, v, build(), attn_mask=packed_mask(cu_seqlens, causal))
        torch.testing.assert_close(packed, expected, rtol=1e-12, atol=1e-12, msg=f"packing {name}")


@pytest.mark.parametrize("spec", GRADIENT_SPECS)
def test_packed_gradients_equal_the_sum_over_documents(spec, route):
    cu_seqlens, length = PACKINGS["3+1+5+2"]
    normalizer = SPECS[spec]()
    q, k, v = qkv(length, requires_grad=True)
    grad_out = torch.randn(B, H, length, D + 2, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    inputs = (q, k, v, *normalizer.parameters())

    packed = attnorm.attention(q, k, v, normalizer, attn_mask=packed_mask(cu_seqlens, True))
    packed_grads = torch.autograd.grad(packed, inputs, grad_out)
    alone = separately(normalizer, q, k, v, documents(cu_seqlens, length), True)
    alone_grads = torch.autograd.grad(alone, inputs, grad_out)
    for name, got, expected in zip(["q", "k", "v", "parameters"], packed_grads, alone_grads, strict=False):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12, msg=f"gradient of {name}")


FUSED_SPECS = {
    "sparsemax": lambda: attnorm.Sparsemax(backend="triton"),
    "entmax1.5": lambda: attnorm.Entmax(1.5, backend="triton"),
    "sa_softmax": lambda: attnorm.SelfAdjustedSoftmax(backend="triton"),
    "ssmax": lambda: attnorm.ScalableSoftmax(s=0.6, bias=0.1, backend="triton"),
}


@pytest.mark.parametrize("spec", list(FUSED_SPECS))
def test_fused_route_packed_equals_each_document_alone(spec, device, monkeypatch):
    pytest.importorskip("triton")
    from attnorm.routes import fused

    calls = []
    monkeypatch.setattr(attention_module, "DECODING_ROWS", 0)
    for name in ("attention", "scaled_softmax"):
        original = getattr(fused, name)
        monkeypatch.setattr(fused, name, lambda *args, original=original: calls.append(1) or original(*args))
    cu_seqlens, length = PACKINGS["3+1+5+2"]
    q, k, v = qkv(length, dtype=torch.float32)
    mask = attnorm.document_mask(torch.tensor(cu_seqlens, device=device)) & attnorm.causal_mask()
    packed = attnorm.attention(q.to(device), k.to(device), v.to(device), FUSED_SPECS[spec](), attn_mask=mask)
    assert calls, "the fused route did not run"
    expected = separately(SPECS[spec](), q.double(), k.double(), v.double(), documents(cu_seqlens, length), True)
    torch.testing.assert_close(packed.cpu().double(), expected, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("spec", ["ssmax", "sparsemax", "topk0.4", "sa_softmax"])
def test_one_packing_per_batch_row(spec, route):
    """cu_seqlens (B, D + 1): each batch row packs its own documents (a row's padding: repeated bounds)."""
    normalizer = SPECS[spec]()
    length, bounds = 10, [[0, 3, 7, 10], [0, 6, 6, 10]]
    q, k, v = qkv(length)
    mask = attnorm.document_mask(torch.tensor(bounds)) & attnorm.causal_mask()
    packed = attnorm.attention(q, k, v, normalizer, attn_mask=mask)
    for row, cu_seqlens in enumerate(bounds):
        spans = documents(cu_seqlens, length)
        expected = separately(normalizer, q[row : row + 1], k[row : row + 1], v[row : row + 1], spans, True)
        torch.testing.assert_close(packed[row : row + 1], expected, rtol=1e-12, atol=1e-12, msg=f"row {row}")


def test_a_block_reaches_only_its_rows_documents_keys():
    """The blocked route's key span per block of rows (CPU: from the mask's values), against spans worked out by
    hand: two packings, causal, blocks of 16 rows; and key lengths under a causal mask."""
    from attnorm.routes import blocked

    q = torch.zeros(2, 1, 64, 4)
    packings = attnorm.document_mask(torch.tensor([[0, 16, 40, 64], [0, 32, 48, 64]])) & attnorm.causal_mask()
    assert blocked._spans(packings, q, 64, 16) == [(0, 16), (0, 32), (16, 48), (40, 64)]
    padded = attnorm.causal_mask() & attnorm.key_padding_mask(torch.tensor([20, 10]))
    assert blocked._spans(padded, q, 64, 16) == [(0, 16), (0, 20), (0, 20), (0, 20)]
    assert blocked.computed_share(packings, q, 64, 16) == (16 * 16 + 16 * 32 + 16 * 32 + 16 * 24) / 64**2
