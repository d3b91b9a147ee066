"""Triton kernels against the float64 torch reference (on CPU: Triton's interpreter).

Every normalizer x mask kind x row path (one block in registers, or multi-pass
with the single-block limit forced down) in float32, and float16/bfloat16 on a
key-padding mask.  The scores hold -inf entries, a fully masked row, a +inf row
and a +inf at a position some masks exclude.  Outputs (and per-row statistics)
are poisoned with NaN before every kernel run, so an element a kernel forgets to
write fails the comparison.
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

import attnorm  # noqa: E402
import attnorm.functional as F  # noqa: E402
from attnorm.kernels.triton import launch  # noqa: E402

# The interpreter evaluates masked-off lanes too (e.g. exp(-inf - -inf)); numpy warns about them.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

BATCH, HEADS, QUERIES = 2, 2, 3
SINGLE_LENGTH = 37  # one block of 64 lanes
MULTI_LENGTH = 21  # three blocks of 8 once the single-block limit is forced to 8
FORCED_BLOCK = 8

# float16/bfloat16 outputs are rounded to the input dtype (2^-11 and 2^-8 relative).
TOLERANCES = {
    torch.float32: {"atol": 2e-6, "rtol": 2e-5},
    torch.float16: {"atol": 1e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 8e-3, "rtol": 1.6e-2},
}
GRADIENT_SLACK = 5  # gradients (and parameter gradients, sums over rows) get 5x the tolerance


def per_head(*values: float) -> torch.Tensor:
    """A per-head parameter broadcasting over scores (B, H, Lq, Lk)."""
    return torch.tensor(values).reshape(-1, 1, 1)


CASES = {
    "softmax": (F.softmax, {"temperature": 0.7}),
    "softmax-per-head": (F.softmax, {"temperature": per_head(0.5, 1.5)}),
    "scalable-softmax": (F.scalable_softmax, {"s": 0.43, "bias": 0.0}),
    "scalable-softmax-per-head": (F.scalable_softmax, {"s": per_head(0.3, -0.2), "bias": per_head(0.1, 0.5)}),
    "self-adjusted": (F.self_adjusted_softmax, {}),
    "self-adjusted-plain": (F.self_adjusted_softmax, {"normalized": False}),
    "sparsemax": (F.sparsemax, {}),
    "entmax-1.5": (F.entmax, {"alpha": 1.5}),
    "entmax-per-head": (F.entmax, {"alpha": per_head(1.0, 1.3)}),  # head 0 is softmax
    "topk-3": (F.topk_softmax, {"k": 3}),
    "topk-fraction": (F.topk_softmax, {"k": 0.2, "temperature": per_head(0.5, 2.0)}),
}
MASK_KINDS = ("none", "bool", "causal", "key-padding")


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    def empty(shape, dtype, device):
        return torch.full(shape, math.nan, dtype=dtype, device=device)

    monkeypatch.setattr(launch, "empty", empty)


PATHS = ("single-block", "multi-pass")


def row_length(path: str, monkeypatch) -> int:
    """Row length for ``path``; multi-pass forces rows of 21 through blocks of 8."""
    if path == "multi-pass":
        monkeypatch.setattr(launch, "SINGLE_BLOCK_MAX", FORCED_BLOCK)
        monkeypatch.setattr(launch, "MULTI_PASS_BLOCK", FORCED_BLOCK)
        return MULTI_LENGTH
    return SINGLE_LENGTH


def grid(dtypes: tuple[torch.dtype, ...]) -> list:
    """Every (case, mask kind, path, dtype).  The interpreter is slow: the default run keeps
    every single-block float32 combination, every case and every mask kind once on the
    multi-pass path, and every case in half precision on one block; the rest is marked slow."""
    combinations = []
    for index, case in enumerate(CASES):
        for mask_kind in MASK_KINDS:
            for path in PATHS:
                for dtype in dtypes:
                    if path == "single-block":
                        fast = dtype == torch.float32 or mask_kind == "key-padding"
                    else:
                        fast = dtype == torch.float32 and mask_kind == MASK_KINDS[index % len(MASK_KINDS)]
                    marks = () if fast else (pytest.mark.slow,)
                    ids = f"{case}-{mask_kind}-{path}-{str(dtype).removeprefix('torch.')}"
                    combinations.append(pytest.param(case, mask_kind, path, dtype, marks=marks, id=ids))
    return combinations


def make_scores(length: int, seed: int = 0) -> torch.Tensor:
    # Distinct multiples of 1/8 in every row: exact in float16 and bfloat16, so top-k has no
    # ties to break (the kernel and torch.topk may break them differently).
    generator = torch.Generator().manual_seed(seed)
    ranks = torch.rand(BATCH, HEADS, QUERIES, length, generator=generator).argsort(-1)
    x = (ranks - length // 2) / 8
    x[0, 0, 1, ::3] = -math.inf  # -inf scores count as masked
    x[1, 1, 2] = -math.inf  # a fully masked row
    x[1, 0, 0, [3, 7]] = math.inf  # a +inf row: uniform over its +inf positions
    x[0, 1, 2, length - 1] = math.inf  # excluded by the key-padding mask, a +inf row otherwise
    return x


def make_mask(kind: str, length: int) -> torch.Tensor | attnorm.StructuredMask | None:
    if kind == "none":
        return None
    if kind == "bool":
        generator = torch.Generator().manual_seed(1)
        allowed = torch.rand(QUERIES, length, generator=generator) > 0.3
        allowed[1] = False  # a fully masked query, broadcast over batch and heads
        allowed[:, [3, 7]] = True
        return allowed
    if kind == "causal":
        return attnorm.causal_mask(length - QUERIES)  # bottom-right aligned, as with a KV cache
    return attnorm.key_padding_mask(torch.tensor([length - 4, 9]))


def outputs_and_gradients(fn, x, mask, params, backend, dtype):
    """Weights and the gradients of ``sum(weights * upstream)`` w.r.t. x and every tensor parameter."""
    x = x.to(dtype).requires_grad_()
    params = {
        name: value.to(torch.float64 if dtype == torch.float64 else torch.float32).requires_grad_()
        if isinstance(value, torch.Tensor)
        else value
        for name, value in params.items()
    }
    out = fn(x, mask=mask, backend=backend, **params)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    inputs = [x] + [value for value in params.values() if isinstance(value, torch.Tensor)]
    return out, torch.autograd.grad(out, inputs, upstream)


def assert_matches_reference(fn, params, x, mask, dtype, tolerance=None):
    tolerance = tolerance or TOLERANCES[dtype]
    x = x.to(dtype)  # the reference sees exactly the scores the kernel sees
    out, grads = outputs_and_gradients(fn, x, mask, params, "triton", dtype)
    expected_out, expected_grads = outputs_and_gradients(fn, x, mask, params, "torch", torch.float64)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), expected_out, **tolerance)
    grad_tolerance = {key: value * GRADIENT_SLACK for key, value in tolerance.items()}
    for name, grad, expected in zip(["x", *params], grads, expected_grads, strict=False):
        torch.testing.assert_close(grad.double(), expected, **grad_tolerance, msg=lambda m, n=name: f"d/d{n}: {m}")


@pytest.mark.parametrize(("case", "mask_kind", "path", "dtype"), grid(tuple(TOLERANCES)))
def test_matches_float64_reference(case, mask_kind, path, dtype, monkeypatch):
    fn, params = CASES[case]
    length = row_length(path, monkeypatch)
    assert_matches_reference(fn, params, make_scores(length), make_mask(mask_kind, length), dtype)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", CASES)
def test_nan_propagates_over_allowed_positions_only(case, path, monkeypatch):
    fn, params = CASES[case]
    length = row_length(path, monkeypatch)
    x = torch.randn(1, HEADS, 2, length, generator=torch.Generator().manual_seed(3))
    x[0, 0, 0, 4] = math.nan  # allowed: the row's allowed positions become NaN, the masked ones 0
    x[0, 1, 1, 5] = math.nan  # masked: the row is unaffected
    mask = torch.ones(length, dtype=torch.bool)
    mask[[5, 6]] = False
    out = fn(x, mask=mask, backend="triton", **params)
    expected = fn(x.double(), mask=mask, backend="torch", **params)
    torch.testing.assert_close(out.double(), expected, equal_nan=True, **TOLERANCES[torch.float32])
    assert out[0, 0, 0, 4].isnan() and not out[0, 1, 1].isnan().any()


@pytest.mark.parametrize("path", PATHS)
def test_topk_keeps_exactly_k_breaking_ties_by_index(path, monkeypatch):
    length = row_length(path, monkeypatch)
    x = torch.zeros(2, length)
    x[0, [2, 9, 11, 17]] = 3.0  # four-way tie for the 2nd..4th places behind position 20
    x[0, 20] = 4.0
    x[1, 6] = math.nan  # NaN ranks above every score, as in torch.topk
    out = F.topk_softmax(x, 3, backend="triton")
    kept = torch.zeros_like(x, dtype=torch.bool)
    kept[0, [2, 9, 20]] = True
    expected = torch.softmax(x[0].masked_fill(~kept[0], -math.inf), -1)
    torch.testing.assert_close(out[0], expected)
    assert out[1, 6].isnan() and (out[1] != 0).sum() == 3


@pytest.mark.parametrize("alpha", [1.0, 1.25, 1.5, 2.0])
def test_entmax_long_rows_match_the_entmax_package(alpha):
    entmax_package = pytest.importorskip("entmax")
    x = 3 * torch.randn(2, 300, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    references = {
        1.0: lambda z: torch.softmax(z, -1),
        1.5: entmax_package.entmax15,
        2.0: entmax_package.sparsemax,
    }
    reference = references.get(alpha, lambda z: entmax_package.entmax_bisect(z, alpha, n_iter=100))
    scores = x.float().requires_grad_()
    out = F.entmax(scores, alpha, backend="triton")
    upstream = torch.randn(x.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    (grad,) = torch.autograd.grad(out, scores, upstream.float())
    exact = x.requires_grad_()
    expected = reference(exact)
    (expected_grad,) = torch.autograd.grad(expected, exact, upstream)
    torch.testing.assert_close(out.sum(-1).double(), torch.ones(2, dtype=torch.float64), atol=1e-6, rtol=0)
    torch.testing.assert_close(out.double(), expected, **TOLERANCES[torch.float32])
    torch.testing.assert_close(grad.double(), expected_grad, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("alpha", [2.5, 3.0])
def test_entmax_above_two(alpha, path, monkeypatch):
    # For alpha > 2, weights near the threshold go like (z - tau)^(1/(alpha-1)) with an
    # exponent < 1: one float32 rounding of tau moves them by ~sqrt(eps) relative.
    length = row_length(path, monkeypatch)
    tolerance = {"atol": 5e-5, "rtol": 1e-4}
    x = make_scores(length)
    assert_matches_reference(F.entmax, {"alpha": alpha}, x, make_mask("bool", length), torch.float32, tolerance)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize(
    ("op", "params"),
    [
        ("softmax", {"temperature": 0.5}),
        ("scalable_softmax", {"s": 0.43, "bias": 0.1}),
        ("self_adjusted_softmax", {"normalized": True}),
        ("sparsemax", {}),
        ("entmax", {"alpha": 1.5}),
        ("topk_softmax", {"k": 4, "temperature": 1.0}),
    ],
)
def test_kernels_read_half_precision_directly(op, params, dtype):
    from attnorm.kernels import dispatch

    row_op = dispatch.resolve(op, torch.empty(0), "triton")
    x = make_scores(SINGLE_LENGTH)[:, :, :2].to(dtype).requires_grad_()
    out = row_op(x, attnorm.key_padding_mask(torch.tensor([30, 9])), **params)
    (grad,) = torch.autograd.grad(out, x, torch.ones_like(out))
    wide = x.detach().float().requires_grad_()
    expected = row_op(wide, attnorm.key_padding_mask(torch.tensor([30, 9])), **params)
    (expected_grad,) = torch.autograd.grad(expected, wide, torch.ones_like(expected))
    assert out.dtype == grad.dtype == dtype
    torch.testing.assert_close(out.float(), expected, **TOLERANCES[dtype])
    torch.testing.assert_close(grad.float(), expected_grad, **TOLERANCES[dtype])


def test_structured_mask_on_five_dim_scores_with_shared_key_length():
    x = torch.randn(2, 2, 3, 4, 19, generator=torch.Generator().manual_seed(6))  # (B, G, H, Lq, Lk)
    mask = attnorm.key_padding_mask(torch.tensor([12])) & attnorm.causal_mask(13)
    out = F.scalable_softmax(x, mask=mask, backend="triton")
    expected = F.scalable_softmax(x.double(), mask=mask, backend="torch")
    torch.testing.assert_close(out.double(), expected, **TOLERANCES[torch.float32])


def test_any_dim_and_learnable_parameters():
    x = torch.randn(2, 2, 3, 5, generator=torch.Generator().manual_seed(7)).transpose(-1, -2)  # (B, H, 5, 3)
    for make in (
        lambda backend: attnorm.Entmax(alpha=1.3, learnable=True, num_heads=2, dim=2, backend=backend),
        lambda backend: attnorm.ScalableSoftmax(s=0.5, bias=0.2, learnable=True, num_heads=2, dim=2, backend=backend),
    ):
        triton_module, torch_module = make("triton"), make("torch").double()
        out = triton_module(x)
        expected = torch_module(x.double())
        torch.testing.assert_close(out.double(), expected, **TOLERANCES[torch.float32])
        out.square().sum().backward()
        expected.square().sum().backward()
        for param, expected_param in zip(triton_module.parameters(), torch_module.parameters(), strict=True):
            torch.testing.assert_close(param.grad.double(), expected_param.grad, atol=1e-5, rtol=1e-4)


def test_key_padding_needs_a_batch_axis_and_matching_lengths():
    with pytest.raises(ValueError, match="batch axis"):
        F.softmax(torch.randn(3, 5), mask=attnorm.key_padding_mask(torch.tensor([2, 3, 4])), backend="triton")
    with pytest.raises(ValueError, match="key_lengths must have shape"):
        F.softmax(torch.randn(2, 3, 5), mask=attnorm.key_padding_mask(torch.tensor([2, 3, 4])), backend="triton")


def test_package_import_fails_cleanly_without_triton():
    program = (
        "import sys\n"
        "sys.modules['triton'] = None\n"
        "import torch, attnorm.functional as F\n"
        "try:\n"
        "    import attnorm.kernels.triton\n"
        "except ImportError:\n"
        "    pass\n"
        "else:\n"
        "    raise SystemExit('imported without triton')\n"
        "assert torch.allclose(F.softmax(torch.zeros(4), backend='auto'), torch.full((4,), 0.25))\n"
    )
    subprocess.run([sys.executable, "-c", program], check=True)
