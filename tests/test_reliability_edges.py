"""Edge cases an independent fuzz of the normalizer functions found, against float64 definitions written here."""

from __future__ import annotations

import pytest
import torch

import attnorm.functional as F

entmax = pytest.importorskip("entmax")

F64 = torch.float64


def test_the_reference_computes_half_precision_in_float32_and_rounds_once():
    """bfloat16 Scalable-Softmax on two large scores: the float64 definition rounded to bfloat16 (the reference
    computed in bfloat16 gave [0.4375, 0.5625], 0.031 off)."""
    x = torch.tensor([-6720.0, -6784.0], dtype=torch.bfloat16)
    multiplier = 0.43 * torch.log(torch.tensor(2.0, dtype=F64)) - 0.3
    expected = torch.softmax(multiplier * x.double(), -1).to(torch.bfloat16)
    for backend in ("reference", "native"):
        got = F.scalable_softmax(x, s=0.43, bias=-0.3, backend=backend)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got, expected, rtol=0, atol=0, msg=backend)


def entmax_float64(x: torch.Tensor, alpha: float) -> torch.Tensor:
    """alpha-entmax of each row of ``x`` in float64: the ``entmax`` package's bisection, to float64's resolution."""
    return entmax.entmax_bisect(x.double(), alpha, dim=-1, n_iter=200)


@pytest.mark.parametrize("backend", ["reference", "native", "triton"])
@pytest.mark.parametrize("gap", [1e-7, 1e-5, 1e-3])
def test_entmax_near_alpha_one_in_float32(gap, backend):
    """float32 alpha-entmax just above alpha = 1 against float64 bisection (the reference computed in float32 was
    1.5e-4 off at alpha = 1 + 1e-5 and 1.2e-2 at 1 + 1e-7; the Triton row kernel 6e-4 and 3e-2 on these rows)."""
    if backend == "triton":
        pytest.importorskip("triton")
    x = torch.tensor([[0.5, -1.0, 1.0, 1.5, -0.3], [3.1, -4.2, 5.0, 0.7, 4.4]]) * 3
    got = F.entmax(x, 1 + gap, backend=backend)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), entmax_float64(x, 1 + gap), atol=2e-6, rtol=2e-5)


def test_fused_entmax_attention_near_alpha_one_takes_the_row_kernels():
    """Just above alpha = 1 the fused kernel's float32 weights were 0.13 off (alpha = 1 + 1e-7, 1e-3 at 1 + 1e-5):
    attention() leaves such alphas to the row kernels, which compute them in float64."""
    import attnorm

    pytest.importorskip("triton")
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 24, 16, generator=gen) for _ in range(3))
    for gap in (1e-7, 1e-5):
        weights = entmax_float64(q.double() @ k.double().transpose(-1, -2) / 4, 1 + gap)
        got = attnorm.attention(q, k, v, attnorm.Entmax(1 + gap, backend="triton"))
        torch.testing.assert_close(got.double(), weights @ v.double(), atol=2e-6, rtol=2e-5)


def test_reference_entmax_near_alpha_one_gives_no_nan_on_large_scores():
    """Scores of ~100 at alpha = 1 + 1e-4 gave NaN rows in float32; within the float32 tolerance of float64 now."""
    x = torch.randn(3, 10, generator=torch.Generator().manual_seed(0)) * 100
    for alpha in (1.0001, 1.001):
        y = F.entmax(x, alpha, backend="reference")
        assert torch.isfinite(y).all()
        torch.testing.assert_close(y.double(), entmax_float64(x, alpha), atol=2e-5, rtol=2e-5)


def test_a_misspelt_backend_raises_in_the_functions_too():
    with pytest.raises(ValueError, match="backend must be one of"):
        F.softmax(torch.randn(2, 4), backend="tirton")


def test_a_cap_beyond_the_compute_precision_raises_naming_softcap():
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match="softcap"):
        F.softmax(x, softcap=1e39)
    capped = 1e39 * torch.tanh(x.double() / 1e39)
    torch.testing.assert_close(F.softmax(x.double(), softcap=1e39), torch.softmax(capped, -1))


def test_attention_checks_the_cap_against_the_compute_precision_too():
    """``attnorm.attention`` takes the module's rule: a cap beyond float32 raises naming softcap (the fused route
    raised torch's "value cannot be converted to type float without overflow"), float64 inputs keep it."""
    import attnorm

    pytest.importorskip("triton")
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 24, 8, generator=gen) for _ in range(3))  # 24 query rows: the fused route
    with pytest.raises(ValueError, match="softcap"):
        attnorm.attention(q, k, v, attnorm.Sparsemax(backend="triton"), softcap=1e39)
    q, k, v = q.double(), k.double(), v.double()
    scores = 1e39 * torch.tanh(q @ k.transpose(-1, -2) / 8**0.5 / 1e39)
    expected = entmax.sparsemax(scores, dim=-1) @ v
    for normalizer in ("sparsemax", attnorm.Sparsemax(backend="triton")):
        torch.testing.assert_close(attnorm.attention(q, k, v, normalizer, softcap=1e39), expected)


@pytest.mark.parametrize("alpha", [1.2, 1.3, 1.7, 2.5])
def test_reference_entmax_below_alpha_two_resolves_the_smallest_support_weight(alpha):
    """float32 rows of spread scores: the smallest support weight is ~1e-8 at alpha = 1.2, which bisection on the
    weight itself over [0, 1] (32 halvings) left 5e-3 off in the other weights; bisected on its base
    ``y^(alpha - 1)`` (below alpha 2) every backend is within float32 rounding."""
    x = torch.randn(8, 24, generator=torch.Generator().manual_seed(0)) * 2
    expected = entmax_float64(x, alpha)
    for backend in ("reference", "native"):
        torch.testing.assert_close(F.entmax(x, alpha, backend=backend).double(), expected, atol=1e-6, rtol=1e-5,
                                   msg=backend)


def test_attention_checks_masks_dtypes_and_scale_and_broadcasts_like_sdpa():
    """Found by an independent fuzz: a 5-D mask of 4-D inputs enlarged the output silently (Scalable-Softmax, and
    every row normalizer with an additive one); masks that do not broadcast gave torch's size or index errors;
    mixed dtypes and a NaN scale went unchecked; a batch broadcast with GQA crashed the row normalizers."""
    import attnorm

    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 4, 5, 8, generator=gen) for _ in range(3))
    for normalizer in ("softmax", "ssmax", "sparsemax", "sa_softmax"):
        for mask in (torch.zeros(3, 2, 1, 5, 5), torch.ones(3, 2, 1, 5, 5, dtype=torch.bool),
                     torch.ones(5, 4, dtype=torch.bool), torch.zeros(5, 4)):
            with pytest.raises(ValueError, match="attn_mask"):
                attnorm.attention(q, k, v, normalizer, attn_mask=mask)
        keys = torch.tensor([True, True, False, True, False])  # (Lk,): one key mask for every row
        expected = attnorm.attention(q, k, v, normalizer, attn_mask=keys.expand(2, 4, 5, 5))
        torch.testing.assert_close(attnorm.attention(q, k, v, normalizer, attn_mask=keys), expected)
    with pytest.raises(ValueError, match="dtype"):
        attnorm.attention(q.half(), k, v)
    with pytest.raises(ValueError, match="scale"):
        attnorm.attention(q, k, v, scale=float("nan"))
    with pytest.raises(ValueError, match="heads"):
        attnorm.attention(q, k, v[:, :2])
    # batch dims broadcast and one value head serves every key head, as in SDPA
    q1, k2, v1 = q[:1], torch.randn(2, 2, 5, 8, generator=gen), torch.randn(2, 1, 5, 8, generator=gen)
    for normalizer in ("softmax", "sparsemax", "topk:k=2"):
        got = attnorm.attention(q1, k2, v1, normalizer, is_causal=True)
        expected = attnorm.attention(q1.expand(2, 4, 5, 8), k2, v1.expand(2, 2, 5, 8), normalizer, is_causal=True)
        torch.testing.assert_close(got, expected, msg=normalizer)


@pytest.mark.parametrize("magnitude", [1.0, 3.0, 10.0])
def test_half_precision_scalable_softmax_on_sdpa_is_within_pytorchs_own_error(magnitude):
    """The SDPA route folds the per-row multiplier into q, rounding ``c q`` to bfloat16: large logits lose digits
    (an independent fuzz: 0.7 off at logits ~500).  Held to FlashAttention's yardstick: no further from float64
    than PyTorch computing Scalable-Softmax in bfloat16 with materialised scores."""
    import attnorm

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 64, 32, generator=gen) * scale for scale in (magnitude, magnitude, 1.0))
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    exact = attnorm.attention(q.double(), k.double(), v.double(), "ssmax", is_causal=True)
    causal = torch.ones(64, 64, dtype=torch.bool).tril()
    eager = attnorm.ScalableSoftmax()((q @ k.transpose(-1, -2)) * 32**-0.5, causal) @ v
    routed = attnorm.attention(q, k, v, "ssmax", is_causal=True)
    assert (routed.double() - exact).abs().max() <= (eager.double() - exact).abs().max()


@pytest.mark.parametrize("normalizer", ["softmax", "sparsemax"])
def test_attention_compiles_fullgraph_across_sequence_lengths(normalizer):
    """A second sequence length makes Dynamo trace symbolic sizes: `not shape` on a mask's torch.Size and
    `Tensor.nbytes` (the blocked route's budget) failed there, for every normalizer with a tensor mask and for
    the row normalizers without one."""
    import attnorm

    torch._dynamo.reset()
    masked = torch.compile(lambda q, k, v, m: attnorm.attention(q, k, v, normalizer, attn_mask=m),
                           backend="eager", fullgraph=True)
    plain = torch.compile(lambda q, k, v: attnorm.attention(q, k, v, normalizer), backend="eager", fullgraph=True)
    gen = torch.Generator().manual_seed(5)
    for length in (5, 7, 9):
        q, k, v = (torch.randn(1, 2, length, 4, generator=gen) for _ in range(3))
        mask = torch.ones(length, length, dtype=torch.bool).tril()
        torch.testing.assert_close(masked(q, k, v, mask), attnorm.attention(q, k, v, normalizer, attn_mask=mask))
        torch.testing.assert_close(plain(q, k, v), attnorm.attention(q, k, v, normalizer))


def test_vmap_over_a_batched_tensor_parameter_equals_a_loop():
    """Checking a tensor parameter's values read them with bool(), data-dependent control flow under vmap."""
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(6))
    temperature = torch.tensor([[0.5], [1.0], [2.0]])
    got = torch.func.vmap(lambda row, t: F.softmax(row, temperature=t))(x, temperature)
    torch.testing.assert_close(got, torch.softmax(x / temperature, -1))
    alpha = torch.tensor([[1.3], [1.5], [2.0]])
    got = torch.func.vmap(lambda row, a: F.entmax(row, a))(x, alpha)
    expected = torch.stack([entmax_float64(x[i], float(alpha[i])) for i in range(3)]).float()
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)


def test_a_traced_float64_call_keeps_its_default_scale_in_float64():
    """Under torch.jit.trace a size is a traced tensor: ``q.shape[-1] ** -0.5`` became a float32 constant
    (outputs 1e-8 off in float64)."""
    import attnorm

    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, 5, 3, dtype=F64, generator=gen) for _ in range(3))

    class Attend(torch.nn.Module):
        def forward(self, q, k, v):
            return attnorm.attention(q, k, v, "sparsemax")

    traced = torch.jit.trace(Attend(), (q, k, v), check_trace=False)
    torch.testing.assert_close(traced(q, k, v), Attend()(q, k, v), rtol=1e-14, atol=1e-15)


def test_a_tensor_assigned_to_scalable_softmax_s_is_checked_like_a_number():
    """``m.s = float("nan")`` raised, ``m.s = torch.full(..., nan)`` was taken and gave NaN weights."""
    import attnorm

    module = attnorm.ScalableSoftmax(num_heads=2)
    for name in ("s", "bias"):
        with pytest.raises(ValueError, match=name):
            setattr(module, name, torch.full((2, 1, 1), float("nan")))
    module.s = torch.full((2, 1, 1), 0.5)
    x = torch.randn(1, 2, 3, 4, generator=torch.Generator().manual_seed(8))
    torch.testing.assert_close(module(x), torch.softmax(0.5 * torch.log(torch.tensor(4.0)) * x, -1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_scalable_softmax_on_sdpa_scales_q_in_one_kernel_without_a_gradient(dtype):
    """Without a gradient the SDPA route computes ``c q`` into q's dtype with one ``mul(out=)`` (the product and
    the cast were two launches of a decoding step): bit for bit the product rounded once, as with a gradient."""
    import attnorm

    gen = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(2, 4, 1, 16, generator=gen).to(dtype) for _ in range(3))
    k, v = (torch.randn(2, 4, 40, 16, generator=gen).to(dtype) for _ in range(2))
    padded = (torch.arange(40) >= torch.tensor([0, 25])[:, None]).reshape(2, 1, 1, 40)
    for normalizer in (attnorm.ScalableSoftmax(learnable=True, num_heads=4), attnorm.ScalableSoftmax()):
        for mask in (None, padded):
            with torch.no_grad():
                fast = attnorm.attention(q, k, v, normalizer, attn_mask=mask)
            slow = attnorm.attention(q.clone().requires_grad_(), k, v, normalizer, attn_mask=mask)
            assert torch.equal(fast, slow.detach())
